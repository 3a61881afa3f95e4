"""Reaping: the shared memory of jobs that are gone.

Any easyckpt start on a node (a trainer's Engine, an agent) removes this user's slots and keys of jobs
whose agent no longer listens and whose writers are dead, after they have been quiet for a while (a
slot being set up by a trainer whose agent is still starting must survive). So a killed job's memory
does not wait for that same job to come back (docs/reliability.md promise 6). Other users' files are never touched.
"""
from __future__ import annotations

import os
import re
import time
from typing import Any, Dict, List, Protocol

from easyckpt.ipc import agentsocket, jobkey, shm

LEFTOVER_SECONDS = float(os.environ.get("EASYCKPT_SHM_LEFTOVER_SECONDS", "60"))


def is_leftover(path: str, job_alive: bool, quiet_seconds: float = LEFTOVER_SECONDS) -> bool:
    """A segment of a job whose agent is gone, whose writer is dead, untouched for a while (a slot
    being set up by a trainer whose agent is still starting must survive)."""
    if job_alive or shm.pid_alive(shm.segment_owner_pid(path)):
        return False
    try:
        return time.time() - os.stat(path).st_mtime > quiet_seconds
    except FileNotFoundError:
        return False


def owned_by_me(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except OSError:
        return False


_KEY_NAME = re.compile(r"^easyckpt-([0-9a-f]{12})-key$")


def keyed_jobs() -> List[str]:
    """Jobs with a key file (jobkey.py) on this node."""
    try:
        return [m.group(1) for m in map(_KEY_NAME.match, sorted(os.listdir(shm.SHM_DIR))) if m]
    except FileNotFoundError:
        return []


class EventLog(Protocol):
    """Where reaping reports what it removed (storage/auditlog.py's AuditLog is one; ipc/ knows nothing of
    the save directory)."""

    def emit(self, event: str, **fields: Any) -> Any: ...


def reap_dead_jobs(log: EventLog, keep: str) -> None:
    """Remove this user's segments (and keys) of jobs whose agent and writers are gone: any easyckpt
    start on the node does this, so a killed job's memory does not wait for that same job to return
    (docs/reliability.md promise 6). Other users' files are never touched, and another user's listener on a job's
    address keeps nothing of it."""
    alive: Dict[str, bool] = {}
    for path, job, *_ in shm.list_segments():
        if job == keep or not owned_by_me(path):
            continue
        if job not in alive:
            # another user's listener on the job's address (its id shows in /dev/shm's names) is no agent of it
            alive[job] = agentsocket.agent_listening(job, own=True)
        if is_leftover(path, alive[job]):
            log.emit("shm_release", path=path, reason="leftover of a dead job")
            shm.unlink_quiet(path)
    for job in keyed_jobs():
        if job != keep and not shm.segments_of(job) and owned_by_me(jobkey.path(job)) \
                and not agentsocket.agent_listening(job, own=True) and is_leftover(jobkey.path(job), False):
            jobkey.remove(job)


def release_finished_job(job_id: str, log: EventLog) -> None:
    """Remove a finished job's segments and key on this node: its agent leaving after every trainer said bye, its own
    address already closed. Unless another agent of the job listens now: the job was started again here while this
    one was on its way out (a last copy to the local tier takes seconds), and its trainers reuse the same slots and
    key (a slot of an earlier run of the job is reused, not made anew), so removing them would take its memory
    snapshots out of everyone's reach and refuse its late ranks. They are the new run's to remove. (A listener of
    another user is no agent of the job; one still starting, not yet listening, finds the key gone and its trainers
    make a new one: engine/link/client.py.)"""
    if agentsocket.agent_listening(job_id, own=True):
        log.emit("shm_kept", message=f"another easyckpt agent of job {job_id} listens on this node (the job was "
                                     f"started again): its shared memory and key are left to it")
        return
    removed = [p for p in shm.segments_of(job_id) if shm.unlink_quiet(p)]
    if removed:
        log.emit("shm_release", segments=len(removed))
    jobkey.remove(job_id)
