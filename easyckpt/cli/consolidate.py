"""Consolidate one committed checkpoint step into ONE safetensors file of the full model weights.

What is read (found from the step's manifest, not guessed from directory names):
    DeepSpeed ``global_stepN/`` (the plain engine's step directory), ZeRO 1-3: the fp32 master weights
        merged from every rank's optimizer partition, exactly as DeepSpeed's ``zero_to_fp32`` merges them
        (buffers and tied parameters included); kind ``deepspeed-zero{stage}``. ZeRO-0 (no optimizer
        partitions): the module weights of ``mp_rank_00_model_states.pt`` as DeepSpeed saved them (fp32 in
        an fp32 run); kind ``deepspeed-zero0``.
    Hugging Face Trainer ``checkpoint-N/``: with a ``global_stepN/`` inside (DeepSpeed ZeRO), that, as
        above (kind ``hf-deepspeed-zero{stage}``: fp32 masters rather than the module copy); otherwise
        ``model.safetensors``, sharded ``model-*-of-*.safetensors`` + ``model.safetensors.index.json``, or
        ``pytorch_model.bin`` (+ its index), keys as the Trainer stored them (kind ``hf``).

Decisions:
- Safety (docs/reliability.md promise 7): a checkpoint's pickles go through ``safe_torch_load`` only. DeepSpeed's merge
  (``deepspeed/utils/zero_to_fp32.py``) is reused rather than re-derived — its padding and alignment rules
  change between releases — but it calls ``torch.load(weights_only=False)``. So for the duration of one
  call, and only inside that module, its global name ``torch`` is a stand-in whose ``load`` serves
  verified, safely unpickled files (every other attribute is torch's); its ``glob`` finds only the files
  the manifest lists (an unlisted file in the step is not part of the checkpoint: never read); its ``tqdm`` and ``print`` are
  silenced (our own progress bar covers the reading; stdout stays clean for ``--json``). The names are
  restored in a ``finally`` and the swap is serialised by a lock; ``torch.load`` itself is never touched.
- Verification: every file read must be listed in the manifest; the sizes of all of them are checked
  before the first byte is used, and each file's checksum before it is unpickled. A damaged file is a
  ValueError that names it; nothing is written then.
- Output: ``safetensors.torch.save`` builds the file in memory (its canonical header and alignment), which
  costs one more copy of the weights next to the merged ones: the merge itself already holds the optimizer's
  fp32 partitions, so this does not change the order of the peak. The bytes go to a temporary file in the
  output's directory, fsync, rename, fsync of the directory: a reader never sees a partial file. Inside
  the step directory the file is also listed in the manifest (``easyckpt verify`` covers it); it may
  replace an earlier consolidated file but never a file of the checkpoint itself. Outside, the checkpoint
  is not touched.
- safetensors refuses tensors that share storage (tied embeddings, views of one flat ZeRO buffer): every
  key is kept, each with storage of its own.

DeepSpeed's universal-checkpoint converter gets the same treatment in universal.py.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from easyckpt.cli import outputs
from easyckpt.cli.outputs import ProgressFactory
from easyckpt.engine.shards.safeload import safe_torch_load
from easyckpt.errors import CheckpointError
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import DS_MODEL_STATES, DS_OPTIM_STATES
from easyckpt.storage import stepfiles
from easyckpt.storage.resolve import storage_for
from easyckpt.storage.stepfiles import damaged_message

Weights = Dict[str, torch.Tensor]

# DeepSpeed's file names, as easyckpt's DeepSpeed adapter writes them (optionally under global_stepN/,
# which is where the Trainer puts them inside checkpoint-N)
_HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_HF_SINGLE = ("model.safetensors", "pytorch_model.bin")
_ZERO_TO_FP32_LOCK = threading.Lock()


def to_safetensors(step_dir: str, output: str, progress: Optional[ProgressFactory] = None) -> Dict[str, Any]:
    """Write the full model weights of the committed step ``step_dir`` to the safetensors file ``output``.

    Returns ``{"output": output, "tensors": count, "bytes": total tensor bytes, "kind": ...}``, kind one of
    ``deepspeed-zero{0,1,2,3}``, ``hf-deepspeed-zero{1,2,3}``, ``hf``. ``progress(total_bytes, description)``
    gives the bars drawn around reading and writing. ValueError, with what to do, when ``step_dir`` is not a
    committed checkpoint, holds no layout this converts, a file of it is damaged, or ``output`` would
    replace a file of the checkpoint. pretrained.py writes the from_pretrained-ready folder instead."""
    source = open_step(step_dir)
    source.refuse_replacing(output)
    kind, weights = source.merged(progress)
    from safetensors.torch import save
    data = save(weights, metadata={"format": "pt", "easyckpt_kind": kind, "easyckpt_step": str(source.step)})
    source.write({output: data}, progress)
    return {"output": output, "tensors": len(weights), "kind": kind,
            "bytes": sum(t.numel() * t.element_size() for t in weights.values())}


class Source:
    """One committed step being converted: what to read (its plan), reading it verified, and writing outputs
    that never replace a file of the checkpoint (those inside the step are listed in its manifest)."""

    def __init__(self, step_dir: str, manifest: mf.Manifest):
        self.step_dir, self.manifest = step_dir, manifest
        self.step = manifest.step
        self.reader = _Reader(step_dir, manifest)
        self.plan = _plan(self.reader)

    def refuse_replacing(self, output: str) -> None:
        outputs.refuse_replacing(self.step_dir, self.manifest, output)

    def merged(self, progress: Optional[ProgressFactory]) -> Tuple[str, Weights]:
        """(kind, the full weights), each key with storage of its own."""
        problems = stepfiles.check_sizes(self.step_dir, self.manifest, self.plan.files)
        if problems:
            raise CheckpointError(damaged_message(self.step_dir, problems))
        with outputs.bar(progress, sum(self.manifest.files[rel].size for rel in self.plan.files), "read") as bar:
            self.reader.bar = bar
            kind, weights = _load(self.plan, self.reader)
            self.reader.bar = None
        return kind, _unshared(weights)

    def write(self, files: Dict[str, bytes], progress: Optional[ProgressFactory], stale: Sequence[str] = ()) -> None:
        outputs.write(self.step_dir, self.manifest, files, progress, stale)


def open_step(step_dir: str) -> Source:
    step_dir = os.path.abspath(step_dir) if storage_for(step_dir).local else step_dir
    try:
        man = stepfiles.load(step_dir)
    except (OSError, ValueError) as exc:
        why = f"{mf.MANIFEST_NAME} is missing" if isinstance(exc, FileNotFoundError) else str(exc)
        raise CheckpointError(f"{step_dir} is not a committed easyckpt checkpoint: {why} (a save that did not finish "
                              f"leaves none); pick a committed step (`easyckpt ls SAVE_DIR`)") from None
    return Source(step_dir, man)


# ---- what to read -----------------------------------------------------------------------------------

@dataclass
class _Plan:
    framework: str                 # "deepspeed" (its own step dir) or "hf"
    files: List[str]               # every file the conversion reads, relative to the step dir
    ds_dir: Optional[str] = None   # DeepSpeed's tag directory relative to the step dir ("" : the step dir)
    index: Dict[str, str] = field(default_factory=dict)   # an HF index's weight_map, if sharded


def _plan(reader: _Reader) -> _Plan:
    listed = sorted(reader.manifest.files)
    ds_dirs = sorted({m.group("dir") or "" for rel in listed for m in [DS_MODEL_STATES.match(rel)] if m})
    if len(ds_dirs) > 1:
        raise ValueError(f"{reader.step_dir} holds DeepSpeed files of several tags ({', '.join(ds_dirs)}); "
                         f"expected one")
    if ds_dirs:
        ds_dir = ds_dirs[0]
        files = [rel for rel in listed if (DS_MODEL_STATES.match(rel) or DS_OPTIM_STATES.match(rel))
                 and os.path.dirname(rel) == ds_dir]
        return _Plan("hf" if ds_dir else "deepspeed", files, ds_dir=ds_dir)
    for index_name in _HF_INDEXES:
        if index_name in reader.manifest.files:
            index = _weight_map(reader, index_name)
            return _Plan("hf", [index_name] + sorted(set(index.values())), index=index)
    for name in _HF_SINGLE:
        if name in reader.manifest.files:
            return _Plan("hf", [name])
    raise ValueError(f"{reader.step_dir}: no model weights found to convert. Its manifest lists "
                     f"{', '.join(listed) or 'no files'}; expected DeepSpeed's *_model_states.pt / "
                     f"*_optim_states.pt (directly or under global_stepN/), or the Trainer's model.safetensors, "
                     f"model-*-of-*.safetensors with model.safetensors.index.json, or pytorch_model.bin")


def _weight_map(reader: _Reader, index_name: str) -> Dict[str, str]:
    try:
        weight_map = json.loads(reader.bytes(index_name))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index_name} in {reader.step_dir} is not a valid index ({exc})") from exc
    base = os.path.dirname(index_name)
    shards = {os.path.join(base, s) for s in weight_map.values()}
    unlisted = sorted(s for s in shards if s not in reader.manifest.files)
    if unlisted:
        raise ValueError(f"{index_name} names shards that are not part of the committed checkpoint "
                         f"{reader.step_dir}: {', '.join(unlisted)}")
    return {key: os.path.join(base, shard) for key, shard in weight_map.items()}


# ---- reading: listed, verified, never executed --------------------------------------------------------

class _Reader:
    """The files of one committed step: each must be in its manifest and match its checksum before its
    bytes are used; pickles are loaded with the allow-list of safe_torch_load."""

    def __init__(self, step_dir: str, manifest: mf.Manifest):
        self.step_dir, self.manifest = step_dir, manifest
        self.bar: Optional[outputs.Progress] = None

    def bytes(self, rel: str) -> bytes:
        if rel not in self.manifest.files:
            raise ValueError(f"{rel} is not listed in the manifest of {self.step_dir}: refusing to read a file "
                             f"that is not part of the committed checkpoint")
        try:
            data = stepfiles.read_verified(self.step_dir, rel, self.manifest)
        except OSError as exc:
            raise CheckpointError(damaged_message(self.step_dir, [f"{rel}: unreadable ({exc})"])) from exc
        except ValueError as exc:
            raise CheckpointError(damaged_message(self.step_dir, [str(exc)])) from exc
        if self.bar is not None:
            self.bar.update(len(data))
        return data

    def torch(self, rel: str) -> Any:
        data = self.bytes(rel)
        try:
            return safe_torch_load(data)
        except ValueError as exc:
            raise ValueError(f"{os.path.join(self.step_dir, rel)}: {exc}") from exc

    def rel(self, path: str) -> str:
        return os.path.relpath(os.path.realpath(path), os.path.realpath(self.step_dir))


# ---- merging ------------------------------------------------------------------------------------------

def _load(plan: _Plan, reader: _Reader) -> Tuple[str, Weights]:
    if plan.ds_dir is not None:
        stage, weights = _deepspeed_weights(plan, reader)
        return f"{'hf-' if plan.framework == 'hf' else ''}deepspeed-zero{stage}", weights
    return "hf", _hf_weights(plan, reader)


def _deepspeed_weights(plan: _Plan, reader: _Reader) -> Tuple[int, Weights]:
    prefix = f"{plan.ds_dir}/" if plan.ds_dir else ""
    if not any(DS_OPTIM_STATES.match(rel) for rel in plan.files):
        # ZeRO-0: no optimizer partitions; the module's state dict is complete in the model-states file
        model = prefix + "mp_rank_00_model_states.pt"
        if model not in plan.files:
            raise ValueError(f"{reader.step_dir}: DeepSpeed model states without optimizer partitions, but no "
                             f"{model}: found {', '.join(plan.files)}")
        tree = reader.torch(model)
        return 0, _tensors_only(tree.get("module") if isinstance(tree, dict) else tree, model)
    zero_to_fp32 = _import_zero_to_fp32()
    shim = _SafeTorch(reader)
    assert plan.ds_dir is not None      # DeepSpeed's plans name their tag directory ("" for the step dir)
    ds_path = os.path.join(reader.step_dir, plan.ds_dir)
    with _ZERO_TO_FP32_LOCK, _module_globals(zero_to_fp32, torch=shim, glob=_ListedGlob(reader), tqdm=_no_tqdm,
                                             print=_silent):
        try:
            lazy = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint(ds_path, False)
            weights = zero_to_fp32.to_torch_tensor(lazy)
        except ValueError:
            raise
        except (FileNotFoundError, KeyError, NotImplementedError, AttributeError, TypeError, RuntimeError) as exc:
            raise ValueError(f"DeepSpeed's zero_to_fp32 cannot merge {ds_path} ({type(exc).__name__}: {exc}); "
                             f"files: {', '.join(plan.files)}") from exc
    if shim.zero_stage is None:
        raise ValueError(f"{ds_path}: the optimizer files name no ZeRO stage")
    return shim.zero_stage, weights


def _import_zero_to_fp32() -> Any:
    # DeepSpeed's first import logs its accelerator probe to stdout, where `convert --json` prints its
    # summary; its logger keeps the stream it was created with, so under this redirect it logs to stderr
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils import zero_to_fp32
    return zero_to_fp32


class _SafeTorch:
    """Stands in for ``torch`` inside zero_to_fp32 during one call: torch's attributes, except ``load``,
    which serves a file of the checkpoint read through _Reader (listed, verified, allow-listed unpickling)."""

    def __init__(self, reader: _Reader):
        self._reader = reader
        self.zero_stage: Optional[int] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        rel = self._reader.rel(os.fspath(f))
        tree = _native_shapes(self._reader.torch(rel))
        stage = (tree.get("optimizer_state_dict") or {}).get("zero_stage") if isinstance(tree, dict) else None
        if stage is not None:
            self.zero_stage = int(stage)
        return tree


class _ListedGlob:
    """Stands in for the ``glob`` module inside zero_to_fp32: it finds the files it globs for among those the
    manifest lists, so an unlisted file in the step directory is not part of the merge (never read)."""

    def __init__(self, reader: _Reader):
        self._reader = reader

    def glob(self, pattern: str, *args: Any, **kwargs: Any) -> List[str]:
        folder = os.path.normpath(os.path.dirname(pattern))
        found = []
        for rel in self._reader.manifest.files:
            path = os.path.join(self._reader.step_dir, rel)
            if os.path.dirname(path) == folder and fnmatch.fnmatchcase(path, pattern):
                found.append(path)
        return sorted(found)


def _native_shapes(tree: Any) -> Any:
    """DeepSpeed stores parameter shapes as torch.Size and its ZeRO-3 merge calls ``.numel()`` on them.
    Checkpoints written before engine/shards/torchpickle.py kept torch.Size through shared memory hold plain tuples
    there; give them back their type so that those convert too (newer ones already have it)."""
    if not isinstance(tree, dict):
        return tree
    if isinstance(tree.get("param_shapes"), list):
        tree["param_shapes"] = [_sized(group) for group in tree["param_shapes"]]
    if isinstance(tree.get("frozen_param_shapes"), dict):
        tree["frozen_param_shapes"] = _sized(tree["frozen_param_shapes"])
    return tree


def _sized(shapes: Any) -> Any:
    if not isinstance(shapes, dict):
        return shapes
    return type(shapes)((k, torch.Size(v) if isinstance(v, (tuple, list)) else v) for k, v in shapes.items())


def _no_tqdm(iterable: Any, *args: Any, **kwargs: Any) -> Any:
    return iterable


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


@contextlib.contextmanager
def _module_globals(module: Any, **names: Any) -> Iterator[None]:
    """Rebind global names of one module for the duration of a block; always restored."""
    missing = object()
    saved = {name: module.__dict__.get(name, missing) for name in names}
    module.__dict__.update(names)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value


def _hf_weights(plan: _Plan, reader: _Reader) -> Weights:
    weights: Weights = {}
    for rel in plan.files:
        if rel in _HF_INDEXES:
            continue
        if rel.endswith(".safetensors"):
            from safetensors.torch import load
            part = load(reader.bytes(rel))
        else:
            part = _tensors_only(reader.torch(rel), rel)
        twice = sorted(weights.keys() & part.keys())
        if twice:
            raise ValueError(f"{rel} repeats tensors of another shard: {', '.join(twice[:5])}")
        weights.update(part)
    if plan.index:
        missing = sorted(plan.index.keys() - weights.keys())
        if missing:
            raise ValueError(f"the shards in {reader.step_dir} lack tensors its index names: {', '.join(missing[:5])}")
    return weights


def _tensors_only(state: Any, rel: str) -> Weights:
    if not isinstance(state, dict):
        raise ValueError(f"{rel} holds a {type(state).__name__}, not a state dict of tensors")
    others = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise ValueError(f"{rel}: entries that are not tensors: {', '.join(map(str, others[:5]))}")
    return dict(state)


def _unshared(weights: Weights) -> Weights:
    """Every key with storage of its own, contiguous: safetensors refuses shared storage (tied weights,
    views into one flat ZeRO buffer). A tensor that already owns its whole storage alone is kept as is."""
    owners = Counter(t.untyped_storage().data_ptr() for t in weights.values())
    out: Weights = {}
    for key, t in weights.items():
        t = t.detach()
        alone = (owners[t.untyped_storage().data_ptr()] == 1 and t.is_contiguous() and t.storage_offset() == 0
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        out[key] = t if alone else t.contiguous().clone()
    return out


__all__ = ["to_safetensors"]
