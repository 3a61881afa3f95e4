"""A size cap on the logs easyckpt appends to (the audit log, the agent log): docs/reliability.md promise 13.

Whatever makes lines (a stranger's refused connections, a peer that stays away, a bug), no log grows past
MAX_LOG_BYTES by more than one write: once over, it is renamed to ``<name>.1`` (replacing an older one) and
a new file is started, so the two hold at most twice the cap. Several processes append to one audit log
(every trainer of the node and its agent); the one that finds the file over the cap renames it, under an
flock of the file so that two never both do, and the others see that the name now holds another file and
reopen it.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from typing import Callable

MAX_LOG_BYTES = int(os.environ.get("EASYCKPT_MAX_LOG_BYTES", 64 << 20))
LOCK_WAIT = 0.1     # seconds; the lock is held for a rename only, so waiting longer means another user holds it


def over_cap(fd: int) -> bool:
    return os.fstat(fd).st_size > MAX_LOG_BYTES


def over_cap_appended(fd: int) -> bool:
    """over_cap for a descriptor opened O_APPEND, just after a write to it: every such write moves the offset to
    the end first, so the offset is the file's size as that write left it (a fifth of an fstat's cost, paid
    at every audit line)."""
    return os.lseek(fd, 0, os.SEEK_CUR) > MAX_LOG_BYTES


def rotate(fd: int, path: str) -> bool:
    """The file at ``fd`` is over the cap: rename it to ``path``.1 unless another writer did already. True when
    ``path`` no longer names ``fd``'s file (the caller reopens ``path``); False when ``fd`` is not the file
    at ``path`` nor its rotated copy (a stream someone else gave this process) or the rename failed."""
    st = os.fstat(fd)
    locked = _lock(fd)
    try:
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.rename(path, path + ".1")      # what was written stays readable, in the one older copy
            return True
        try:
            older = os.stat(path + ".1", follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (older.st_dev, older.st_ino) == (st.st_dev, st.st_ino)     # another writer rotated it
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _lock(fd: int) -> bool:
    # never blocks for long: a log readable by others can be flocked by them (the lock only orders the job's
    # own writers, so after LOCK_WAIT the rotation goes on without it)
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        except OSError:
            return False


def cap_stdio(path: str, reopen: Callable[[], int]) -> bool:
    """This process's stdout and stderr are its log at ``path`` (the agent's: the fd its starter handed it,
    storage/savedir.py): over the cap, rotated, and both pointed at a new file from ``reopen()``. True when
    they were. OSError when the rotation failed."""
    if not over_cap(2) or not rotate(2, path):
        return False
    point_stdio(reopen())
    return True


def point_stdio(fd: int) -> None:
    """This process's stdout and stderr written to ``fd`` from now on (closed here)."""
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
