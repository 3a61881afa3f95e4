"""What is inside one checkpoint step: every tensor (file, key, dtype, shape, bytes), the bytes by group
(model, optimizer, other), the arguments the job saved and the metadata. ``easyckpt inspect`` prints it.

Decisions:
- safetensors files (easyckpt's shards, the Trainer's ``model.safetensors``) are described from their
  header alone: no tensor byte is read. torch.save files (Megatron's ``model_optim_rng.pt``, DeepSpeed's
  ``*_states.pt``) have to be unpickled, with easyckpt's safe loader (weights_only and an allow-list);
  a file it refuses (the Trainer's ``training_args.bin`` is a pickled TrainingArguments) is listed as not
  loaded, with the reason, never unpickled.
- Groups: the first key of a tensor's path when it names one (``model``/``module`` → model,
  ``optimizer``… → optimizer), else the file name (``*optim*`` → optimizer, ``*model*`` → model), else other.
- Saved arguments: Megatron's ``args`` namespace, DeepSpeed's ``ds_config``, the Trainer's
  ``trainer_state.json``; metadata: the manifest (less its file list) and the scalar fields at the top
  of each torch file (iteration, checkpoint_version, ds_version, …).
- Only the files the manifest lists are opened, each through manifest.open_entry (inside the step, never
  through a symlink). A step whose manifest is damaged shows no file at all: there is no list to trust.
  A step with no manifest (a framework's own save) is described from its regular files on disk, opened
  the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from easyckpt.cli.catalog import Entry
from easyckpt.formats import manifest as mf
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.shardfile import DTYPE_NAMES
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.storage import stepfiles
from easyckpt.storage.resolve import storage_for

GROUPS = ("model", "optimizer", "other")
_MODEL_KEYS = ("model", "module")
_OPTIM_KEYS = ("optimizer", "optimizer_state_dict", "optim")
_ARG_KEYS = ("args", "ds_config")
_DTYPES = {short: name for name, short in DTYPE_NAMES.items()}   # safetensors name -> torch name

ProgressFactory = Callable[[int, str], Any]


def describe(entry: Entry, progress: Optional[ProgressFactory] = None) -> Dict[str, Any]:
    """Everything ``easyckpt inspect`` shows about one step, as plain JSON-able data."""
    try:
        man: Optional[Manifest] = stepfiles.load(entry.path)
        files = _files(entry.path, man)
    except FileNotFoundError:
        man = None
        files = _files(entry.path, None)
    except (OSError, ValueError):
        man, files = None, []        # damaged manifest: nothing listed can be trusted (entry.why says why)
    tensors: List[Dict[str, Any]] = []
    args: Dict[str, Any] = {}
    metadata: Dict[str, Any] = {}
    listed: List[Dict[str, Any]] = []
    torch_bytes = sum(size for rel, size, fmt in files if fmt == ShardFormat.TORCH)
    bar = progress(torch_bytes, "inspect") if progress and torch_bytes else None
    try:
        for rel, size, fmt in files:
            item: Dict[str, Any] = {"file": rel, "bytes": size, "format": fmt.value}
            try:
                if fmt == ShardFormat.SAFETENSORS:
                    found = list(_safetensors_tensors(entry.path, rel))
                elif fmt == ShardFormat.TORCH:
                    found = _torch_tensors(entry.path, rel, args, metadata)
                    if bar is not None:
                        bar.update(size)
                else:
                    found = []
                    if rel.endswith(".json"):
                        _json_metadata(entry.path, rel, args, metadata)
                    elif rel.endswith(".bin"):
                        item["not_loaded"] = _binary(entry.path, rel)
            except (OSError, ValueError, RuntimeError) as exc:
                item["not_loaded"] = str(exc)
                found = []
            for key, dtype, shape, nbytes in found:
                tensors.append({"file": rel, "key": key, "dtype": dtype, "shape": shape, "bytes": nbytes,
                                "group": group_of(rel, key)})
            item["tensors"] = len(found)
            listed.append(item)
    finally:
        if bar is not None:
            bar.close()
    tensors.sort(key=lambda t: GROUPS.index(t["group"]))    # model first, in file order within a group
    groups = {g: {"bytes": 0, "tensors": 0} for g in GROUPS}
    for t in tensors:
        groups[t["group"]]["bytes"] += t["bytes"]
        groups[t["group"]]["tensors"] += 1
    manifest = {k: v for k, v in (man.to_json() if man else {}).items() if k != "files"}   # (inspect --json)
    return {"step": entry.step, "path": entry.path, "framework": entry.framework, "complete": entry.complete,
            "why": entry.why, "layout": entry.layout, "files": listed, "groups": groups, "tensors": tensors,
            "args": args, "metadata": {"manifest": manifest, **metadata}}


def group_of(rel: str, key: str) -> str:
    first = key.split(".", 1)[0]
    if first.startswith(_MODEL_KEYS):
        return "model"
    if first.startswith(_OPTIM_KEYS):
        return "optimizer"
    name = os.path.basename(rel)
    if "optim" in name:
        return "optimizer"
    if "model" in name and not first.startswith(("rng", "lr_scheduler", "opt_param_scheduler")):
        return "model"
    return "other"


def _files(step_dir: str, man: Optional[Manifest]) -> List[Tuple[str, int, ShardFormat]]:
    """(relpath, size, format) of the step's files: the manifest's list, else what is on disk."""
    if man is not None:
        return [(rel, e.size, e.format or ShardFormat.of_filename(rel)) for rel, e in man.files.items()]
    # regular files only: a symlink is listed by its own size and never followed (Storage.files)
    return sorted((rel, size, ShardFormat.of_filename(rel)) for rel, size in storage_for(step_dir).files(step_dir)
                  if rel != mf.MANIFEST_NAME)


def _binary(step_dir: str, rel: str) -> str:
    """What a ``.bin`` file is, from its first bytes (never from its name alone: it may be any file)."""
    with stepfiles.open_entry(step_dir, rel) as f:
        head = f.read(4)
    if head.startswith(b"PK\x03\x04"):
        what = "a torch.save archive (a pickled Python object inside"
        what += ", the Trainer's TrainingArguments)" if os.path.basename(rel) == "training_args.bin" else ")"
    elif head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        what = "a pickled Python object"
    else:
        return f"neither a pickle nor a torch.save archive (it begins with {head!r}): not read further"
    return f"{what}: easyckpt never unpickles it, loading a checkpoint must not run its code"


def _safetensors_tensors(step_dir: str, rel: str) -> Iterator[Tuple[str, str, List[int], int]]:
    with stepfiles.open_entry(step_dir, rel) as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > stepfiles.entry_size(step_dir, rel) - 8:
            raise ValueError(f"safetensors header length {n} exceeds the file")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for key, info in header.items():
        begin, end = info["data_offsets"]
        yield key, _DTYPES.get(info["dtype"], info["dtype"]), list(info["shape"]), end - begin


def _torch_tensors(step_dir: str, rel: str, args: Dict[str, Any], metadata: Dict[str, Any]):
    import torch

    from easyckpt.engine.shards.safeload import safe_torch_load
    tree = safe_torch_load(bytes(stepfiles.read_entry(step_dir, rel)))
    found = [(key, str(t.dtype).replace("torch.", ""), list(t.shape), t.numel() * t.element_size())
             for key, t in _walk(tree, "") if isinstance(t, torch.Tensor)]
    if isinstance(tree, dict):
        scalars = {str(k): v for k, v in tree.items() if isinstance(v, (int, float, str, bool)) or v is None}
        if scalars:
            metadata[rel] = scalars
        for k in _ARG_KEYS:
            if k in tree and tree[k] is not None and k not in args:
                args[k] = _plain(tree[k])
    return found


def _json_metadata(step_dir: str, rel: str, args: Dict[str, Any], metadata: Dict[str, Any]) -> None:
    data = json.loads(bytes(stepfiles.read_entry(step_dir, rel)))
    if os.path.basename(rel) == "trainer_state.json" and isinstance(data, dict):
        args["trainer_state"] = {k: v for k, v in data.items() if k != "log_history"}
        args["trainer_state"]["log_history_entries"] = len(data.get("log_history") or [])
    else:
        metadata[rel] = data


def _walk(tree: Any, prefix: str) -> Iterator[Tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _walk(v, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(tree, argparse.Namespace):
        yield from _walk(vars(tree), prefix)
    else:
        yield prefix, tree


def _plain(value: Any) -> Any:
    """JSON-able form of saved arguments (a Namespace becomes a dict; odd values their repr)."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)
