"""easyckpt: near-free checkpoints through host shared memory, persisted in the background.

Public names only; see DESIGN.md for the map of the engine.
"""
from .config import Config
from .errors import AgentError, CheckpointError, ConfigError, EasyCkptError, ShmCapacityError
from .pytorch import finalize_easyckpt, initialize_easyckpt, load_checkpoint, save_checkpoint_if_needed

__all__ = ["initialize_easyckpt", "save_checkpoint_if_needed", "load_checkpoint", "finalize_easyckpt",
           "Config", "EasyCkptError", "ConfigError", "ShmCapacityError", "AgentError", "CheckpointError"]
__version__ = "0.1.0"
