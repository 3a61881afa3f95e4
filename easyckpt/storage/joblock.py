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
from typing import List, Optional

from easyckpt.errors import UntrustedFileError
from easyckpt.formats import paths

LOCK_NAME = ".easyckpt.lock"


class JobLock:
    lost: Optional[str] = None       # a flock is never taken from its holder (storelock.py's lease can be)

    def __init__(self, save_dir: str, job_id: str, job_name: Optional[str]):
        self.path = os.path.join(save_dir, LOCK_NAME)
        self.job_id, self.job_name = job_id, job_name
        self.fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> Optional[str]:
        """None when this job holds the lock now; else a message naming who holds it (or why it cannot be taken)."""
        if self.fd is not None:
            return None
        # never through a symlink planted in the save dir: it would truncate its target (docs/reliability.md promise
        # 9); 0600 and this user's own: a file any local user can open, any local user can flock, and block the
        # job's relaunch with it (docs/reliability.md promise 15)
        for _ in range(3):
            try:
                fd = paths.open_own(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except UntrustedFileError as exc:      # a symlink, a FIFO, a directory, another user's file
                return f"nobody: {exc} (easyckpt never follows a symlink nor locks a file it did not make)"
            if os.fstat(fd).st_mode & 0o077:
                os.fchmod(fd, 0o600)       # made 0644 by an earlier version: from now on only this user opens it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(fd)
                os.close(fd)
                return holder
            if _still_there(fd, self.path):
                break
            # the file was removed (storage/firstfiles.py takes back a failed run's lock) or replaced after we
            # opened it: a lock on that one guards nothing, while another process may lock the new one
            os.close(fd)
        else:
            return f"nobody: {self.path} was removed or replaced each time it was locked (three tries)"
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
    """Who holds the flock on ``fd``'s file: the process the kernel names (/proc/locks), with its user and
    command, and what the file says of the job that wrote it last (which may not be the holder: any process
    that could open the file can hold it)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        holder = {}
    if not isinstance(holder, dict):
        holder = {}
    st = os.fstat(fd)
    pids = lock_holders(st.st_dev, st.st_ino)
    written = (f"job {holder.get('job_name') or holder.get('job_id', '?')} (agent pid {holder.get('agent_pid', '?')} "
               f"on {holder.get('host', '?')})")
    if not pids:       # another host's process on a network file system: the kernel here does not list it
        return written
    if any(str(p) == str(holder.get("agent_pid")) and holder.get("host") == socket.gethostname() for p in pids):
        return f"{written}, {_process(pids[0])}"
    return (f"{', '.join(_process(p) for p in pids)}, not the agent that wrote the lock last ({written}): another "
            f"program holds it")


def lock_holders(dev: int, ino: int) -> List[int]:
    """The pids of this host's processes holding a lock on the file (dev, ino), read from /proc/locks."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    out = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if "->" in fields:      # a waiter, not a holder
                    continue
                if len(fields) >= 6 and fields[5] == want and fields[4].isdecimal():
                    out.append(int(fields[4]))
    except OSError:
        return []
    return out


def _process(pid: int) -> str:
    """``pid 123 (user nobody: flock -x -n ...)``, as far as /proc tells."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).split(b"\0")
        cmd = " ".join(a.decode("utf-8", "replace") for a in argv if a)
    except OSError:
        return f"pid {pid}"
    cmd = cmd if len(cmd) <= 120 else cmd[:117] + "..."
    return f"pid {pid} (user {paths.owner_name(uid)}: {cmd!r})"


def _still_there(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        here, mine = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)
