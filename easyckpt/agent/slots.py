"""What the agent reads and writes in the trainers' shared-memory slots (formats/shm.py), in one place.

The agent writes only its two words of a slot's header (busy, released: ``shm.AgentView``); it reads
headers to find complete snapshots (after the trainers died, at the grace deadline) and to release a
reservation a dead agent left. Each use opens the slot and closes it again: the agent keeps no mapping
between jobs, so a trainer's unlink at bye really frees the memory.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, Optional, Set, Tuple

from easyckpt.formats import shm, slotread
from easyckpt.storage.auditlog import AuditLog

PerRank = Dict[int, Dict[int, Tuple[int, int]]]    # rank -> {step: (slot, generation)}


def _generation(job_id: str, rank: int, slot: int, log: AuditLog) -> int:
    """The generation the slot holds or is being written with (0 when unknown, not there or not ours)."""
    try:
        opened = shm.Slot(shm.slot_path(job_id, rank, slot), writable=False)
    except FileNotFoundError:
        return 0
    except OSError as exc:     # UntrustedFileError included: never touch another user's file
        log.emit("error", rank=rank, message=str(exc))
        return 0
    try:
        return opened.state()[1] if opened.mm is not None and opened.size >= shm.HEADER_BYTES else 0
    finally:
        opened.close()


def complete_snapshots(job_id: str, ranks: Iterable[int], log: AuditLog) -> PerRank:
    """rank -> {step: (slot, generation)} of its complete snapshots, by the one reader
    (formats/slotread.py) that the trainer's loader and ``easyckpt status`` use too."""
    per_rank: PerRank = {}
    for rank in ranks:
        per_rank[rank] = {}
        for i in (0, 1):
            try:
                done = slotread.read_complete(shm.slot_path(job_id, rank, i))
            except OSError as exc:     # UntrustedFileError included: never touch another user's file
                log.emit("error", rank=rank, message=str(exc))
                continue
            if done is not None:
                per_rank[rank][done.step] = (i, done.generation)
    return per_rank


def newest_common(per_rank: PerRank) -> Optional[int]:
    """The newest step complete on every rank of ``per_rank`` (None if there is none)."""
    common: Set[int] = set.intersection(*(set(s) for s in per_rank.values())) if per_rank else set()
    return max(common) if common else None


def release_stale(job_id: str, rank: int, skip: Set[int], log: AuditLog) -> None:
    """A reservation nobody will serve (left by an agent that died) would pin a slot forever; the slots
    in ``skip`` have a persist queued and stay reserved."""
    for i in (0, 1):
        if i in skip:
            continue
        generation = _generation(job_id, rank, i, log)
        if generation:
            view = shm.AgentView(shm.slot_path(job_id, rank, i))
            try:
                view.set(busy=0, released=generation)
            finally:
                view.close()


@contextmanager
def reserved(job_id: str, rank: int, slot: int, generation: int) -> Iterator[str]:
    """Mark the slot busy with ``generation`` while the body persists it (the trainer does not overwrite
    a busy slot), then release that generation; yields the slot's path."""
    path = shm.slot_path(job_id, rank, slot)
    view = shm.AgentView(path)
    try:
        view.set(busy=generation)
        try:
            yield path
        finally:
            view.set(busy=0, released=generation)
    finally:
        view.close()
