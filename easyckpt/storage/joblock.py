"""One job per save directory (docs/reliability.md, promise 8).

The coordinator's agent (the one serving global rank 0) holds an exclusive ``flock`` on
``SAVE_DIR/.easyckpt.lock`` while its job is active: trainers attached, or disk work not done. A second
job's rank 0 is refused at ``initialize_easyckpt`` with the holder's identity, before it writes anything.
The kernel drops the lock when the holder dies, so a crashed job never blocks its own restart; the
agent drops it when it goes idle, so a job whose trainers are gone does not block the directory either.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import Optional

from easyckpt.errors import UntrustedFileError
from easyckpt.formats import paths

LOCK_NAME = ".easyckpt.lock"


class JobLock:
    def __init__(self, save_dir: str, job_id: str, job_name: Optional[str]):
        self.path = os.path.join(save_dir, LOCK_NAME)
        self.job_id, self.job_name = job_id, job_name
        self.fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> Optional[str]:
        """None when this job holds the lock now; else a message naming the job that holds it."""
        if self.fd is not None:
            return None
        # never through a symlink planted in the save dir: it would truncate its target (docs/reliability.md promise 9)
        try:
            fd = paths.open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except UntrustedFileError as exc:      # a symlink, a FIFO, a device planted under the lock's name
            return f"nobody: {exc} (easyckpt never follows a symlink nor locks a special file)"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(fd)
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"job_id": self.job_id, "job_name": self.job_name, "host": socket.gethostname(),
                                  "agent_pid": os.getpid(), "since": time.time()}).encode(), 0)
        self.fd = fd
        return None

    def refresh(self) -> None:
        """A flock needs no renewing (storelock.py's lease does)."""

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)    # closing drops the flock; the file stays (it names the last holder)
            self.fd = None


def _describe(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        holder = {}
    who = (f"job {holder.get('job_name') or holder.get('job_id', '?')} (agent pid {holder.get('agent_pid', '?')} "
           f"on {holder.get('host', '?')})")
    return who
