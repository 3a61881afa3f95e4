"""Split a state tree into tensors and a JSON "skeleton" that records where each tensor sits.

The skeleton is plain JSON with a few tags, so that loading a checkpoint never unpickles anything
(docs/reliability.md promise 7). Supported leaves: tensors, numpy arrays, None, bool, int, float, str, bytes, tuples,
lists, dicts (any JSON-able keys), torch.dtype, torch.Size. Anything else is refused at save time
with the path that holds it, instead of silently pickling code into a checkpoint.
"""
from __future__ import annotations

import base64
import collections
import functools
import io
import pickle
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from easyckpt.errors import CheckpointError

try:
    import numpy as np
except ImportError:  # numpy is optional for the engine
    np = None  # type: ignore[assignment]

Tensors = List[Tuple[str, torch.Tensor]]


# a node's path in the tree as (name, parent path): made per node without copying a list; joined only for
# a tensor's key or an error (the walk runs at every snapshot: its per-node cost is the snapshot's fixed cost)
Path = Optional[Tuple[str, Any]]
_PLAIN = (bool, str, type(None))


def _joined(path: Path) -> str:
    names: List[str] = []
    while path is not None:
        names.append(path[0])
        path = path[1]
    return "/".join(reversed(names))


def flatten(tree: Any) -> Tuple[Any, Tensors]:
    tensors: Tensors = []
    used: set = set()

    def add(path: Path, tensor: torch.Tensor) -> str:
        """Keep ``tensor`` under a key made of its path, unique in this tree."""
        key = _joined(path) or "_"
        base, n = key, 1
        while key in used:
            key, n = f"{base}#{n}", n + 1
        used.add(key)
        tensors.append((key, tensor))
        return key

    def walk(obj: Any, path: Path) -> Any:
        kind = type(obj)
        # the common nodes of a state dict first, by exact type (subclasses take the checks in _other)
        if kind is dict:
            if all(type(k) is str and not k.startswith("__") for k in obj):
                return {k: walk(v, (k, path)) for k, v in obj.items()}
            return _keyed(obj, path, walk)       # an optimizer's state, by parameter index
        if kind is int or kind is float or kind in _PLAIN:
            return obj
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise TypeError(f"easyckpt cannot save the {obj.layout} tensor at {_joined(path)}; "
                                f"convert it to a dense tensor")
            # a state dict's tensors are detached already; detaching each again cost a few us per tensor
            return {"__t": add(path, obj.detach() if obj.requires_grad else obj)}
        if kind is list:
            return [walk(v, (str(i), path)) for i, v in enumerate(obj)]
        if kind is tuple:       # (an optimizer's betas)
            return {"__tuple": [walk(v, (str(i), path)) for i, v in enumerate(obj)]}
        return _other(obj, path, walk, add)

    return walk(tree, None), tensors


