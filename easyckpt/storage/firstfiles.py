"""The files a job's start makes beside its steps, taken back when the job fails before its first snapshot.

Starting a job writes three files of its own in the save directory: the audit log (``easyckpt.log``), the
agent's log and the job lock (``.easyckpt.lock``); and the history log (``easyckpt-history.log``) once the agent
deleted something (an earlier run's staging leftover). A run that fails before anything was snapshotted (the HF
Trainer refusing an explicit ``resume_from_checkpoint`` path that does not exist) has nothing to persist, and
its files would only mislead: a lock file and a log in a directory that holds no checkpoint. The order:

    1) before the job's settings are validated (which make the directory and the audit log): ``existing``
       notes the names in each directory the job may write to
    2) the run fails before its first snapshot; every trainer says bye to the agent, which then leaves at once
    3) ``take_back`` takes the job lock, which proves the agent has gone, removes each of those files that
       was not there in 1), logging each delete, and releases the lock

Only files that did not exist before the run are removed, and only regular files of this user; an agent still
at work (the lock not free within the wait: an earlier run's persists) leaves everything as it is. A store's
save dir (s3://) is left alone: its lock is a lease object, not a file here.
"""
from __future__ import annotations

import logging
import os
import stat
import time
from typing import Dict, FrozenSet, Iterable, List, Mapping, Sequence

from easyckpt.storage.joblock import JobLock

logger = logging.getLogger("easyckpt")
Before = Mapping[str, FrozenSet[str]]


def existing(directories: Iterable[str]) -> Dict[str, FrozenSet[str]]:
    """The names in each of ``directories`` now (none for one that does not exist yet)."""
    out = {}
    for d in directories:
        try:
            out[os.path.abspath(d)] = frozenset(os.listdir(d))
        except OSError:
            out[os.path.abspath(d)] = frozenset()
    return out


def take_back(files: Sequence[str], lock: JobLock, before: Before, wait: float = 10.0) -> List[str]:
    """Remove those of the job's own ``files`` that were not in ``before`` (``existing``'s), once its agent has
    released the job ``lock``; returns the paths removed. Nothing when the agent does not release it within
    ``wait`` seconds."""
    if not _made(files, before):
        return []
    deadline = time.monotonic() + wait
    while lock.acquire() is not None:
        if time.monotonic() > deadline:
            logger.info("easyckpt: the agent of job %s still holds %s; its files stay", lock.job_id, lock.path)
            return []
        time.sleep(0.05)
    removed = []
    try:
        for path in _made(files, before):        # the lock file too, where taking the lock just made it
            st = os.lstat(path)
            # only our own regular files: never a link or a file someone else planted under these names
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                logger.info("easyckpt: removing %s: made by this run, which failed before its first snapshot", path)
                os.unlink(path)
                removed.append(path)
    finally:
        lock.release()
    return removed


def _made(files: Sequence[str], before: Before) -> List[str]:
    """Those of ``files`` that exist now and were not in ``before``."""
    out = []
    for path in files:
        where, name = os.path.split(os.path.abspath(path))
        if where in before and name not in before[where] and os.path.lexists(path):
            out.append(path)
    return out
