"""The agent's one door to the save directory: this job's ``storage.SaveDir`` plus the job lock, with the
audit log bound, so the rest of the agent never names a path or a storage call.

It holds only settings that never change, so both the loop thread and the persist worker may call it;
which thread calls what is fixed: the worker writes (persist.py through ``storage``, markers, commit,
prune, removal of abandoned or superseded staging), the loop reads markers.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Set

from easyckpt.config import Config
from easyckpt.formats.manifest import FileEntry
from easyckpt.ipc.reap import reap_dead_jobs
from easyckpt.storage import retention
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.base import Storage
from easyckpt.storage.commit import commit
from easyckpt.storage.joblock import JobLock
from easyckpt.storage.savedir import SaveDir


class JobDir:
    def __init__(self, cfg: Config, log: AuditLog):
        self.cfg, self.log = cfg, log
        self.sd = SaveDir.of(cfg)

    @property
    def storage(self) -> Storage:
        return self.sd.storage

    def lock(self) -> JobLock:
        """docs/reliability.md promise 8, one job per directory: the coordinator's agent holds it while it has
        work."""
        return JobLock(self.cfg.node_dir, self.cfg.job_id, self.cfg.job_name)

    def begin(self, step: int) -> str:
        """Where a rank's files of ``step`` go: its staging dir (on an object store the step's final prefix,
        refused if a manifest commits it, then claimed for this job: SaveDir.begin_step)."""
        self.sd.begin_step(step)
        return self.sd.staging_path(step)

    def shards(self, step: int) -> Optional[Set[int]]:
        """The ranks whose shard of ``step`` is durable (their marker is written); None: no staging dir
        (never started, committed, or removed)."""
        return self.sd.ready_ranks(step)

    def write_marker(self, step: int, rank: int, files: Dict[str, FileEntry], info: Dict[str, Any]) -> None:
        self.sd.write_marker(step, rank, files, info)

    def commit(self, step: int, world_size: int) -> int:
        """Commit ``step`` (storage/commit.py's durable sequence), then prune older steps of this job.
        Returns the bytes the step holds."""
        t0 = time.perf_counter()
        done = commit(self.sd, step, world_size, self.log)
        self.log.emit("commit", step=step, path=done.path, bytes=done.nbytes,
                      seconds=round(time.perf_counter() - t0, 6))
        retention.prune(self.sd, retention.KeepLast(self.cfg.max_ckpt_num, retention.protected(done.manifest)),
                        self.log)
        return done.nbytes

    def newest_committed(self) -> Optional[int]:
        """This job's newest commit (run, then step: SaveDir.committed's order), or None."""
        done = self.sd.committed(own=True)
        return done[0][0] if done else None

    def mark_damaged(self, step: int, reason: str) -> None:
        self.sd.mark_damaged(step, reason, self.log)

    def quarantine(self, step: int, reason: str) -> None:
        self.sd.quarantine(step, reason, self.log)

    def drop(self, step: int) -> None:
        """Remove ``step``'s staging dir (a failed or superseded step)."""
        self.sd.remove_staging(self.log, step=step)

    def drop_all_but(self, keep: Optional[int], why: str) -> None:
        """Remove every staging dir of this job but ``keep``'s, each logged with ``why``."""
        keep_dir = None if keep is None else self.sd.staging_path(keep)
        for path in self.sd.staging_dirs():
            if path != keep_dir:
                self.log.emit("abandon", path=path, message=why)
                self.sd.remove_staging(self.log, only=path)

    def clean_leftovers(self) -> None:
        """At start: this job's staging and trash left by an agent that died, and other jobs of this
        user whose processes are all gone."""
        self.sd.remove_staging(self.log)
        reap_dead_jobs(self.log, keep=self.cfg.job_id)
