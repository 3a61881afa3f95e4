"""The agent's one door to the save directory: every call the agent makes into ``easyckpt.storage``
(staging names, shard markers, commit, prune, damaged marks, the job lock) goes through ``JobDir``.

It holds only settings that never change, so both the loop thread and the persist worker may call
it; which thread calls what is fixed: the worker writes (persist.py, markers, commit, prune, removal
of abandoned or superseded staging), the loop reads markers and removes a failed step's staging.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Set

from easyckpt.config import Config
from easyckpt.formats.reap import reap_dead_jobs
from easyckpt.storage import commit, retention
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.joblock import JobLock

class JobDir:
    def __init__(self, cfg: Config, log: AuditLog):
        self.cfg, self.log = cfg, log
        self.save_dir, self.job_id = cfg.save_dir, cfg.job_id

    def lock(self) -> JobLock:
        """Promise 8, one job per directory: the coordinator's agent holds it while it has work."""
        return JobLock(self.save_dir, self.job_id, self.cfg.job_name)

    def staging(self, step: int) -> str:
        return commit.staging_dir(self.save_dir, self.job_id, self.cfg.naming.dir_name(step))

    def shards(self, step: int) -> Optional[Set[int]]:
        """The ranks whose shard of ``step`` is durable (their marker is written); None: no staging dir
        (never started, committed, or removed)."""
        staging = self.staging(step)
        if not os.path.isdir(staging):
            return None
        return set(commit.read_markers(staging))

    def write_marker(self, step: int, rank: int, files: Dict[str, Any], info: Dict[str, Any]) -> None:
        commit.write_shard_marker(self.staging(step), rank, step, files, info)

    def commit(self, step: int, world_size: int) -> None:
        """Commit ``step`` (commit.py's durable sequence), then prune older steps of this job."""
        t0 = time.perf_counter()
        final, nbytes = commit.commit(self.save_dir, self.job_id, step, world_size, self.cfg.naming, self.log)
        self.log.emit("commit", step=step, path=final, bytes=nbytes, seconds=round(time.perf_counter() - t0, 6))
        retention.prune(self.save_dir, self.cfg.naming, self.job_id,
                        retention.KeepLast(self.cfg.max_ckpt_num, retention.protected(final)), self.log)

    def newest_committed(self) -> Optional[int]:
        """The newest step committed in the directory (by any job), or None."""
        done = retention.committed(self.save_dir, self.cfg.naming)
        return done[0][0] if done else None

    def mark_damaged(self, step: int, reason: str) -> None:
        commit.mark_damaged(self.save_dir, self.cfg.naming.dir_name(step), reason, self.log)

    def drop(self, step: int) -> None:
        """Remove ``step``'s staging dir (a failed or superseded step)."""
        commit.remove_staging(self.save_dir, self.job_id, self.log, only=self.staging(step))

    def drop_all_but(self, keep: Optional[int], why: str) -> None:
        """Remove every staging dir of this job but ``keep``'s, each logged with ``why``."""
        keep_dir = None if keep is None else self.staging(keep)
        for path in commit.staging_dirs(self.save_dir, self.job_id):
            if path != keep_dir:
                self.log.emit("abandon", path=path, message=why)
                commit.remove_staging(self.save_dir, self.job_id, self.log, only=path)

    def clean_leftovers(self) -> None:
        """At start: this job's staging and trash left by an agent that died, and other jobs of this
        user whose processes are all gone."""
        commit.remove_staging(self.save_dir, self.job_id, self.log)
        reap_dead_jobs(self.log, keep=self.job_id)
