"""Skeletons for framework-native torch.save files (the torch shard format).

Megatron and DeepSpeed write torch.save pickles that hold objects JSON cannot (argparse.Namespace,
enums). For such shards the TRAINER produces the pickle part of the torch.save file itself (``data.pkl``,
with every tensor a persistent reference to storage record i, exactly as torch.save writes it); the
agent only assembles the zip archive from those bytes and the tensor bytes in the slot
(formats/torchzip.py), so it never unpickles anything (docs/reliability.md promise 9). Checkpoint files and
snapshots are only ever read back through the weights-only unpickler with an explicit allow-list
(safeload.py).
"""
from __future__ import annotations

import base64
import collections
import functools
import io
import pickle
from typing import Any, Dict, List, Tuple

import torch

from easyckpt.engine.shards.safeload import weights_only_load

TORCHZIP = "__torchzip"


class _StorageRef:
    __slots__ = ("index", "dtype", "numel")

    def __init__(self, index: int, dtype: torch.dtype, numel: int):
        self.index, self.dtype, self.numel = index, dtype, numel


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


@functools.lru_cache(maxsize=4096)
def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The stride of a contiguous tensor of ``shape``; one tuple per shape, so that the pickle of a tensor of a
    shape seen before refers back to it (a memo entry) instead of writing it again."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


@functools.lru_cache(maxsize=4096)
def _shape(shape: torch.Size) -> Tuple[int, ...]:
    return tuple(shape)


_ORDERED_DICT = (collections.OrderedDict, ())


class _EmptyHooks:
    """A tensor's (empty) backward hooks, as torch.save writes them: an OrderedDict of its own per tensor (one
    shared dict would be every loaded tensor's hooks), reduced directly rather than through OrderedDict's own
    __reduce__ (which asks copyreg for the class's slots at every call)."""
    __slots__ = ()


class _ShardPickler(pickle.Pickler):
    """torch.save's pickle of a tree whose tensors' bytes are kept apart: ``tensors`` gets each tensor met, in
    the order of its storage record."""

    def __init__(self, file: Any, protocol: int, paths: Dict[int, str]):
        super().__init__(file, protocol=protocol)
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self.paths = paths

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise TypeError(f"easyckpt cannot save a {obj.layout} tensor in a torch.save shard; "
                                f"convert it to a dense tensor")
            ref = _StorageRef(len(self.tensors), obj.dtype, obj.numel())
            self.tensors.append((f"{self.paths.get(id(obj), '')}#{ref.index}",
                                 obj.detach() if obj.requires_grad else obj))
            shape = _shape(obj.shape)
            return (torch._utils._rebuild_tensor_v2, (ref, 0, shape, _contiguous_stride(shape), False, _EmptyHooks()))
        if type(obj) is _EmptyHooks:
            return _ORDERED_DICT
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _StorageRef:
            return ("storage", _storage_type(obj.dtype), str(obj.index), "cpu", obj.numel)
        return None


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def _tensor_paths(tree: Any) -> Dict[int, str]:
    """Where each tensor reachable through dicts, lists and tuples sits ("/optimizer/state/0/exp_avg"; the first
    place of one met twice), by the tensor's id: its storage record's name in the slot and in the manifest's items,
    so that a damaged item is named by what it holds. Sequences of scalars (Python's RNG state, 625 ints) are passed
    over whole; a tensor inside another object gets no path. (load/torchparts.py walks a loaded tree the same way
    with tuple paths for its picker; shared, the tuples and joins cost this snapshot-time walk 8-13 % more.)"""
    found: Dict[int, str] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if type(v) not in _SCALARS:
                    walk(v, f"{path}/{k}")
        elif isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), path)
        elif isinstance(obj, (list, tuple)) and not _SCALARS.issuperset(map(type, obj)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")

    walk(tree, "")
    return found


def flatten_pickled(tree: Any) -> Tuple[Any, List[Tuple[str, torch.Tensor]]]:
    """Skeleton {TORCHZIP: data.pkl (base64), "storages": [tensor key of storage record i, ...]}: ``tree``
    pickled as torch.save pickles it, each tensor a persistent reference to storage record i (its bytes come
    from the slot, never from the pickle).

    The C pickler walks the tree itself and calls back only for objects that are not plain containers or
    scalars: a tensor becomes the next storage record wherever it sits (in a dict, a list, an argparse
    Namespace), everything else pickles as torch.save pickles it. A tensor object that occurs twice is one
    record, as in torch.save. This runs at every snapshot of a torch-format shard: a walk in Python that
    built a stand-in tree first cost as much again as the pickle; what is walked in Python now is only the
    way to each tensor, for its name (_tensor_paths)."""
    buf = io.BytesIO()
    pickler = _ShardPickler(buf, protocol=2, paths=_tensor_paths(tree))    # protocol 2: what torch.save writes
    pickler.dump(tree)
    tensors = pickler.tensors
    skeleton = {TORCHZIP: base64.b64encode(buf.getvalue()).decode(), "storages": [k for k, _ in tensors]}
    return skeleton, tensors


def is_pickled(skeleton: Any) -> bool:
    return isinstance(skeleton, dict) and TORCHZIP in skeleton


def unflatten_pickled(skeleton: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """The tree of a torch.save shard held in a snapshot, through the weights-only unpickler (the same
    allow-list as safe_torch_load): a slot is never trusted to run code, even our own."""
    pkl = base64.b64decode(skeleton[TORCHZIP])
    keys = skeleton["storages"]

    def storage(pid: Any) -> Any:
        _tag, _type, index, _location, _numel = pid
        t = tensors[keys[int(index)]]
        return torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)

    return weights_only_load(io.BytesIO(pkl), storage)
