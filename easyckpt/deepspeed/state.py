"""DeepSpeed's checkpoint files in memory: what the DeepSpeed adapter and the Trainer's (with DeepSpeed) share.

For a snapshot, the engine's checkpoint engine is swapped for one that *captures* the state dicts
DeepSpeed hands it instead of writing them (DeepSpeed's own code decides what goes into each file); the
agent later writes them as torch.save files. For a load, the swapped engine *serves* the trees easyckpt
read (from memory, or from storage after verifying the manifest), so ``engine.load_checkpoint`` restores
exactly as it would from files. Another data-parallel size goes through DeepSpeed's universal checkpoint
(universal.py). No file I/O here: names are composed under a root that is never created.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from easyckpt.deepspeed import universal
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.errors import CheckpointError
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.shardformat import ShardFormat

_ROOT = "/easyckpt-in-memory"      # DeepSpeed composes file names under it; nothing is created there
UNIVERSAL_INFO = "universal_checkpoint_info"


def _base():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    return CheckpointEngine


def _files_class():
    engine_class: Any = _base()     # deepspeed's class, imported only when needed

    class InMemoryFiles(engine_class):
        """A checkpoint engine whose files are a dict: saves are captured, loads are served."""

        def __init__(self, base: str, trees: Optional[Dict[str, Any]] = None):
            super().__init__(None)
            self.name = "easyckpt"
            self.base = base              # the tag directory: names are taken relative to it
            self.trees = trees or {}
            self.saved: List[Tuple[str, Any]] = []

        def create(self, info):
            pass

        def makedirs(self, path, exist_ok=False):
            pass

        def save(self, state_dict, path):
            self.saved.append((os.path.relpath(path, self.base), state_dict))

        def load(self, path, map_location=None):
            rel = os.path.relpath(path, self.base)
            if rel not in self.trees:
                raise FileNotFoundError(f"{rel} is not part of the checkpoint easyckpt is loading")
            return self.trees[rel]

        def commit(self, info):
            return True

    return InMemoryFiles


@contextmanager
def _files(engine: Any, tag: str, trees: Optional[Dict[str, Any]] = None) -> Iterator[Any]:
    files = _files_class()(os.path.join(_ROOT, tag), trees)
    saved = engine.checkpoint_engine
    engine.checkpoint_engine = files
    try:
        yield files
    finally:
        engine.checkpoint_engine = saved


def model_file(engine: Any, tag: str) -> str:
    """This rank's model-states file, relative to the tag directory."""
    return os.path.relpath(engine._get_ckpt_name(_ROOT, tag), os.path.join(_ROOT, tag))


def zero_file(engine: Any, tag: str) -> Optional[str]:
    if not engine.zero_optimization():
        return None
    return os.path.relpath(engine._get_zero_ckpt_name(_ROOT, tag), os.path.join(_ROOT, tag))


def dp_size(engine: Any) -> int:
    return int(getattr(engine, "seq_dp_world_size", None) or engine.dp_world_size)


def native_shards(engine: Any, tag: str, prefix: str = "",
                  client_state: Optional[Dict[str, Any]] = None) -> List[ShardSpec]:
    """This rank's files of ``engine.save_checkpoint(save_dir, tag)`` (relative to the tag directory), as
    ShardSpecs under ``prefix``. No file I/O, and no collective but ZeRO-3's own save epilogue (an all-gather
    of its persistent parameters): the state dicts hold the live tensors, the snapshot copies them."""
    writer = bool(engine.save_non_zero_checkpoint)
    client = {UNIVERSAL_INFO: _universal_info(), **(client_state or {})}
    # ZeRO-3 partitions every parameter before a save (and gathers the persistent ones again after):
    # the saved module holds placeholders, as DeepSpeed's own loader expects
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    try:
        with _files(engine, tag) as files:
            engine.save_non_zero_checkpoint = True
            try:
                engine._save_checkpoint(_ROOT, tag, client_state=client)
            finally:
                engine.save_non_zero_checkpoint = writer
            if engine.zero_optimization() and engine.save_zero_checkpoint:
                engine._copy_recovery_script = lambda path: None   # a file copy DeepSpeed does on its own
                try:
                    engine._save_zero_checkpoint(_ROOT, tag)
                finally:
                    del engine._copy_recovery_script
    finally:
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()
    model_rel = model_file(engine, tag)
    return [ShardSpec(prefix + rel, tree, persist=writer if rel == model_rel else True, fmt=ShardFormat.TORCH)
            for rel, tree in files.saved]


