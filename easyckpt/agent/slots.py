"""What the agent reads and writes in the trainers' shared-memory slots (ipc/shm.py), in one place.

The agent writes only its two words of a slot's header (busy, released: ``shm.AgentView``); it reads
headers to find complete snapshots (after the trainers died, at the grace deadline) and to release a
reservation a dead agent left. Each use opens the slot and closes it again: the agent keeps no mapping
between jobs, so a trainer's unlink at bye really frees the memory.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, Optional, Set, Tuple

from easyckpt.ipc import shm, slotread
from easyckpt.storage.auditlog import AuditLog

PerRank = Dict[int, Dict[int, Tuple[int, int]]]    # rank -> {step: (slot, generation)}


def generation_of(path: str) -> int:
    """The generation the slot at ``path`` holds or is being written with (0 when not there or empty);
    UntrustedFileError for another user's file."""
    try:
        opened = shm.Slot(path, writable=False)
    except FileNotFoundError:
        return 0
    try:
        return opened.state()[1] if opened.mm is not None and opened.size >= shm.HEADER_BYTES else 0
    finally:
        opened.close()


def _generation(job_id: str, rank: int, slot: int, log: AuditLog) -> int:
    """generation_of a rank's slot (0 when unknown, not there or not ours)."""
    try:
        return generation_of(shm.slot_path(job_id, rank, slot))
    except OSError as exc:     # UntrustedFileError included: never touch another user's file
        log.emit("error", rank=rank, message=str(exc))
        return 0


def complete_snapshots(job_id: str, ranks: Iterable[int], log: AuditLog) -> PerRank:
    """rank -> {step: (slot, generation)} of its complete snapshots, by the one reader
    (ipc/slotread.py) that the trainer's loader and ``easyckpt status`` use too."""
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


def trainers_last_free(job_id: str, rank: int, slot: int) -> bool:
    """Would pinning ``slot`` leave the rank's trainer no slot to write its next snapshot into? True when
    the other slot is reserved (a persist owed, e.g. storage is slow) and this one is not. A replica send
    then waits: pinning it would make the trainer skip snapshots, a storage step among them."""
    def reserved(i: int) -> bool:
        try:
            opened = shm.Slot(shm.slot_path(job_id, rank, i), writable=False)
        except FileNotFoundError:
            return False
        try:
            return opened.mm is not None and opened.size >= shm.HEADER_BYTES and opened.reserved(opened.read_header())
        finally:
            opened.close()
    return reserved(1 - slot) and not reserved(slot)


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


# The persist worker and the replica sender may read the same slot at once; the slot's one busy word says
# "busy" until the last of them is done (a count per slot, shared by the agent's threads).
_pins: Dict[str, int] = {}
_pins_lock = threading.Lock()


@contextmanager
def reserved(job_id: str, rank: int, slot: int, generation: int, release: bool = True) -> Iterator[str]:
    """Mark the slot busy with ``generation`` while the body reads it (the trainer does not overwrite a
    busy slot); then, if ``release`` (a persist, not a replica send), mark that generation released: its
    persist is done. Yields the slot's path."""
    path = shm.slot_path(job_id, rank, slot)
    view = shm.AgentView(path)
    try:
        with _pins_lock:
            _pins[path] = _pins.get(path, 0) + 1
            view.set(busy=generation)
        try:
            yield path
        finally:
            with _pins_lock:
                _pins[path] -= 1
                last = not _pins[path]
                if last:
                    del _pins[path]
                view.set(busy=0 if last else None, released=generation if release else None)
    finally:
        view.close()
