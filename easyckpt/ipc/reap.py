"""Reaping: the shared memory of jobs that are gone.

Any easyckpt start on a node (a trainer's Engine, an agent) removes this user's slots and keys of jobs
whose agent no longer listens and whose writers are dead, after they have been quiet for a while (a
slot being set up by a trainer whose agent is still starting must survive). So a killed job's memory
does not wait for that same job to come back (docs/reliability.md promise 6). Other users' files are never touched.
"""
from __future__ import annotations

from typing import Any, Dict, Protocol

from easyckpt.ipc import agentsocket, jobkey, shm


class EventLog(Protocol):
    """Where reaping reports what it removed (storage/auditlog.py's AuditLog is one; ipc/ knows nothing of
    the save directory)."""

    def emit(self, event: str, **fields: Any) -> Any: ...


def reap_dead_jobs(log: EventLog, keep: str) -> None:
    """Remove this user's segments (and keys) of jobs whose agent and writers are gone: any easyckpt
    start on the node does this, so a killed job's memory does not wait for that same job to return
    (docs/reliability.md promise 6). Other users' files are never touched."""
    alive: Dict[str, bool] = {}
    for path, job, *_ in shm.list_segments():
        if job == keep or not shm.owned_by_me(path):
            continue
        if job not in alive:
            alive[job] = agentsocket.agent_listening(job)
        if shm.is_leftover(path, alive[job]):
            log.emit("shm_release", path=path, reason="leftover of a dead job")
            shm.unlink_quiet(path)
    for job in shm.keyed_jobs():
        if job != keep and not shm.segments_of(job) and shm.owned_by_me(jobkey.path(job)) \
                and not agentsocket.agent_listening(job) and shm.is_leftover(jobkey.path(job), False):
            jobkey.remove(job)
