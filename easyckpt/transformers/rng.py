"""The Trainer's random-number state (its ``rng_state[_R].pth``): what it saves and how a resume sets it back,
so that a resumed run draws the same numbers (dropout, data order) as one never interrupted."""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Dict

import numpy as np
import torch

from easyckpt.engine.save import rngmemory

if TYPE_CHECKING:
    from transformers import TrainingArguments


def states(args: "TrainingArguments") -> Dict[str, Any]:
    """The Trainer's rng_state file content (see Trainer._save_rng_state)."""
    # (the same tuples as random.getstate() and np.random.get_state(), read from the generators' memory: about
    # 45 us less a snapshot, engine/save/rngmemory.py)
    out: Dict[str, Any] = {"python": rngmemory.PYTHON.getstate(),
                           "numpy": rngmemory.NUMPY.read() or np.random.get_state(),
                           "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = (torch.cuda.random.get_rng_state_all() if args.parallel_mode.value == "distributed"
                       else torch.cuda.random.get_rng_state())
    return out


def restore(state: Dict[str, Any]) -> None:
    """Set every generator back to ``state`` (what ``states`` returned, as read back from the checkpoint)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        if isinstance(state["cuda"], (list, tuple)):
            torch.cuda.random.set_rng_state_all(state["cuda"])
        else:
            torch.cuda.random.set_rng_state(state["cuda"])
