"""The agent's one door to the save directory: this job's ``storage.SaveDir`` plus the job lock, with the
audit log bound, so the rest of the agent never names a path or a storage call.

It holds settings that never change, and two things of the loop thread's own (the markers' poll cache and the
outage being reported), so both the loop thread and the persist worker may call it; which thread calls what is
fixed: the worker writes (persist.py through ``storage``, markers, commit, prune, removal of abandoned or
superseded staging), the loop reads markers and, at start, removes leftovers.

A save directory that fails to answer (an object store down or throttling, a network file system's EIO) never
stops the agent: the loop's reads say "no shard yet" (the step waits, bounded by commit_timeout), what the
start could not clean up waits for the job's next agent (invisible to readers meanwhile), each outage is logged
once when it starts and once when it ends;
the worker's persists and commits fail as steps (reported to the trainers), and training goes on with memory
snapshots. On an object store the loop polls a step's markers at most every POLL_S: each poll is a few requests.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Set, Tuple, Union, cast

from easyckpt.config import Config
from easyckpt.errors import LeaseLost, TrackerNotUpdated
from easyckpt.formats.manifest import FileEntry
from easyckpt.ipc.reap import reap_dead_jobs
from easyckpt.storage import retention
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.base import Storage
from easyckpt.storage.commit import Committed
from easyckpt.storage.joblock import JobLock
from easyckpt.storage.resolve import storage_for
from easyckpt.storage.savedir import SaveDir
from easyckpt.storage.storelock import StoreLock, job_lock

POLL_S = 0.25


class JobDir:
    def __init__(self, cfg: Config, log: AuditLog):
        self.cfg, self.log = cfg, log
        self.sd = SaveDir.of(cfg)
        # the loop thread's view: on an object store a client that tries once with short timeouts, so that the
        # loop keeps answering its trainers while the store is down (the worker's persists retry with backoff)
        self.quick = SaveDir.of(cfg, storage_for(cfg.save_dir, quick=True))
        self._polled: Dict[int, Tuple[float, Optional[Set[int]]]] = {}     # step -> (when, ranks): the loop's
        self._outage: Optional[str] = None        # what failed, while the save dir does not answer (the loop's)
        self._lock: Optional[Union[JobLock, StoreLock]] = None     # ``lock``'s: the loop sets its ``lost``

    @property
    def storage(self) -> Storage:
        return self.sd.storage

    def lock(self) -> Union[JobLock, StoreLock]:
        """docs/reliability.md promise 8, one job per directory: the coordinator's agent holds it while it has
        work (a flock in the save dir; on an object store a lease object, storelock.py)."""
        self._lock = job_lock(self.quick.storage, self.cfg.save_dir, self.cfg.job_id, self.cfg.job_name)
        return self._lock

    def begin(self, step: int) -> str:
        """Where a rank's files of ``step`` go: its staging dir (on an object store the step's final prefix,
        refused if a manifest commits it, then claimed for this job: SaveDir.begin_step)."""
        self.sd.begin_step(step)
        return self.sd.staging_path(step)

    def shards(self, step: int) -> Optional[Set[int]]:
        """The ranks whose shard of ``step`` is durable (their marker is written); None: no staging dir
        (never started, committed, or removed). While the save dir does not answer: the last answer, or none
        yet (the step waits; commit_timeout bounds it)."""
        now = time.monotonic()
        last = self._polled.get(step)
        if last is not None and self.sd.commits.polls and now - last[0] < POLL_S:
            return last[1]
        try:
            ranks = self.quick.ready_ranks(step)
        except OSError as exc:
            self.outage(f"reading the shards of step {step}", exc)
            return last[1] if last is not None else set()
        self.recovered()
        self._polled = {s: v for s, v in self._polled.items() if now - v[0] < 60}
        self._polled[step] = (now, ranks)
        return ranks

    def outage(self, doing: str, exc: BaseException) -> None:
        """The save dir failed to answer: logged once per outage (the agent's log and the audit log)."""
        if self._outage is None:
            self._outage = doing
            self.log.emit("error", path=self.cfg.save_dir, message=f"the save dir does not answer ({doing}: {exc}); "
                          f"training goes on with memory snapshots, persisting resumes when it answers again")

    def recovered(self) -> None:
        if self._outage is not None:
            self.log.emit("warning", path=self.cfg.save_dir, message=f"the save dir answers again (it failed "
                          f"{self._outage})")
            self._outage = None

    def write_marker(self, step: int, rank: int, files: Dict[str, FileEntry], info: Dict[str, Any]) -> None:
        self.sd.write_marker(step, rank, files, info)

    def marker_written(self, step: int) -> None:
        """This agent wrote a marker of ``step`` (the loop hears it from the persist's result): the next ``shards``
        reads the markers again instead of the answer of up to POLL_S ago, which lacked this one. Without it a
        step whose last rank finished within POLL_S of the previous poll committed a tick later (up to 0.25 s of
        save -> durable on a store). Called by the loop thread, which alone reads and writes ``_polled``."""
        self._polled.pop(step, None)

    def commit(self, step: int, world_size: int) -> Tuple[int, List[int]]:
        """Commit ``step`` by the save dir's strategy (storage/renamecommit.py or manifestcommit.py: each docstring is
        its sequence), then prune older steps of this job.
        Returns the bytes the step holds and the steps pruned. Refused while another job holds the lease this job
        lost (two jobs committing to one prefix: the step fails, saying so, until this job takes the lease again)."""
        lost = self._lock.lost if self._lock is not None else None
        if lost is not None:
            raise LeaseLost(f"step {step} was not committed: {lost}")
        t0 = time.perf_counter()
        try:
            done = self.sd.commits.commit(step, world_size, self.log)
        except TrackerNotUpdated as exc:      # committed all the same: said, and retention runs
            self.log.emit("warning", step=step, message=str(exc))
            done = cast(Committed, exc.done)
        self.log.emit("commit", step=step, path=done.path, bytes=done.nbytes,
                      seconds=round(time.perf_counter() - t0, 6))
        pruned = retention.prune(self.sd, retention.KeepLast(self.cfg.max_ckpt_num,
                                                             retention.protected(done.manifest)), self.log)
        return done.nbytes, pruned

    def newest_committed(self) -> Optional[int]:
        """This job's newest commit (run, then step: SaveDir.committed's order), or None (also when the save dir
        does not answer: the caller then persists, and a store refuses to write over a committed step)."""
        try:
            done = self.quick.committed(own=True)
        except OSError as exc:
            self.outage("listing the committed steps", exc)
            return None
        return done[0][0] if done else None

    def mark_damaged(self, step: int, reason: str) -> None:
        self.sd.mark_damaged(step, reason, self.log)

    def quarantine(self, step: int, reason: str) -> None:
        self.sd.quarantine(step, reason, self.log)

    def drop(self, step: int) -> None:
        """Remove ``step``'s staging dir (a failed or superseded step); if the save dir does not answer, it stays
        (invisible to readers) for the job's next agent."""
        try:
            self.quick.remove_staging(self.log, step=step)
        except OSError as exc:
            self.outage(f"removing the unfinished step {step}", exc)

    def drop_all_but(self, keep: Optional[int], why: str) -> None:
        """Remove every staging dir of this job but ``keep``'s, each logged with ``why``."""
        keep_dir = None if keep is None else self.sd.staging_path(keep)
        try:
            for path in self.quick.staging_dirs():
                if path != keep_dir:
                    self.log.emit("abandon", path=path, message=why)
                    self.quick.remove_staging(self.log, only=path)
        except OSError as exc:
            self.outage("removing abandoned steps", exc)

    def clean_leftovers(self) -> None:
        """At start: this job's staging and trash left by an agent that died, and other jobs of this
        user whose processes are all gone."""
        try:
            self.quick.remove_staging(self.log)
        except OSError as exc:     # they stay invisible to every reader until the job's next agent removes them
            self.outage("removing what a killed agent left", exc)
        reap_dead_jobs(self.log, keep=self.cfg.job_id)
