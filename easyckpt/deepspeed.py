"""DeepSpeed engines (ZeRO 0-3): the three verbs, in DeepSpeed's native ``global_stepN/`` layout.

On-disk layout of step N (``global_step{N}/``), byte for byte what ``engine.save_checkpoint`` writes:
    mp_rank_00_model_states.pt                         module, scheduler, counters, client_state (ZeRO 0-2,
                                                       written by the data-parallel writer)
    zero_pp_rank_{dp}_mp_rank_00_model_states.pt       the same per rank under ZeRO-3
    [bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt this rank's ZeRO optimizer partition
    easyckpt_rng/rank_{r:05d}.safetensors              every rank's RNG states (DeepSpeed keeps none)
and ``latest`` holds ``global_stepN`` after the commit, so ``engine.load_checkpoint(save_dir)`` reads it.

How: for a snapshot, the engine's checkpoint engine is swapped for one that *captures* the state dicts
DeepSpeed hands it instead of writing them (DeepSpeed's own code decides what goes into each file);
the agent later writes them with torch.save. For a load, the swapped engine *serves* the trees easyckpt
read (from memory, or from storage after verifying the manifest), so ``engine.load_checkpoint`` restores
exactly as it would from files. A different data-parallel size is refused by plain ZeRO; easyckpt then
converts the committed step with DeepSpeed's universal-checkpoint converter into a temporary directory
under the save dir, loads it with ``load_universal``, and removes it.

Decision: every rank snapshots the model-states file (memory resume needs no collective), only the
writer persists it. The helper scripts DeepSpeed copies next to the tag directory (zero_to_fp32.py)
are not written by the plain-engine verbs: they would live outside the atomically committed step.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from easyckpt.config import NAMINGS, Config, check_advanced, log_setting
from easyckpt.errors import EasyCkptError
from easyckpt.trainer import rng
from easyckpt.trainer.dist import all_gather
from easyckpt.trainer.session import Engine, EngineSlot
from easyckpt.trainer.snapshot import ShardSpec

NAMING = NAMINGS["deepspeed"]
_ROOT = "/easyckpt-in-memory"      # DeepSpeed composes file names under it; nothing is created there
_UNIVERSAL_INFO = "universal_checkpoint_info"

_slot = EngineSlot("easyckpt.deepspeed")


def _base():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    return CheckpointEngine


def _files_class():
    class InMemoryFiles(_base()):
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
    client = {_UNIVERSAL_INFO: _universal_info(), **(client_state or {})}
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
    return [ShardSpec(prefix + rel, tree, persist=writer if rel == model_rel else True, fmt="torch")
            for rel, tree in files.saved]


def _universal_info() -> Dict[str, Any]:
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def needed_files(prefix: str, dp_rank: int, dp_world: int, manifest: Dict[str, Any]) -> List[Tuple[str, bool]]:
    """Files under ``prefix`` that data-parallel rank ``dp_rank`` reads to resume: the shared ones and its
    own ZeRO partition; every file when the data-parallel size changed (the universal converter reads
    them all). By name, so that it works before the engine exists (the Trainer builds it late)."""
    files = [rel for rel in manifest["files"] if rel.startswith(prefix)]
    saved = int((manifest.get("info") or {}).get("dp_world_size", dp_world))
    if saved != dp_world:
        return [(rel, False) for rel in files]
    mine = re.compile(rf"(^|/)(bf16_)?zero_pp_rank_{dp_rank}_")
    any_rank = re.compile(r"(^|/)(bf16_)?zero_pp_rank_\d+_")
    return [(rel, False) for rel in files if mine.search(rel) or not any_rank.search(rel)]


def dp_rank(engine: Any) -> int:
    import deepspeed.comm as dist
    return dist.get_rank(group=engine.optimizer.dp_process_group) if hasattr(engine.optimizer, "dp_process_group") \
        else engine.global_rank


def same_layout(engine: Any, manifest: Dict[str, Any]) -> bool:
    return int((manifest.get("info") or {}).get("dp_world_size", dp_size(engine))) == dp_size(engine)


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
        raise EasyCkptError(f"DeepSpeed could not load {tag} from the state easyckpt read")
    return client_state or {}


class _Served:
    """DeepSpeed's state-dict loader for an unchanged layout: this rank's model-states file."""

    def __init__(self, files: Any, path: str):
        self.files, self.path = files, path

    def load(self, mp_world_size: int, mp_rank: int, *args: Any, **kwargs: Any):
        return self.path, self.files.load(self.path), None


def restore_universal(engine: Any, tag_dir: str, tag: str, work_dir: str, rank: int, world_size: int,
                      **load_kwargs: Any) -> Dict[str, Any]:
    """Resume on another data-parallel size: convert ``tag_dir`` (the directory holding DeepSpeed's
    files of ``tag``) with DeepSpeed's universal-checkpoint converter (rank 0), load it on every rank
    with ``load_universal``, remove the converted copy."""
    error = None
    if rank == 0:
        shutil.rmtree(work_dir, ignore_errors=True)
        os.makedirs(work_dir)
        # only the files the manifest lists, verified, unpickled safely (the converter itself would glob the
        # directory and torch.load whatever it finds there with weights_only=False)
        from easyckpt.cli.universal import to_universal
        from easyckpt.formats.manifest import MANIFEST_NAME
        # the manifest sits in the step directory: tag_dir itself (plain engine), or its parent (the
        # Trainer's checkpoint-N/global_stepN)
        nested = not os.path.lexists(os.path.join(tag_dir, MANIFEST_NAME))
        step_dir = os.path.dirname(tag_dir.rstrip("/")) if nested else tag_dir
        try:
            to_universal(step_dir, tag, work_dir, prefix=os.path.basename(tag_dir.rstrip("/")) + "/" if nested else "")
        except (ValueError, OSError, subprocess.SubprocessError) as exc:
            error = str(exc)
    errors = [e for e in all_gather(error, world_size) if e]
    try:
        if errors:
            raise EasyCkptError(errors[0])
        config = engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = True
        try:
            path, client_state = engine.load_checkpoint(work_dir, tag, **load_kwargs)
        finally:
            config.load_universal_checkpoint = before
        if path is None:
            raise EasyCkptError(f"DeepSpeed could not load the universal checkpoint converted from {tag_dir}")
        return client_state or {}
    finally:
        all_gather(None, world_size)          # nobody removes the copy while another rank still reads it
        if rank == 0:
            shutil.rmtree(work_dir, ignore_errors=True)


def universal_work_dir(cfg: Config) -> str:
    return os.path.join(cfg.save_dir, f".easyckpt-universal-{cfg.job_id}")


# ---- the three verbs for a DeepSpeed engine used without the Trainer --------------------------------

RNG_DIR = "easyckpt_rng/"


def _rng_file(rank: int) -> str:
    return f"{RNG_DIR}rank_{rank:05d}.safetensors"


def initialize_easyckpt(save_dir: str, save_mem_interval: int = 1, save_storage_interval: int = 5,
                        max_ckpt_num: Optional[int] = 5, log_file_path: Union[str, bool, None] = None,
                        **advanced: Any) -> None:
    """Validate the settings and attach to this node's agent; call after ``deepspeed.initialize``.
    ``advanced``: see easyckpt.config.ADVANCED (e.g. ``exit_after_ondemand_checkpoint=True``)."""
    check_advanced("initialize_easyckpt", advanced)
    _slot.start(Config(save_dir=str(save_dir), save_mem_interval=save_mem_interval,
                       save_storage_interval=save_storage_interval, max_ckpt_num=max_ckpt_num,
                       log_file_path=log_setting(log_file_path),
                       naming=NAMING, **advanced))


def _collector(engine: Engine, ds_engine: Any, client_state: Optional[Dict[str, Any]]):
    step = ds_engine.global_steps
    tag = NAMING.dir_name(step)

    def collect() -> List[ShardSpec]:
        shards = native_shards(ds_engine, tag, client_state=client_state)
        shards.append(ShardSpec(_rng_file(engine.rank), {"iteration": step, "rng": rng.capture()}))
        return shards
    return step, collect


def save_checkpoint_if_needed(ds_engine: Any, client_state: Optional[Dict[str, Any]] = None) -> None:
    """Call after every ``engine.step()``; the step is ``engine.global_steps``. ``client_state`` is
    stored as DeepSpeed stores it (in the model-states file) and returned by load_checkpoint."""
    engine = _slot.require()
    step, collect = _collector(engine, ds_engine, client_state)
    engine.maybe_save(step, collect, info={"dp_world_size": dp_size(ds_engine)}, optimizer=ds_engine.optimizer)


def save_checkpoint_now(ds_engine: Any, client_state: Optional[Dict[str, Any]] = None) -> None:
    """Snapshot the current step (unless it already is) and have it persisted, without waiting for storage."""
    engine = _slot.require()
    step, collect = _collector(engine, ds_engine, client_state)
    engine.persist_now(step, collect, info={"dp_world_size": dp_size(ds_engine)})


def load_checkpoint(ds_engine: Any, load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Restore the newest complete state (memory or storage) into ``ds_engine``; DeepSpeed's return
    value: ``(load_path, client_state)``, ``(None, None)`` when there is nothing to resume from."""
    engine = _slot.require()
    kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                  load_lr_scheduler_states=load_lr_scheduler_states)

    def needed(manifest: Dict[str, Any]) -> List[Tuple[str, bool]]:
        files = needed_files("", dp_rank(ds_engine), dp_size(ds_engine), manifest)
        return [f for f in files if not f[0].startswith(RNG_DIR)] + [(_rng_file(engine.rank), True)]

    loaded = engine.load(needed)
    if loaded is None:
        engine.log.emit("load", step=0, rank=engine.rank, source="none",
                        message="no checkpoint found: starting from scratch")
        return None, None
    tag = NAMING.dir_name(loaded.step)
    manifest = loaded.manifest or {}          # a memory snapshot always has the current layout
    if same_layout(ds_engine, manifest):
        client_state = restore_native(ds_engine, loaded.trees, tag, **kwargs)
    else:
        engine.log.emit("convert", step=loaded.step, rank=engine.rank, path=loaded.path,
                        message=f"data-parallel size {manifest['info'].get('dp_world_size')} → "
                                f"{dp_size(ds_engine)}: loading through DeepSpeed's universal checkpoint")
        client_state = restore_universal(ds_engine, loaded.path, tag, universal_work_dir(engine.cfg), engine.rank,
                                         engine.world_size, **kwargs)
    per_rank = loaded.trees.get(_rng_file(engine.rank))
    if per_rank is not None:
        rng.restore(per_rank["rng"])
    client_state.pop(_UNIVERSAL_INFO, None)
    return loaded.path or os.path.join(engine.cfg.save_dir, tag), client_state


def finalize_easyckpt(timeout: Optional[float] = None) -> Optional[int]:
    """Make the newest state durable (persisted and committed), then release shared memory."""
    return _slot.finalize(timeout)


__all__ = ["initialize_easyckpt", "save_checkpoint_if_needed", "save_checkpoint_now", "load_checkpoint",
           "finalize_easyckpt", "NAMING"]
