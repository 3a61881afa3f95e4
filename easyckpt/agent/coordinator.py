"""Which ranks' shards of which step are durable, and when a step commits: the agent's state machine.

It does no I/O and reads no clock of its own. The loop tells it what happened (a persist asked for, a
job's result, a flush, the trainers' death, a tick) and executes the decisions it queues (``take()``):
submit a job to the persist worker, cancel queued persists, answer a flush, log, remove a failed
step's staging dir. It learns which markers exist through ``shards(step)`` and the time through
``clock()``, both given to it, so a test drives it with a fake of each.

Order of events for a step S (in the agent that serves global rank 0, the commit coordinator):

  persist(r, S) → Submit(PersistJob) … Result ok → the step's shards: all ranks there?
      yes → Submit(CommitJob(S)); rank r's flush waits for it → Result ok → newest_committed = S,
            older pending steps are superseded (Drop), Committed(S) → the grace clock
      no  → S pends until commit_timeout; tick() commits it once every marker is there (other
            nodes' ranks), or fails it when the time is up
  a Result with an error → S failed: the error is logged and said on stderr, every rank's shard of
      S counts as not done, flushes of S answer with the error, S's staging dir goes
  S older than a committed step, still waiting → superseded: the missing rank skipped that snapshot
      (both slots busy), so its shard never comes and committing S would move the tracker back
  the trainers died (or a new set of trainers said hello) → a new epoch: queued persists of other
      steps than the one being saved for them are cancelled, their pending steps dropped, and what
      the earlier trainers left (failed steps, finished shards) no longer answers the new ones
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

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


@dataclass(frozen=True)
class Submit:
    job: Job


@dataclass(frozen=True)
class Cancel:
    """Take queued persists asked for before ``epoch`` off the queue, but those of step ``keep``; their
    fate goes back through ``Coordinator.cancelled``."""
    keep: Optional[int]
    epoch: int


@dataclass(frozen=True)
class Answer:
    """The reply to a flush: ``to`` is the handle the flush came with."""
    to: Any
    step: int
    error: Optional[str]


@dataclass(frozen=True)
class Log:
    event: str
    fields: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Error:
    """Log it and say it on the agent's stderr; ``what`` names what failed ("step 5", "hello")."""
    what: str
    error: str
    step: Optional[int] = None
    rank: Optional[int] = None


@dataclass(frozen=True)
class RemoveStaging:
    step: int


@dataclass(frozen=True)
class Committed:
    step: int


Action = Union[Submit, Cancel, Answer, Log, Error, RemoveStaging, Committed]


