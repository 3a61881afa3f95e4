"""easyckpt: near-free checkpoints through host shared memory, persisted in the background.

Public names only; docs/architecture.md is the map of the package. ``Checkpointer(config)`` is the one
object behind every adapter; the plain-PyTorch verbs below are its default instance. They are resolved
lazily so that the node agent (``python -m easyckpt.agent``), which only moves bytes, never imports torch.
"""
from typing import TYPE_CHECKING, Any

from easyckpt.config import Config
from easyckpt.errors import (
    AgentError,
    CheckpointError,
    ConfigError,
    EasyCkptError,
    ShmCapacityError,
)

if TYPE_CHECKING:   # what __getattr__ below resolves, for type checkers and IDEs
    from easyckpt.engine.checkpointer import Checkpointer, FrameworkState
    from easyckpt.pytorch import (
        checkpoint_metrics,
        finalize_easyckpt,
        initialize_easyckpt,
        load_checkpoint,
        save_checkpoint_if_needed,
    )

__all__ = ["initialize_easyckpt", "save_checkpoint_if_needed", "load_checkpoint", "finalize_easyckpt",
           "checkpoint_metrics", "Checkpointer", "FrameworkState", "Config", "EasyCkptError", "ConfigError",
           "ShmCapacityError", "AgentError", "CheckpointError"]
__version__ = "0.1.0"
_VERBS = {"initialize_easyckpt", "save_checkpoint_if_needed", "load_checkpoint", "finalize_easyckpt",
          "checkpoint_metrics"}


def __getattr__(name: str) -> Any:
    if name in _VERBS:
        from easyckpt import pytorch
        return getattr(pytorch, name)
    if name in ("Checkpointer", "FrameworkState"):
        from easyckpt.engine import checkpointer
        return getattr(checkpointer, name)
    raise AttributeError(f"module 'easyckpt' has no attribute {name!r}")
