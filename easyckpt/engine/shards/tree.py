"""Split a state tree into tensors and a JSON "skeleton" that records where each tensor sits.

The skeleton is plain JSON with a few tags, so that loading a checkpoint never unpickles anything
(docs/reliability.md promise 7). Supported leaves: tensors, numpy arrays, None, bool, int, float, str, bytes, tuples,
lists, dicts (any JSON-able keys), torch.dtype, torch.Size. Anything else is refused at save time
with the path that holds it, instead of silently pickling code into a checkpoint.
"""
from __future__ import annotations

import base64
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from easyckpt.engine.shards.torchpickle import TORCHZIP, flatten_pickled, is_pickled, unflatten_pickled

try:
    import numpy as np
except ImportError:  # numpy is optional for the engine
    np = None  # type: ignore[assignment]

Tensors = List[Tuple[str, torch.Tensor]]


# a node's path in the tree as the names from the root, each followed by "/" ("" at the root): one concatenation
# per node; a tensor's key is its path without the last "/" (the walk runs at every snapshot: its per-node cost is
# the snapshot's fixed cost; a linked (name, parent) pair joined per tensor cost a third of an optimizer's walk)
Path = str


def _joined(path: Path) -> str:
    return path[:-1]


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
            if _plain_keys(obj):
                return {k: walk(v, path + k + "/") for k, v in obj.items()}
            return _keyed(obj, path, walk)       # an optimizer's state, by parameter index
        if kind in _SCALARS:
            return obj
        if kind is not _TENSOR and not isinstance(obj, _TENSOR):
            return _rest(obj, path, walk, add)
        if obj.layout is not _STRIDED:
            raise TypeError(f"easyckpt cannot save the {obj.layout} tensor at {_joined(path)}; "
                            f"convert it to a dense tensor")
        # a state dict's tensors are detached already; detaching each again cost a few us per tensor
        return {"__t": add(path, obj.detach() if obj.requires_grad else obj)}

    return walk(tree, ""), tensors


_SCALARS = frozenset({int, float, bool, str, type(None)})
_TENSOR, _STRIDED = torch.Tensor, torch.strided


def _plain_keys(obj: Dict[Any, Any]) -> bool:
    """Every key a str, none starting with "__" (flatten's tags): the keys joined and searched in C, not
    checked one by one in Python (in a dict of an optimizer's hyperparameters that was a third of the walk)."""
    try:
        joined = "\0".join(obj)
    except TypeError:          # a key that is not a str
        return False
    if not joined.startswith("__") and "\0__" not in joined:
        return True
    return not any(k.startswith("__") for k in obj)     # (or a key holding NUL and "__")


def _rest(obj: Any, path: Path, walk: Callable[[Any, Path], Any], add: Callable[[Path, torch.Tensor], str]) -> Any:
    """flatten's nodes after dicts, numbers, plain values and tensors."""
    kind = type(obj)
    if kind is list:
        return [walk(v, path + str(i) + "/") for i, v in enumerate(obj)]
    if kind is tuple:       # (an optimizer's betas)
        return {"__tuple": [walk(v, path + str(i) + "/") for i, v in enumerate(obj)]}
    return _other(obj, path, walk, add)


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
        return {"__tuple": [walk(v, path + str(i) + "/") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [walk(v, path + str(i) + "/") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: walk(v, path + k + "/") for k, v in obj.items()}
        return _keyed(obj, path, walk)
    raise TypeError(f"easyckpt cannot save a {type(obj).__name__} at '{_joined(path) or '<root>'}': "
                    f"only tensors, numbers, strings, lists, tuples and dicts are stored (no pickling)")


def _keyed(obj: Dict[Any, Any], path: Path, walk: Callable[[Any, Path], Any]) -> Any:
    """A dict whose keys are not all plain strings, as its (key, value) pairs."""
    return {"__dict": [[walk(k, path + "key/"), walk(v, path + str(k) + "/")] for k, v in obj.items()]}


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
