"""easyckpt's figures (engine/link/metrics.py) in Megatron-LM's own TensorBoard and W&B writers, at the interval its
training loop writes its own scalars (``--tensorboard-log-interval``), so they sit beside the loss.

Megatron-LM makes the writers on one rank only (``megatron.training.global_vars``: the last rank, when
``--tensorboard-dir`` / ``--wandb-project`` are given); the figures written are that rank's. Called by hook.py
after each iteration's snapshot decision; nothing is written when neither writer exists.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional


def due(iteration: int, args: Any) -> bool:
    """Whether Megatron-LM's training loop writes its scalars at ``iteration`` (its own test, training_log)."""
    interval = getattr(args, "tensorboard_log_interval", None) or getattr(args, "log_interval", None) or 1
    return iteration > 0 and iteration % int(interval) == 0


def write(figures: Dict[str, float], iteration: int, tensorboard: Optional[Any], wandb: Optional[Any]) -> int:
    """``figures`` to the writers there are, as scalars at ``iteration``; returns how many writers got them."""
    wrote = 0
    if tensorboard is not None:
        for key, value in figures.items():
            tensorboard.add_scalar(key, value, iteration)
        wrote += 1
    if wandb is not None:
        wandb.log(dict(figures), iteration)
        wrote += 1
    return wrote


def write_if_due(iteration: int, figures: Callable[[], Dict[str, float]]) -> None:
    """Megatron-LM's writers, as its training loop gets them (``megatron.training.global_vars``); ``figures`` is
    asked only when they are written (its median is not worth a sort every iteration)."""
    from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer
    if not due(iteration, get_args()):
        return
    tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
    if tensorboard is not None or wandb is not None:
        write(figures(), iteration, tensorboard, wandb)