class Coordinator:
    def __init__(self, commit_timeout: float, clock: Callable[[], float],
                 shards: Callable[[int], Optional[Set[int]]]):
        self.commit_timeout = commit_timeout
        self.clock = clock
        self.shards = shards                  # step -> ranks with a durable shard; None: no staging dir
        self.world_size: Optional[int] = None
        self.commits = False                  # this agent serves global rank 0: it commits
        self.epoch = 0                        # one per set of trainers; a death starts a new one
        self.abandon_epoch = 0                # the epoch the last death started (its AbandonJob)
        self.death_step: Optional[int] = None  # the step being saved for the trainers that died last
        self.newest_committed = -1            # an older step is never committed after it (same epoch)
        self.pending: Dict[int, float] = {}   # step -> deadline: waiting for other ranks' shards
        # step -> the world size of the trainers whose snapshots it holds: a step of trainers that are gone
        # commits only with all of THEIR ranks' shards, whatever the world size of the trainers now
        self.step_world: Dict[int, int] = {}
        self.committing: Set[int] = set()     # commit jobs submitted, no result yet
        self.done: Dict[Tuple[int, int], Optional[str]] = {}   # (rank, step) -> error or None
        self.queued: Set[Tuple[int, int]] = set()              # (rank, step) persists not finished
        self.outstanding = 0                  # jobs submitted, no result yet
        self.failed: Dict[int, str] = {}      # step -> why (trainers waiting for it ask status)
        self.last_error: Optional[str] = None
        self.waiters: List[Tuple[Any, int, int]] = []          # flushes: (handle, rank, step)
        self.persisting: Dict[Tuple[int, int], int] = {}        # (epoch, step) -> persists without a result
        self.abandon_due = False              # the trainers died: their other steps' staging goes next
        # (rank, step) persists queued or running when their step failed: a shard they write can never
        # complete it (the failed rank's shard and the staging dir are gone, and no one asks again)
        self.orphans: Set[Tuple[int, int]] = set()
        self._out: List[Action] = []

    def take(self) -> List[Action]:
        """The decisions queued since the last call, in order; the caller executes each."""
        out, self._out = self._out, []
        return out

    def busy(self) -> bool:
        return bool(self.outstanding or self.pending)

    def shard_done(self, rank: int, step: int) -> bool:
        return (rank, step) in self.done and self.done[(rank, step)] is None

    # ---- what the trainers say ---------------------------------------------------------------

    def hello(self, rank: int, world_size: int) -> None:
        self.world_size = world_size
        self.commits = self.commits or rank == 0

    def new_trainers(self, world_size: int) -> None:
        """The first hello after every earlier trainer is gone (a restart, or a new run in the same
        directory): what the earlier trainers left must not decide for the new ones. Work already
        queued for them (the persist after their death) still completes."""
        self.epoch += 1
        self.newest_committed = -1
        # a restarted run redoes step numbers: an earlier run's failed or finished shards of a step must not
        # answer the new run's flush or commit wait for it
        self.failed.clear()
        self.done.clear()
        self.orphans.clear()
        keep = self.death_step
        if keep is not None and self.step_world.get(keep, world_size) != world_size:
            # the job came back on another layout (a node lost for good): the step saved for the dead
            # trainers lacks the shards of ranks that no longer exist, and the new trainers' own shards of
            # a step with that number must never be mixed with it. Its staging goes like the others'.
            self._out.append(Log("abandon", {"step": keep, "message": f"the trainers came back with world size "
                                 f"{world_size}, not {self.step_world[keep]}: step {keep} saved for the dead "
                                 f"ones cannot be completed"}))
            self.pending.pop(keep, None)
            self._submit(DropJob(keep))   # runs after a persist of it in flight; a queued one is cancelled
            self.death_step = keep = None
        self.step_world = {s: w for s, w in self.step_world.items() if s == keep}
        self._out.append(Cancel(keep, self.epoch))
        self._out.append(Log("new_trainers", {"epoch": self.epoch, "world_size": world_size, "message":
                             "earlier trainers are gone; their pending steps no longer decide what commits"}))

    def persist(self, rank: int, slot: int, generation: int, step: int, reason: str = "interval") -> None:
        if (rank, step) in self.queued:
            return
        self.queued.add((rank, step))
        if self.commits and self.world_size is not None:
            self.step_world.setdefault(step, self.world_size)
        self._submit(PersistJob(step, rank, slot, generation, reason, self.epoch, self.world_size or 0))

    def flush(self, to: Any, rank: int, step: int, slot: int, generation: int) -> None:
        if (rank, step) not in self.done:   # e.g. this agent replaced one that died: persist it now
            self.persist(rank, slot, generation, step, reason="finalize")
        self.waiters.append((to, rank, step))
        self._answer_flushes()

    def forget(self, to: Any) -> None:
        """The connection ``to`` closed: nobody waits on it any more."""
        self.waiters = [w for w in self.waiters if w[0] is not to]

    def damaged(self, step: int, reason: str) -> None:
        self._submit(DamagedJob(step, reason))

    def quarantine(self, step: int, reason: str) -> None:
        self._submit(QuarantineJob(step, reason))

    def trainers_died(self, keep: Optional[int]) -> None:
        """Every local trainer died: a step some rank had not handed over yet can never be completed by
        them (a restarted job redoes it, and its shards must not be mixed with these). Drop its staging
        and pending commit, and the persists still queued for it, so that nothing waits for it; ``keep``
        is the step the agent saves for them (recovery.py)."""
        self.epoch += 1
        self.abandon_epoch, self.death_step = self.epoch, keep
        self.newest_committed = -1   # restarted trainers may resume from an older step and redo newer ones
        # a persist of the step saved for them, still in flight, counts as that save's shard (it is not
        # asked for again: persist() dedups on queued); orphans of other steps are stale from now on
        self.orphans.clear()
        for step in sorted(set(self.pending) - {keep}):
            self.pending.pop(step)
        self._out.append(Cancel(keep, self.epoch))
        # the staging dirs go in the persist thread once the persist it is writing now has its result: a
        # step whose last shard that persist writes is complete, and commits first (_persisted)
        self.abandon_due = True
        self._maybe_abandon()

    def _maybe_abandon(self) -> None:
        if self.abandon_due and not any(n for (epoch, step), n in self.persisting.items()
                                        if epoch < self.abandon_epoch and step != self.death_step):
            self.abandon_due = False
            self._submit(AbandonJob(self.death_step))

    # ---- what the persist worker did --------------------------------------------------------

    def cancelled(self, jobs: List[PersistJob]) -> None:
        """Persists taken off the queue (Cancel): they will never have a result."""
        for job in jobs:
            self.outstanding -= 1
            self._persist_ended(job)
            self.queued.discard((job.rank, job.step))
        self._maybe_abandon()

    def on_result(self, result: Result) -> None:
        self.outstanding -= 1
        job, err = result.job, result.error
        if isinstance(job, PersistJob):
            self._persist_ended(job)
            self._persisted(job, err)
            self._maybe_abandon()      # after the commit _persisted may have submitted: it runs first
        elif isinstance(job, CommitJob):
            self._committed(job, err)
        elif err is not None:
            step = job.keep if isinstance(job, AbandonJob) else job.step
            self._error(f"{type(job).__name__} {step}", err, step=step)
        self._answer_flushes()

    def _persisted(self, job: PersistJob, err: Optional[str]) -> None:
        stale = job.epoch < self.epoch and job.step != self.death_step
        key = (job.rank, job.step)
        if key in self.orphans:
            self.orphans.discard(key)
            if err is None and not stale:
                # its step failed while it was queued: pending it would hold the agent and the job lock for
                # commit_timeout waiting for a shard that never comes; fail this rank's shard too, at once
                self.queued.discard(key)
                why = self.failed.get(job.step, "another rank's shard failed")
                self.done[key] = f"step {job.step} failed: {why}"
                self._out.append(Log("abandon", {"step": job.step, "rank": job.rank, "message":
                                     f"rank {job.rank}'s shard was written after step {job.step} failed ({why}); "
                                     f"it is removed with the step's staging"}))
                self._out.append(RemoveStaging(job.step))
                return
        if err is None and self.commits:
            if stale and job.epoch < self.abandon_epoch:
                # its trainers died while it was being written: a step it completes still commits (every
                # shard is durable and of one set of trainers); any other goes with its staging (AbandonJob)
                if self._complete(job.step, job.world_size) and self._may_commit(job.step):
                    self._submit(CommitJob(job.step, job.world_size, job.epoch, job.rank))
                    return
            elif job.epoch == self.epoch and job.step < self.newest_committed:
                self._supersede(job.step)
            elif self._complete(job.step, job.world_size) and self._may_commit(job.step):
                # the rank's flush is answered by the commit, as if it were part of this persist
                self._submit(CommitJob(job.step, job.world_size, job.epoch, job.rank))
                return
            elif not stale:
                self.pending.setdefault(job.step, self.clock() + self.commit_timeout)
        self.queued.discard((job.rank, job.step))
        if stale:
            # its trainers are gone and nobody waits for it: it must neither answer the new trainers' flush
            # of a step with the same number nor fail (and remove the staging of) their step
            if err is not None:
                self._error(f"step {job.step} of earlier trainers", err, job.step, job.rank)
            return
        self.done[(job.rank, job.step)] = err
        if err is not None:
            self._fail(job.step, err, job.rank)

    def _committed(self, job: CommitJob, err: Optional[str]) -> None:
        self.committing.discard(job.step)
        if job.rank is not None:
            self.queued.discard((job.rank, job.step))
            self.done[(job.rank, job.step)] = err
        if err is not None:
            self._fail(job.step, err, job.rank)
            return
        self.pending.pop(job.step, None)
        self.failed.pop(job.step, None)
        self.step_world = {s: w for s, w in self.step_world.items() if s > job.step or s in self.pending}
        if job.epoch == self.epoch:   # a commit for trainers that are gone decides nothing for new ones
            self.newest_committed = max(self.newest_committed, job.step)
            for older in sorted(s for s in self.pending if s < job.step):
                self._supersede(older)
        self._out.append(Committed(job.step))

    # ---- time -------------------------------------------------------------------------------

    def tick(self) -> None:
        """Commit the pending steps whose every marker is there now; fail those past commit_timeout."""
        now = self.clock()
        for step, deadline in list(self.pending.items()):
            if self._complete(step):
                if self._may_commit(step):
                    self._submit(CommitJob(step, self._world(step), self.epoch))
            elif now > deadline:
                missing = sorted(set(range(self._world(step))) - (self.shards(step) or set()))
                self.pending.pop(step)
                self._fail(step, f"commit timed out after {self.commit_timeout}s waiting for the shards of "
                                 f"ranks {missing}", None)

    # ---- bookkeeping ------------------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        self.outstanding += 1
        if isinstance(job, PersistJob):
            key = (job.epoch, job.step)
            self.persisting[key] = self.persisting.get(key, 0) + 1
        if isinstance(job, CommitJob):
            self.committing.add(job.step)
        self._out.append(Submit(job))

    def _persist_ended(self, job: PersistJob) -> None:
        key = (job.epoch, job.step)
        self.persisting[key] -= 1
        if not self.persisting[key]:
            del self.persisting[key]

    def _world(self, step: int) -> int:
        return self.step_world.get(step, self.world_size or 0)

    def _complete(self, step: int, world_size: Optional[int] = None) -> bool:
        """Every rank's shard of ``step`` is durable: of ``world_size`` ranks, those of the trainers that
        asked for it (by default the step's own, see ``step_world``)."""
        shards = self.shards(step)
        world = world_size or self._world(step)
        return world > 0 and shards is not None and len(shards) >= world

    def _may_commit(self, step: int) -> bool:
        # one commit of a step at a time, and never after a newer step's commit already on its way
        return not any(s >= step for s in self.committing)

    def _supersede(self, step: int) -> None:
        """A newer step is committed while ``step`` still waits for some rank's shard. That rank skipped
        the snapshot (both its slots were busy persisting), so the shard will never come; committing
        it later would also move the tracker backwards. Drop it instead of waiting for commit_timeout
        (which kept the agent, and the shared memory, alive for that long)."""
        self.pending.pop(step, None)
        shards = self.shards(step)
        if shards is None:
            return       # committed meanwhile (a commit asked for twice): nothing to drop
        missing = sorted(set(range(self._world(step))) - shards)
        self._out.append(Log("abandon", {"step": step, "message": f"superseded by the commit of step "
                             f"{self.newest_committed} before ranks {missing} handed over their shards of it"}))
        self._submit(DropJob(step))

    def _error(self, what: str, err: str, step: Optional[int] = None, rank: Optional[int] = None) -> None:
        self.last_error = f"{what}: {err}"
        self._out.append(Error(what, err, step, rank))

    def refused(self, what: str, err: str, rank: Optional[int]) -> None:
        """An error no step carries (a refused hello): the logs, and the next status."""
        self._error(what, err, rank=rank)

    def refuse(self, rank: int, step: int, err: str) -> None:
        """A rank's shard of ``step`` this agent will not write (agent.py: it persists no more): the step fails at
        once, and a flush of it is answered with why."""
        self.done[(rank, step)] = err
        if step not in self.failed:
            self._fail(step, err, rank)

    def _fail(self, step: int, err: str, rank: Optional[int]) -> None:
        self._error(f"step {step}", err, step, rank)
        self.pending.pop(step, None)
        self.failed[step] = f"rank {rank}: {err}" if rank is not None else err
        self.orphans |= {k for k in self.queued if k[1] == step}
        # the staging dir goes with every rank's shard in it: no rank's shard of this step counts as done
        # any more, so a later persist of the step (after the trainers' death, a finalize) writes them all
        for key, done in list(self.done.items()):
            if key[1] == step and done is None:
                self.done[key] = f"step {step} failed: {self.failed[step]}"
        self._answer_flushes()
        self._out.append(RemoveStaging(step))

    def _answer_flushes(self) -> None:
        keep = []
        for to, rank, step in self.waiters:
            if (rank, step) in self.done:
                self._out.append(Answer(to, step, self.done[(rank, step)]))
            else:
                keep.append((to, rank, step))
        self.waiters = keep
