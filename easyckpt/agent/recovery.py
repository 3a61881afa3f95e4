"""Persisting what the trainers can no longer persist themselves.

After their death. Every local trainer's connection closed without bye: ``after_death`` reads the
newest step complete on all the dead ranks (a rank killed mid-copy may be one step behind), tells
the coordinator (a new epoch: other steps' staging and queued persists are abandoned), and persists
that step from the slots unless storage already has it or the step.

At the grace deadline. The trainers did not commit the step they agreed on after SIGTERM in time (a
long step, a hung collective): ``at_deadline`` persists the newest snapshot complete on every rank of
this node, again unless storage already has it.

Either way a rank whose shard of the step is already durable in its staging dir is not written again.
"""
from __future__ import annotations

from typing import Iterable

from easyckpt.agent import slots
from easyckpt.agent.coordinator import Coordinator
from easyckpt.agent.jobdir import JobDir
from easyckpt.storage.auditlog import AuditLog


class Recovery:
    def __init__(self, job_id: str, jobdir: JobDir, coordinator: Coordinator, log: AuditLog):
        self.job_id, self.jobdir, self.coordinator, self.log = job_id, jobdir, coordinator, log

    def after_death(self, dead_ranks: Iterable[int]) -> None:
        dead = set(dead_ranks)
        if not dead:
            return
        per_rank = slots.complete_snapshots(self.job_id, dead, self.log)
        step = slots.newest_common(per_rank)
        self.coordinator.trainers_died(step)
        if step is not None:
            self._persist(step, per_rank, "trainer died")

    def at_deadline(self, local_ranks: Iterable[int]) -> None:
        per_rank = slots.complete_snapshots(self.job_id, set(local_ranks), self.log)
        step = slots.newest_common(per_rank)
        if step is None:
            self.log.emit("error", message="grace deadline: no snapshot is complete on every rank of this node; "
                                           "nothing to persist")
        elif not self._persist(step, per_rank, "grace deadline"):
            self.log.emit("deadline_fallback", step=step, message="already committed")

    def _persist(self, step: int, per_rank: slots.PerRank, reason: str) -> bool:
        """Persist ``step`` of every rank in ``per_rank`` unless it is this job's newest commit already; True if it
        had to. Only that exact step counts: another job's or an older run's higher step numbers say nothing
        about this run's snapshot (a new run at step 7 beside an old run's step 20 must still be persisted)."""
        newest = self.jobdir.newest_committed()
        if newest is not None and newest == step:
            return False
        event = "persist_after_death" if reason == "trainer died" else "deadline_fallback"
        self.log.emit(event, step=step, ranks=sorted(per_rank))
        staged = self.jobdir.shards(step) is not None
        for rank, steps in per_rank.items():
            slot, generation = steps[step]
            if not (staged and self.coordinator.shard_done(rank, step)):
                self.coordinator.persist(rank, slot, generation, step, reason)
        return True
