"""RNG states of one process (python, numpy, torch CPU, CUDA when present): kept per rank."""
from __future__ import annotations

import ctypes
import random
import struct
from typing import Any, Dict, Optional, Tuple

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def capture() -> Dict[str, Any]:
    # Python's state as one tensor, not a tuple of 625 numbers: each number would be a node of the snapshot's
    # skeleton, walked and written as JSON at every snapshot (0.35 ms of a tiny state's 2 ms)
    version, words, gauss = random.getstate()
    state: Dict[str, Any] = {"python": {"version": version, "state": _int64(words),
                                        "gauss": gauss},
                             "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = _numpy_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _int64(words: Any) -> torch.Tensor:
    if np is None:
        return torch.tensor(words, dtype=torch.int64)
    return torch.from_numpy(np.fromiter(words, dtype=np.int64, count=len(words)))   # a third of torch.tensor's


# numpy's legacy global generator (np.random.seed/rand/randn): its raw MT19937 words and position, as numpy lays them
# out (uint32 key[624], then the int pos), and the state tuple get_state() gave for them
_MT_RAW_BYTES = 624 * 4 + 4
_numpy_seen: Optional[Tuple[Any, bytes, Any]] = None
_numpy_raw_ok = True


def _numpy_state() -> Any:
    """``np.random.get_state()``, which takes 30-90 us to build its tuple (a quarter of a tiny state's snapshot),
    asked only when the generator moved since the last call. Unmoved means: the same MT19937 object, the same raw
    words and position (read from its own memory, about 1 us), and no Gaussian cached in the last state. The cached
    Gaussian is the one part outside those words: legacy ``randn`` can use it up without drawing (1 to 0); it is
    only set (0 to 1) by drawing, which moves the words."""
    global _numpy_seen, _numpy_raw_ok
    generator: Any = getattr(np.random.mtrand._rand, "_bit_generator", None)
    if not _numpy_raw_ok or type(generator) is not getattr(np.random, "MT19937", None):
        return np.random.get_state()
    raw = ctypes.string_at(generator.ctypes.state_address, _MT_RAW_BYTES)
    seen = _numpy_seen
    if seen is not None and seen[0] is generator and seen[1] == raw and not seen[2][3]:
        return seen[2]
    state: Any = np.random.get_state()
    # the layout is numpy's, not ours: checked against the state numpy gives each time the words are read again, and
    # the shortcut is off for good where they differ
    if raw != np.asarray(state[1], dtype=np.uint32).tobytes() + struct.pack("=i", state[2]):
        _numpy_raw_ok = False
        _numpy_seen = None
        return state
    _numpy_seen = (generator, raw, state)
    return state


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
