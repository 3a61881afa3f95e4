"""RNG states of one process (python, numpy, torch CPU, CUDA when present): kept per rank."""
from __future__ import annotations

import random
from typing import Any, Dict, Tuple

import torch

from easyckpt.engine.save import rngmemory

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def capture() -> Dict[str, Any]:
    """The RNG states of this process, as restore() takes them. Python's and numpy's are read from the generators'
    memory where that works (rngmemory.py: 3 us instead of 50), else through their public calls."""
    state: Dict[str, Any] = {"python": _python(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = rngmemory.NUMPY.read() or np.random.get_state()
    if torch.cuda.is_initialized():       # (is_available first cost each snapshot a few us; initialized implies it)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# Python's state as one tensor, not a tuple of 625 numbers: each number would be a node of the snapshot's
# skeleton, walked and written as JSON at every snapshot (0.35 ms of a tiny state's 2 ms). The tensor of the
# last capture is kept with the state it holds: a loop that draws no Python random numbers between two snapshots
# (most) gets the same tensor back, which the snapshot copies like any other. Never changed in place.
_last: Tuple[Any, Any] = (None, None)


def _python() -> Dict[str, Any]:
    global _last
    read = rngmemory.PYTHON.read() if np is not None else None      # (its bytes become a tensor through numpy)
    if read is None:
        version, numbers, gauss = random.getstate()
        key: Any = numbers
    else:
        version, key, gauss = read
    kept_key, tensor = _last
    if tensor is None or key != kept_key:
        if read is not None:
            words = np.empty(rngmemory.WORDS + 1, dtype=np.int64)
            words[:-1] = np.frombuffer(key, dtype="<u4", count=rngmemory.WORDS, offset=4)
            words[-1] = rngmemory.index(key)
            tensor = torch.from_numpy(words)
        elif np is None:
            tensor = torch.tensor(key, dtype=torch.int64)
        else:
            tensor = torch.from_numpy(np.fromiter(key, dtype=np.int64, count=len(key)))   # a third of torch.tensor's
        _last = (key, tensor)
    return {"version": version, "state": tensor, "gauss": gauss}


def restore(state: Dict[str, Any]) -> None:
    python = state["python"]
    if isinstance(python, dict):
        python = (python["version"], tuple(python["state"].tolist()), python["gauss"])
    random.setstate(python)      # else a tuple, as snapshots before the tensor form held it
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
