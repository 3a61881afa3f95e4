"""Split a state tree into tensors and a JSON "skeleton" that records where each tensor sits.

The skeleton is plain JSON with a few tags, so that loading a checkpoint never unpickles anything
(promise 7). Supported leaves: tensors, numpy arrays, None, bool, int, float, str, bytes, tuples,
lists, dicts (any JSON-able keys), torch.dtype, torch.Size. Anything else is refused at save time
with the path that holds it, instead of silently pickling code into a checkpoint.
"""
from __future__ import annotations

import base64
from typing import Any, Dict, List, Tuple

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for the engine
    np = None  # type: ignore[assignment]

Tensors = List[Tuple[str, torch.Tensor]]


def flatten(tree: Any) -> Tuple[Any, Tensors]:
    tensors: Tensors = []
    used: set = set()

    def key_for(path: List[str]) -> str:
        key = "/".join(path) or "_"
        base, n = key, 1
        while key in used:
            key, n = f"{base}#{n}", n + 1
        used.add(key)
        return key

    def walk(obj: Any, path: List[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise TypeError(f"easyckpt cannot save the {obj.layout} tensor at {'/'.join(path)}; "
                                f"convert it to a dense tensor")
            key = key_for(path)
            tensors.append((key, obj.detach()))
            return {"__t": key}
        if np is not None and isinstance(obj, np.ndarray):
            key = key_for(path)
            tensors.append((key, torch.from_numpy(np.ascontiguousarray(obj))))
            return {"__np": key}
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
            return {"__tuple": [walk(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, path + [str(i)]) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: walk(v, path + [k]) for k, v in obj.items()}
            return {"__dict": [[walk(k, path + ["key"]), walk(v, path + [str(k)])] for k, v in obj.items()]}
        raise TypeError(f"easyckpt cannot save a {type(obj).__name__} at '{'/'.join(path) or '<root>'}': "
                        f"only tensors, numbers, strings, lists, tuples and dicts are stored (no pickling)")

    return walk(tree, []), tensors


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
# enums). For such shards the trainer pickles the tree with every tensor replaced by a TensorRef; the
# agent unpickles it from the trainer's own shared memory (never from a checkpoint file), puts views of
# the slot in place of the refs and torch.saves the result. Checkpoint files themselves are only ever
# read back through safe_torch_load (weights_only, with an explicit allow-list).

class TensorRef:
    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key

    def __reduce__(self):
        return (TensorRef, (self.key,))


def flatten_pickled(tree: Any) -> Tuple[Any, Tensors]:
    import pickle

    tensors: Tensors = []

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = f"{path}#{len(tensors)}"
            tensors.append((key, obj.detach()))
            return TensorRef(key)
        if isinstance(obj, dict):
            return type(obj)((k, walk(v, f"{path}/{k}")) for k, v in obj.items()) if type(obj) is not dict \
                else {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        # a torch.Size stays one: DeepSpeed's zero_to_fp32 calls .numel() on the saved param_shapes
        if isinstance(obj, tuple) and not hasattr(obj, "_fields") and not isinstance(obj, torch.Size):
            return tuple(walk(v, f"{path}/{i}") for i, v in enumerate(obj))
        return obj

    refs = walk(tree, "")
    return {"__pickle": base64.b64encode(pickle.dumps(refs, protocol=4)).decode()}, tensors


def is_pickled(skeleton: Any) -> bool:
    return isinstance(skeleton, dict) and set(skeleton) == {"__pickle"}


def unflatten_pickled(skeleton: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """Only for skeletons this job's own trainers put into shared memory."""
    import pickle

    def walk(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return tensors[obj.key]
        if isinstance(obj, dict):
            for k, v in obj.items():
                obj[k] = walk(v)
            return obj
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(pickle.loads(base64.b64decode(skeleton["__pickle"])))


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


FLATTEN = {"safetensors": flatten, "torch": flatten_pickled, "raw": flatten_raw}


def rebuild(skeleton: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict) and set(skeleton) == {"__raw"}:
        return raw_bytes(skeleton)
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


def safe_torch_load(data: bytes) -> Any:
    """torch.load with weights_only=True, allowing argparse.Namespace, Enum classes of the known
    frameworks and the few data classes in SAFE_CLASSES (their modules are imported from the installed
    packages, never from the file)."""
    import io

    allowed = []
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)):
        obj = _allowed(name)
        if obj is None:
            raise ValueError(f"refusing to load: the file references {name}, which is not on easyckpt's "
                             f"allow-list (tensors, containers, argparse.Namespace, framework enums, "
                             f"DeepSpeed's loss scaler and fragment addresses, numpy arrays)")
        allowed.extend(obj if isinstance(obj, list) else [obj])
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
