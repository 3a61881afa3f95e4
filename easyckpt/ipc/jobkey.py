"""The job's key: proof, on the agent's socket, that a process belongs to the job (protocol.py).

32 random bytes (hex) in ``/dev/shm/easyckpt-<job>-key``, mode 0600, owned by the job's user: only
that user's processes can read it, and every process of the job on the node finds it by the job id.
Whoever comes first creates it exclusively (written under a temporary name, then linked into place,
so no one reads a half-written key); everyone checks owner, mode and content before trusting it. It
lives as long as the job's slots do and goes with them (the agent's exit, the reaping of a dead job).
"""
from __future__ import annotations

import hmac
import os
import secrets
import stat

from easyckpt.errors import AgentError
from easyckpt.formats import paths
from easyckpt.ipc import shm

_LEN = 64


def path(job_id: str) -> str:
    return os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{job_id}-key")


def read(job_id: str) -> str:
    """The job's key; AgentError when the file exists but cannot be trusted."""
    p = path(job_id)
    fd = paths.open_regular(p)     # a planted FIFO or device: refused at once, named with its owner
    try:
        st = os.fstat(fd)
        shm.check_owner(p, st)
        key = os.read(fd, _LEN + 1).decode("ascii", "replace")
    finally:
        os.close(fd)
    if len(key) != _LEN or any(c not in "0123456789abcdef" for c in key):
        raise AgentError(f"{p} does not hold a valid easyckpt job key; remove it (no job of yours runs "
                         f"with it) and start again")
    return key


def ensure(job_id: str) -> str:
    """The job's key, created if the job has none yet."""
    try:
        return read(job_id)
    except FileNotFoundError:
        pass
    tmp = f"{path(job_id)}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, stat.S_IRUSR | stat.S_IWUSR)
    try:
        os.write(fd, secrets.token_hex(_LEN // 2).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path(job_id))      # fails if another process of the job was first: use its key
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return read(job_id)


def matches(job_id: str, given: object) -> bool:
    try:
        key = read(job_id)
    except (OSError, AgentError):
        return False
    return isinstance(given, str) and hmac.compare_digest(key, given)


def remove(job_id: str) -> None:
    shm.unlink_quiet(path(job_id))