def snapshot_bytes(engine: Any) -> int:
    """About the tensor bytes of this rank's files of a save (what native_shards captures), without
    making one: the module's state (ZeRO-3 saves placeholders instead) and the optimizer's. Under ZeRO,
    the torch optimizer inside its wrapper steps fp32 partitions, which the optimizer-states file holds
    next to that optimizer's state; the Adam moments its first step creates are counted before it."""
    from easyckpt.engine.save import estimate

    stage = engine.zero_optimization_stage() if engine.zero_optimization() else 0
    total = 0 if stage == 3 else estimate.tensor_bytes(engine.module.state_dict())
    opt = engine.optimizer
    if opt is None:
        return total
    basic = getattr(opt, "optimizer", opt)      # ZeRO's and the fp16/bf16 wrappers hold the torch optimizer
    # ZeRO-3 hands its fp32 partitions to the torch optimizer only for the length of a step
    flats = list(getattr(opt, "fp32_partitioned_groups_flat", None) or
                 [p for g in basic.param_groups for p in g["params"]])
    state = sum(estimate.tensor_bytes(v) for v in basic.state.values())
    if not state and any("betas" in g for g in basic.param_groups):   # Adam's moments, from its first step
        state = estimate.adam_moments(flats)
    return total + (estimate.tensor_bytes(flats) if stage else 0) + state


def _universal_info() -> Dict[str, Any]:
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def needed_files(prefix: str, dp_rank: int, dp_world: int, manifest: Manifest) -> List[Tuple[str, bool]]:
    """Files under ``prefix`` that data-parallel rank ``dp_rank`` reads to resume: the shared ones and its
    own ZeRO partition; every file when the data-parallel size changed (the universal converter reads
    them all). By name, so that it works before the engine exists (the Trainer builds it late)."""
    files = [rel for rel in manifest.files if rel.startswith(prefix)]
    saved = saved_dp_size(manifest, dp_world)
    if saved != dp_world:
        return [(rel, False) for rel in files]
    mine = re.compile(rf"(^|/)(bf16_)?zero_pp_rank_{dp_rank}_")
    any_rank = re.compile(r"(^|/)(bf16_)?zero_pp_rank_\d+_")
    return [(rel, False) for rel in files if mine.search(rel) or not any_rank.search(rel)]


def dp_rank(engine: Any) -> int:
    import deepspeed.comm as dist
    return dist.get_rank(group=engine.optimizer.dp_process_group) if hasattr(engine.optimizer, "dp_process_group") \
        else engine.global_rank


def saved_dp_size(manifest: Manifest, default: int) -> int:
    """The data-parallel size a step was saved with (the adapter's info, or an adopted step's count of ZeRO
    partitions); ``default`` where none is recorded."""
    value = manifest.info.get("dp_world_size", default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def same_layout(engine: Any, manifest: Optional[Manifest]) -> bool:
    """Whether a step was saved on this engine's data-parallel size (a memory snapshot, no manifest, always is)."""
    return manifest is None or saved_dp_size(manifest, dp_size(engine)) == dp_size(engine)


def restore_native(engine: Any, trees: Dict[str, Any], tag: str, prefix: str = "", **load_kwargs: Any) -> Dict[str, Any]:
    """``engine.load_checkpoint`` fed from ``trees`` (relpath → state dict); returns the client state."""
    from deepspeed.runtime import state_dict_factory

    served = {rel[len(prefix):]: tree for rel, tree in trees.items() if rel.startswith(prefix)}
    model_path = os.path.join(_ROOT, tag, model_file(engine, tag))
    factory = state_dict_factory.SDLoaderFactory
    original = factory.__dict__["get_sd_loader"]
    with _files(engine, tag, served) as files:
        # DeepSpeed finds the model-states file by globbing the disk and checks that it exists: with the
        # same layout it is this rank's own file, which the served files hold
        engine._get_all_ckpt_names = lambda path, tag: [model_path]
        factory.get_sd_loader = staticmethod(lambda ckpt_list, checkpoint_engine, *a, **k: _Served(files, model_path))
        try:
            path, client_state = engine.load_checkpoint(_ROOT, tag, **load_kwargs)
        finally:
            factory.get_sd_loader = original
            del engine._get_all_ckpt_names
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {tag} from the state easyckpt read")
    return client_state or {}


class _Served:
    """DeepSpeed's state-dict loader for an unchanged layout: this rank's model-states file."""

    def __init__(self, files: Any, path: str):
        self.files, self.path = files, path

    def load(self, mp_world_size: int, mp_rank: int, *args: Any, **kwargs: Any):
        return self.path, self.files.load(self.path), None


def restore_universal(engine: Any, tag_dir: str, tag: str, scratch: str, converts: bool, world_size: int,
                      **load_kwargs: Any) -> Dict[str, Any]:
    """Resume on another data-parallel size: ``engine.load_checkpoint`` with ``load_universal`` from the
    universal checkpoint converted from ``tag_dir`` into ``scratch`` (universal.py does the conversion, on the rank
    that ``converts``, and removes it)."""
    with universal.converted(tag_dir, tag, scratch, converts, world_size) as converted:
        config = engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = True
        try:
            path, client_state = engine.load_checkpoint(converted, tag, **load_kwargs)
        finally:
            config.load_universal_checkpoint = before
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the universal checkpoint converted from {tag_dir}")
        return client_state or {}
