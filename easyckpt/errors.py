"""Exceptions with messages that say what to change."""
from __future__ import annotations


class EasyCkptError(RuntimeError):
    """Base class of every error easyckpt raises on purpose."""


class ConfigError(EasyCkptError, ValueError):
    """A setting is wrong; the message names the setting and the fix."""


class ShmCapacityError(EasyCkptError):
    """/dev/shm cannot hold the snapshot slots; raised before anything is copied."""


class AgentError(EasyCkptError):
    """The node agent could not be started, reached, or reported a failed persist."""


class CheckpointError(EasyCkptError):
    """A checkpoint is damaged or cannot be loaded into the current job."""


class UntrustedFileError(EasyCkptError, PermissionError):
    """A file easyckpt would read or reuse (a snapshot slot, the job key, a lock) belongs to another user,
    is open to others, or is a symlink: it may have been planted; nothing is read from it or written to it."""


class ManifestError(CheckpointError, ValueError):
    """A step's manifest is missing a field, has one of the wrong type, is not JSON, or names a file
    outside its step directory; the message names the field or the file."""
