"""Every exception type easyckpt raises on purpose, all subclasses of EasyCkptError; messages say what to change.

Some also derive from the builtin a caller caught before they existed (ValueError for bad input,
TypeError for an unknown keyword), so that ``except ValueError`` written against older versions still
catches them. This module imports nothing: the agent, the formats and the adapters all raise from it.

    EasyCkptError (RuntimeError)
    ├── ConfigError (ValueError)                 a setting is wrong
    │   └── UnknownSettingError (TypeError)      a keyword no verb or Config knows
    ├── ShmCapacityError                         /dev/shm too small for the slots
    ├── AgentError                               the node agent failed or cannot be reached
    │   ├── SnapshotChanged                      a slot was reused while the agent persisted it
    │   └── LeaseLost                            another job took over this job's lease on a store
    ├── ObjectChanged                            a store object is no longer the version read
    ├── TrackerNotUpdated (OSError)              a step committed, its tracker not written (said, not fatal)
    ├── PreemptionError                          the ranks could not agree on a SIGTERM step
    ├── ProtocolError (ValueError)               a malformed message on the agent's socket
    ├── CatalogError (ValueError)                an operator tool found no such checkpoint
    ├── UntrustedFileError (PermissionError)     a file that may have been planted
    └── CheckpointError (ValueError)             a damaged or mismatched checkpoint
        ├── ManifestError                        a manifest that cannot be trusted
        ├── UnsafePath                           a file name leaving its step directory
        ├── BadSlotMeta                          a snapshot slot's metadata fails its checks
        ├── SlotNotComplete                      a slot holds no usable snapshot (torn, changed, other step)
        └── NoValidCheckpoint                    this job's committed steps exist, none can be restored
"""
from __future__ import annotations


class EasyCkptError(RuntimeError):
    """Base class of every error easyckpt raises on purpose."""


class ConfigError(EasyCkptError, ValueError):
    """A setting is wrong; the message names the setting and the fix."""


class UnknownSettingError(ConfigError, TypeError):
    """A keyword that no verb and no Config field knows (a TypeError too, as Python raises for one)."""


class ShmCapacityError(EasyCkptError):
    """/dev/shm cannot hold the snapshot slots; raised before anything is copied."""


class PeerError(EasyCkptError):
    """Another node's agent said no, broke the replica protocol, or failed to prove it knows the job's secret.
    ``kind`` names the refusal without the sender's bytes: a server counts refusals by it (agent/peerrefusals.py)."""

    def __init__(self, message: str = "", kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind


class PeerNotReady(PeerError):
    """The peer's agent runs but its trainers have not told it the job's replica secret yet (a job starting)."""


class AgentError(EasyCkptError):
    """The node agent could not be started, reached, or reported a failed persist."""


class SnapshotChanged(AgentError):
    """The slot the agent persists from no longer holds the snapshot it was asked for (a newer one
    replaced it, or its metadata is damaged): that persist is abandoned, a newer one follows."""


class TornSnapshot(EasyCkptError):
    """A tensor copied in the background was changed in place before its copy ended (engine/save/background.py)."""


class PreemptionError(EasyCkptError):
    """After SIGTERM the ranks could not agree on a step to save (timeout, abort, or a rank past it)."""


class ProtocolError(EasyCkptError, ValueError):
    """A message on the agent's socket is not one of the protocol's, or not well-formed."""


BadMessage = ProtocolError     # the name formats/protocol.py and the agent use


class CatalogError(EasyCkptError, ValueError):
    """A path that is not a directory, or a directory that holds no checkpoint: exit status 2."""


class UntrustedFileError(EasyCkptError, PermissionError):
    """A file easyckpt would read or reuse (a snapshot slot, the job key, a lock) belongs to another user,
    is open to others, or is a symlink: it may have been planted; nothing is read from it or written to it."""


class LeaseLost(AgentError):
    """This job's lease on an object store (storage/storelock.py) was taken over by another job (or removed):
    its renewal, a write conditional on the version it last wrote, was refused; the job must stop committing."""


class TrackerNotUpdated(EasyCkptError, OSError):
    """A step IS committed; only its tracker (a hint for the frameworks' own loaders) could not be written. It
    carries the commit's result (``done``, storage/commit.py's Committed), so that the agent says so and goes on
    (retention runs): a planted directory under the tracker's name once had every commit reported failed."""

    def __init__(self, message: str, done: object):
        super().__init__(message)
        self.done = done


class ObjectChanged(EasyCkptError):
    """A store's conditional write (``If-Match``) was refused: the object is not the version read (another
    writer replaced or removed it). Not an OSError: the store answered, and it said no."""


class AlreadyCommitted(EasyCkptError, FileExistsError):
    """An object store's conditional create found the object there: a committed manifest is never replaced."""


class StoreError(EasyCkptError, OSError):
    """An object store refused a request or could not be reached (after the client's bounded retries); the
    message names the operation, the URL and the store's answer."""


class CheckpointError(EasyCkptError, ValueError):
    """A checkpoint is damaged or cannot be loaded into the current job (a ValueError too: callers
    written before it existed caught that)."""


class ManifestError(CheckpointError):
    """A step's manifest is missing a field, has one of the wrong type, is not JSON, or names a file
    outside its step directory; the message names the field or the file."""


class UnsafePath(CheckpointError):
    """A file name taken from a slot, a manifest or a marker is not a plain relative path inside its
    step directory: it may have been written by someone else."""


class BadSlotMeta(CheckpointError):
    """A snapshot slot's metadata fails its checks; the message names the field."""


class SlotNotComplete(CheckpointError):
    """A slot holds no usable snapshot: empty, being written, torn, changed while read, or not the
    step / generation asked for. Its message says which."""


class NoValidCheckpoint(CheckpointError):
    """Committed steps of this job exist and no rank could restore any of them. Training does not start
    over them silently: ``verdicts`` (formats/verdicts.Verdict, newest first) say why each was refused."""

    def __init__(self, message: str, verdicts: "list" = ()):  # type: ignore[assignment]
        super().__init__(message)
        self.verdicts = list(verdicts)


__all__ = ["EasyCkptError", "ConfigError", "UnknownSettingError", "ShmCapacityError", "AgentError",
           "SnapshotChanged", "PreemptionError", "PeerError", "PeerNotReady", "ProtocolError", "BadMessage", "CatalogError",
           "UntrustedFileError", "AlreadyCommitted", "StoreError", "CheckpointError", "ManifestError", "UnsafePath", "BadSlotMeta",
           "SlotNotComplete", "NoValidCheckpoint"]
