"""How many bytes of tensors a rank's first snapshot will hold, from its live objects: what
Snapshotter.prepare reserves ahead, while the first iterations run. The model's tensors, the
optimizer's state, and the moments an Adam-family optimizer creates at its first step for parameters
that have none yet (a job started from scratch has no optimizer state at its load). An estimate: a
snapshot larger than it grows the slots at the first snapshot, as without one."""
from __future__ import annotations

from typing import Any

import torch


def tensor_bytes(tree: Any) -> int:
    """The bytes of every tensor in a tree of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def adam_moments(params: Any) -> int:
    """What an Adam-family first step adds for ``params``: two moments of each one's shape and dtype, and
    a 4-byte step."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def optimizer_bytes(opt: Any) -> int:
    """A torch optimizer's state now, plus what its first step adds (Adam, AdamW: two moments of each
    parameter's shape and dtype, and a step)."""
    state = getattr(opt, "state", None)
    groups = getattr(opt, "param_groups", None)
    if not isinstance(state, dict) or not isinstance(groups, list):
        return 0
    total = sum(tensor_bytes(v) for v in state.values())
    for group in groups:
        if "betas" in group:
            total += adam_moments(p for p in group.get("params", ())
                                  if isinstance(p, torch.Tensor) and not state.get(p))
    return total
