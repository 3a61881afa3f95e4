"""RNG states of one process (python, numpy, torch CPU, CUDA when present): kept per rank."""
from __future__ import annotations

import random
from typing import Any, Dict, Tuple

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
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_initialized():       # (is_available first cost each snapshot a few us; initialized implies it)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# the words of the last capture and their tensor: a loop that draws no Python random numbers between two
# snapshots (most) gets the same tensor back, which the snapshot copies like any other, for a tuple comparison
# (4 us) instead of a conversion (24 us). Never changed in place: the snapshot only reads it.
_last: Tuple[Any, Any] = ((), None)


def _int64(words: Tuple[int, ...]) -> torch.Tensor:
    global _last
    kept_words, kept = _last
    if kept is not None and words == kept_words:
        return kept
    if np is None:
        tensor = torch.tensor(words, dtype=torch.int64)
    else:
        tensor = torch.from_numpy(np.fromiter(words, dtype=np.int64, count=len(words)))   # a third of torch.tensor's
    _last = (words, tensor)
    return tensor


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
