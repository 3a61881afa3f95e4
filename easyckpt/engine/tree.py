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
