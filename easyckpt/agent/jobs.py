"""What the agent's loop hands its persist worker, and what comes back: immutable descriptions only.

The loop thread owns every piece of the agent's mutable state; the worker thread (persister.py) gets
one of these jobs at a time, does the disk work it describes, and answers with a ``Result``. Neither
side reads the other's state, so no lock guards any of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union


@dataclass(frozen=True)
class PersistJob:
    """Write ``rank``'s snapshot ``generation`` of ``step`` from slot ``slot`` into the step's staging
    directory, then the rank's marker."""
    step: int
    rank: int
    slot: int
    generation: int
    reason: str = "interval"       # interval | finalize | trainer died | grace deadline (for the audit log)
    epoch: int = 0                 # the set of trainers it was asked for (coordinator.py)
    world_size: int = 0            # their world size: the step commits once that many ranks' shards are in


@dataclass(frozen=True)
class CommitJob:
    """Commit ``step`` (every rank's marker is there), then prune."""
    step: int
    world_size: int
    epoch: int = 0
    rank: Optional[int] = None     # the rank whose persist completed the step: its flush waits for this


@dataclass(frozen=True)
class AbandonJob:
    """Every trainer died: remove every staging dir of this job but ``keep``'s."""
    keep: Optional[int]


@dataclass(frozen=True)
class DropJob:
    """Remove the staging dir of a step that can no longer commit (superseded)."""
    step: int


@dataclass(frozen=True)
class DamagedJob:
    """The loader rejected committed ``step``: mark it damaged so retention never keeps it instead of a
    verified one."""
    step: int
    reason: str


@dataclass(frozen=True)
class QuarantineJob:
    """A fresh start was allowed over committed ``step``, which no rank could restore: set it aside, whole."""
    step: int
    reason: str


Job = Union[PersistJob, CommitJob, AbandonJob, DropJob, DamagedJob, QuarantineJob]


@dataclass(frozen=True)
class Result:
    job: Job
    error: Optional[str] = None     # None: done
    seconds: float = 0.0            # a persist's write time (the grace clock's reserve)
    nbytes: int = 0                 # a commit's: the bytes the committed step holds
    pruned: Tuple[int, ...] = ()    # a commit's: the steps retention deleted after it
