"""easyckpt's figures (engine/link/metrics.py) in the Trainer's own logs, so that they reach ``report_to``
(TensorBoard, W&B, ...) and ``trainer.state.log_history`` as the loss does.

Why a wrapper of ``Trainer.log`` rather than a callback's ``on_log``: ``Trainer.log`` appends a copy of ``logs`` to
``log_history`` before the callbacks' ``on_log`` run (transformers/trainer.py), so keys a callback adds reach the
reporting callbacks that run after it, but never ``log_history``, nor the reporters that run before it. Added
before ``Trainer.log`` records them, they reach both. Both forms (TrainerWrapper, EasyCkptCallback) run
``train()`` through the same hooks (session.py), so both get it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from easyckpt.engine.checkpointer import Checkpointer


def with_metrics(original: Callable[..., None], engine: Checkpointer) -> Callable[..., None]:
    """``Trainer.log`` that adds ``engine.metrics()`` to the training logs (the ones with ``loss``, every
    ``logging_steps``, and the end of training's ``train_*`` figures); evaluation logs are left as they are."""
    def log(logs: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if isinstance(logs, dict) and ("loss" in logs or any(str(k).startswith("train_") for k in logs)):
            logs.update({k: v for k, v in engine.metrics().items() if k not in logs})
        original(logs, *args, **kwargs)
    return log
