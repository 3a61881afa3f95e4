"""The agent's persist worker: the only code that runs on the agent's second thread.

The loop submits immutable jobs (jobs.py) and reads back one ``Result`` per job; the worker keeps no
state the loop reads, and the loop's state is never touched here. Order of the work, per job kind:

  persist (rank, slot, generation, step):
    mark the slot busy → persist.persist_slot() into the step's staging dir → check it held ``step``
    → write the rank's marker → release the slot → log "persist" → Result (the loop decides on the
    commit: coordinator.py)
  commit (step): the save dir's commit strategy (renamecommit.py: manifest, rename, fsync, tracker) → prune → Result
  abandon (keep) / drop (step): remove staging dirs → Result
  damaged (step): mark the committed step damaged → Result

Jobs run one at a time. Commits, abandons, drops and damaged marks run before queued persists (in the
order they were submitted): a commit then follows its step's last shard at once, as it would if it
were part of that persist, instead of waiting behind the next step's shards. A result wakes the loop
through a pipe, so it acts on it without waiting for its poll timeout. After a persist the worker waits
(HANDOFF_WAIT at most) until the loop has acted on its result: the commit that result completes is
submitted then, and runs first. Without that wait the next step's persist, already queued, started at
once: a commit waited behind a whole persist, and an agent killed meanwhile lost it (step 5 persisted,
never committed, a loader found step 0; tests/test_faults.py, under load).
"""
from __future__ import annotations

import collections
import threading
from typing import Callable, Deque, List, Optional, Protocol

from easyckpt import _faults as faults
from easyckpt.agent import slots
from easyckpt.agent.jobdir import JobDir
from easyckpt.agent.jobs import (
    AbandonJob,
    CommitJob,
    DamagedJob,
    DropJob,
    Job,
    PersistJob,
    QuarantineJob,
    Result,
)
from easyckpt.agent.mailbox import Mailbox
from easyckpt.agent.stepwriter import persist_slot
from easyckpt.ipc import priority
from easyckpt.storage.auditlog import AuditLog

HANDOFF_WAIT = 1.0      # seconds the worker waits after a persist for the loop to act on its result
ABANDON_WHY = "its trainers died before every rank's shard of this step was written; a restarted job redoes it"


class Worker(Protocol):
    """What the agent's loop asks of its disk worker (Persister)."""

    def submit(self, job: Job) -> None: ...

    def cancel(self, drop: Callable[[PersistJob], bool]) -> List[PersistJob]: ...

    def queued_persists(self) -> List[PersistJob]: ...

    def wake_fd(self) -> int: ...

    def results(self) -> List[Result]: ...

    def acted(self) -> None: ...


class Persister:
    """The job queue and the thread that serves it. ``threaded=False`` (an agent run in a test's process):
    no thread; ``drain()`` runs the queued jobs on the caller's thread, in the order the thread would."""

    def __init__(self, run: Callable[[Job], Result], threaded: bool = True):
        self._run = run
        self._cond = threading.Condition()
        self._urgent: Deque[Job] = collections.deque()     # commit, abandon, drop, damaged
        self._persists: Deque[PersistJob] = collections.deque()
        self._results: Mailbox[Result] = Mailbox()
        self._threaded = threaded
        # persist results handed to the loop, taken in by it, and acted on (its turn ended): the hand-off
        self._put = self._taken = self._acted = 0
        if threaded:
            threading.Thread(target=self._serve, daemon=True, name="easyckpt-persist").start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if isinstance(job, PersistJob):
                self._persists.append(job)
            else:
                self._urgent.append(job)
            self._cond.notify()

    def cancel(self, drop: Callable[[PersistJob], bool]) -> List[PersistJob]:
        """Take the queued (not started) persists that ``drop`` selects off the queue; returns them."""
        with self._cond:
            gone = [j for j in self._persists if drop(j)]
            self._persists = collections.deque(j for j in self._persists if not drop(j))
        return gone

    def queued_persists(self) -> List[PersistJob]:
        with self._cond:
            return list(self._persists)

    def wake_fd(self) -> int:
        """Readable when results are waiting (the loop's selector watches it)."""
        return self._results.wake_fd()

    def results(self) -> List[Result]:
        """Every result that came in since the last call, in the order the jobs finished."""
        with self._cond:
            self._taken = self._put        # counted once in the mailbox: every one of these is taken now
        return self._results.take()

    def acted(self) -> None:
        """The loop acted on the results it took (its turn's jobs submitted): the worker may go on."""
        with self._cond:
            self._acted = self._taken
            self._cond.notify()

    def drain(self) -> int:
        """Run every queued job now on this thread (threaded=False); how many ran."""
        ran = 0
        while True:
            job = self._next(wait=False)
            if job is None:
                return ran
            self._one(job)
            ran += 1

    def _next(self, wait: bool) -> Optional[Job]:
        with self._cond:
            while wait and not (self._urgent or self._persists):
                self._cond.wait()
            if self._urgent:
                return self._urgent.popleft()
            return self._persists.popleft() if self._persists else None

    def _one(self, job: Job) -> None:
        try:
            result = self._run(job)
        except Exception as exc:  # noqa: BLE001 - reported, never fatal to the agent
            result = Result(job, f"{type(exc).__name__}: {exc}")
        self._results.put(result)
        if not (self._threaded and isinstance(job, PersistJob)):
            return
        with self._cond:
            self._put += 1
            seq = self._put
            # until the loop acted on it: the commit it completes is queued then
            self._cond.wait_for(lambda: self._acted >= seq, timeout=HANDOFF_WAIT)

    def _serve(self) -> None:
        # the persist (kernel copies, checksums) yields the CPU to the trainers when both want it, and
        # still gets all of it while they wait (a SIGTERM save, a final flush)
        priority.bulk_thread()
        while True:
            job = self._next(wait=True)
            if job is not None:
                self._one(job)


def disk_work(job_id: str, jobdir: JobDir, log: AuditLog, direct_io: bool) -> Callable[[Job], Result]:
    """The function the worker runs for each job (its arguments never change after the start)."""

    def persist(job: PersistJob) -> Result:
        with slots.reserved(job_id, job.rank, job.slot, job.generation) as path:
            faults.inject("agent.before_persist", job.rank)
            step, files, nbytes, seconds, info = persist_slot(path, job.generation, jobdir.begin(job.step),
                                                              job.rank, direct_io=direct_io, storage=jobdir.storage)
            if step != job.step:
                raise RuntimeError(f"slot holds step {step}, expected {job.step}")
            jobdir.write_marker(job.step, job.rank, files, info)
            faults.inject("agent.after_marker", job.rank)
        log.emit("persist", step=job.step, rank=job.rank, bytes=nbytes, seconds=round(seconds, 6),
                 gbps=round(nbytes / max(seconds, 1e-9) / 1e9, 3), reason=job.reason)
        return Result(job, None, seconds)

    def run(job: Job) -> Result:
        if isinstance(job, PersistJob):
            return persist(job)
        if isinstance(job, CommitJob):
            nbytes, pruned = jobdir.commit(job.step, job.world_size)
            return Result(job, nbytes=nbytes, pruned=tuple(pruned))
        if isinstance(job, AbandonJob):
            jobdir.drop_all_but(job.keep, ABANDON_WHY)
        elif isinstance(job, DropJob):
            jobdir.drop(job.step)
        elif isinstance(job, DamagedJob):
            jobdir.mark_damaged(job.step, job.reason)
        elif isinstance(job, QuarantineJob):
            jobdir.quarantine(job.step, job.reason)
        else:
            raise ValueError(f"unknown job {job!r}")
        return Result(job)

    return run