def _other(obj: Any, path: Path, walk: Callable[[Any, Path], Any],
           add: Callable[[Path, torch.Tensor], str]) -> Any:
    """The nodes flatten's walk does not take by their exact type: subclasses, numpy values, sizes, dtypes,
    bytes; anything else is refused."""
    if np is not None and isinstance(obj, np.ndarray):
        return {"__np": add(path, torch.from_numpy(np.ascontiguousarray(obj)))}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if np is not None and isinstance(obj, np.generic):
        return walk(obj.item(), path)
    if isinstance(obj, torch.Size):
        return {"__size": list(obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype": str(obj).replace("torch.", "")}
    if isinstance(obj, bytes):
        return {"__bytes": base64.b64encode(obj).decode()}
    if isinstance(obj, tuple):
        return {"__tuple": [walk(v, (str(i), path)) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [walk(v, (str(i), path)) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: walk(v, (k, path)) for k, v in obj.items()}
        return _keyed(obj, path, walk)
    raise TypeError(f"easyckpt cannot save a {type(obj).__name__} at '{_joined(path) or '<root>'}': "
                    f"only tensors, numbers, strings, lists, tuples and dicts are stored (no pickling)")


def _keyed(obj: Dict[Any, Any], path: Path, walk: Callable[[Any, Path], Any]) -> Any:
    """A dict whose keys are not all plain strings, as its (key, value) pairs."""
    return {"__dict": [[walk(k, ("key", path)), walk(v, (str(k), path))] for k, v in obj.items()]}


def unflatten(skeleton: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    def walk(obj: Any) -> Any:
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1:
            (tag, val), = obj.items()
            if tag == "__t":
                return tensors[val]
            if tag == "__np":
                return tensors[val].numpy()
            if tag == "__tuple":
                return tuple(walk(v) for v in val)
            if tag == "__dict":
                return {_hashable(walk(k)): walk(v) for k, v in val}
            if tag == "__size":
                return torch.Size(val)
            if tag == "__dtype":
                return getattr(torch, val)
            if tag == "__bytes":
                return base64.b64decode(val)
        return {k: walk(v) for k, v in obj.items()}

    return walk(skeleton)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# ---- skeletons for framework-native torch.save files ---------------------------------------------
#
# Megatron and DeepSpeed write torch.save pickles that hold objects JSON cannot (argparse.Namespace,
# enums). For such shards the TRAINER produces the pickle part of the torch.save file itself (``data.pkl``,
# with every tensor a persistent reference to storage record i, exactly as torch.save writes it); the
# agent only assembles the zip archive from those bytes and the tensor bytes in the slot
# (torchzip.py), so it never unpickles anything (docs/reliability.md promise 9). Checkpoint files and snapshots are only
# ever read back through the weights-only unpickler with an explicit allow-list (safe_torch_load,
# rebuild).

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
        self.tensors: Tensors = []
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
    over whole; a tensor inside another object gets no path."""
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


def flatten_pickled(tree: Any) -> Tuple[Any, Tensors]:
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
    import io

    pkl = base64.b64decode(skeleton[TORCHZIP])
    keys = skeleton["storages"]

    def storage(pid: Any) -> Any:
        _tag, _type, index, _location, _numel = pid
        t = tensors[keys[int(index)]]
        return torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)

    return _weights_only_load(io.BytesIO(pkl), storage)


def _weights_only_load(pkl_file: Any, persistent_load: Any) -> Any:
    from torch import _weights_only_unpickler as wo

    names = wo.get_globals_in_pkl(pkl_file)
    pkl_file.seek(0)
    known = set(wo._get_allowed_globals())
    with torch.serialization.safe_globals(_allow(n for n in names if n not in known)):
        unpickler = wo.Unpickler(pkl_file, encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]  # torch's Unpickler hook
        return unpickler.load()


# Small non-tensor files of a native layout (JSON state, a pickled arguments object, a helper script)
# travel as raw bytes in the snapshot's metadata and are written as they are.
def flatten_raw(data: Any) -> Tuple[Any, Tensors]:
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"a raw shard holds bytes or str, not {type(data).__name__}")
    return {"__raw": base64.b64encode(bytes(data)).decode()}, []


def raw_bytes(skeleton: Any) -> bytes:
    return base64.b64decode(skeleton["__raw"])


DCP = "__dcp"


def flatten_dcp(items: Any) -> Tuple[Any, Tensors]:
    """A torch.distributed.checkpoint data file (``__R_0.distcp``): ``items`` in file order, each a tensor
    (written as DCP's FileSystemWriter writes one: a torch.save archive of that tensor alone) or bytes (a
    BYTE_IO item, written as is). Skeleton {DCP: [{"t": key, "pkl": pickle, "n": item size} | {"b": bytes}]};
    ``dcp_item_size`` gives an item's size, which the checkpoint's metadata must state."""
    if not isinstance(items, list):
        raise TypeError(f"a distcp shard holds a list of tensors and bytes, not {type(items).__name__}")
    entries: List[Any] = []
    tensors: Tensors = []
    for i, item in enumerate(items):
        ident = None
        if isinstance(item, tuple) and len(item) == 2:      # (its identity, the item): see formats/slotmeta
            ident, item = item
        if isinstance(item, (bytes, bytearray)):
            entries.append({"b": base64.b64encode(bytes(item)).decode()})
        elif isinstance(item, torch.Tensor):
            key = f"{i}"
            tensors.append((key, item.detach()))
            pkl, n = _lone_tensor_pickle(item.dtype, tuple(item.shape))
            entries.append({"t": key, "pkl": pkl, "n": n})
        else:
            raise TypeError(f"item {i} of a distcp shard is a {type(item).__name__}, not a tensor or bytes")
        if ident is not None:
            entries[-1]["id"] = ident
    return {DCP: entries}, tensors


@functools.lru_cache(maxsize=4096)
def _lone_tensor_pickle(dtype: torch.dtype, shape: Tuple[int, ...]) -> Tuple[str, int]:
    """torch.save's pickle of one contiguous tensor (it depends on the dtype and shape alone), and the size
    of the archive around it: computed once per shape, not at every snapshot."""
    from easyckpt.formats.torchzip import torch_file_size

    skeleton, _ = flatten_pickled(torch.empty(shape, dtype=dtype, device="meta"))   # no memory
    pkl = skeleton[TORCHZIP]
    numel = 1
    for d in shape:
        numel *= d
    return pkl, torch_file_size(len(base64.b64decode(pkl)), [numel * dtype.itemsize])


def dcp_item_size(item: Any) -> int:
    """The size of one item (a tensor or bytes) in a distcp file as flatten_dcp has it written: what the
    checkpoint's metadata must state, known before the agent writes it."""
    if isinstance(item, (bytes, bytearray)):
        return len(item)
    return _lone_tensor_pickle(item.dtype, tuple(item.shape))[1]


def rebuild(skeleton: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict) and set(skeleton) == {"__raw"}:
        return raw_bytes(skeleton)
    if isinstance(skeleton, dict) and DCP in skeleton:
        return [tensors[e["t"]] if "t" in e else base64.b64decode(e["b"]) for e in skeleton[DCP]]
    return unflatten_pickled(skeleton, tensors) if is_pickled(skeleton) else unflatten(skeleton, tensors)


SAFE_MODULE_PREFIXES = ("torch.", "megatron.", "deepspeed.", "transformers.", "numpy.")
# Plain data classes the frameworks put into their own checkpoint files, rebuilt from their fields only
# (no __reduce__ calls into arbitrary code): DeepSpeed's loss scaler and ZeRO fragment addresses, and
# numpy arrays (RNG states of numpy, saved by Megatron and the HF Trainer).
SAFE_CLASSES = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
}


def _allowed(name: str) -> Any:
    import argparse
    import enum
    import importlib

    if name == "argparse.Namespace":
        return argparse.Namespace
    if name == "signal.Signals":     # Megatron-LM's args.exit_signal: an IntEnum rebuilt from its number
        import signal
        return signal.Signals
    module, _, qual = name.rpartition(".")
    if not (module + ".").startswith(SAFE_MODULE_PREFIXES):
        return None
    try:
        obj = getattr(importlib.import_module(module), qual)
    except (ImportError, AttributeError):
        return None
    if name == "numpy.dtype":     # a dtype unpickles into an instance of its numpy.dtypes class
        import numpy.dtypes
        return [obj] + [c for c in vars(numpy.dtypes).values() if isinstance(c, type)]
    if name in SAFE_CLASSES:
        return obj
    return obj if isinstance(obj, type) and issubclass(obj, enum.Enum) else None


def _allow(names: Iterable[str]) -> List[Any]:
    """The classes behind ``names`` if every one is on the allow-list; ValueError naming the first that
    is not."""
    allowed: List[Any] = []
    for name in names:
        obj = _allowed(name)
        if obj is None:
            raise CheckpointError(f"refusing to load: the file references {name}, which is not on easyckpt's "
                                  f"allow-list (tensors, containers, argparse.Namespace, framework enums and "
                                  f"signal.Signals, "
                                  f"DeepSpeed's loss scaler and fragment addresses, numpy arrays)")
        allowed.extend(obj if isinstance(obj, list) else [obj])
    return allowed


class _MemoryFile(io.RawIOBase):
    """A read-only file over bytes already in memory, without copying them (torch.load reads records
    out of it one by one)."""

    def __init__(self, data: Any):
        self._view, self._pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def safe_torch_load(data: Any) -> Any:
    """torch.load with weights_only=True, allowing argparse.Namespace, Enum classes of the known
    frameworks and the few data classes in SAFE_CLASSES (their modules are imported from the installed
    packages, never from the file). ``data``: the file's bytes (any buffer; not copied)."""
    allowed = _allow(torch.serialization.get_unsafe_globals_in_checkpoint(io.BufferedReader(_MemoryFile(data))))
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BufferedReader(_MemoryFile(data)), weights_only=True, map_location="cpu")
