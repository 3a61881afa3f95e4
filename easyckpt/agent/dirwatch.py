"""Notice a save directory replaced under the running job (docs/reliability.md promise 15).

The agent holds open descriptors into its save dir (the job's lock, the audit log, its own log) and names
everything else in it by path. When the directory is removed and made again, or another one is mounted or
renamed onto its path, the descriptors point into the old directory and the paths into the new one: the
lock no longer guards the path (a second job could start there beside this one), and the job's audit events
(its deletes too) go to a file nobody can read any more. A directory's identity is its (device, inode);
the agent compares it with the one it started with, at most once a second, and says which path changed.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

CHECK_S = 1.0       # how often: an lstat is cheap, but the agent's loop turns every 50 ms

Identity = Optional[Tuple[int, int]]


def identity(path: str) -> Identity:
    try:
        st = os.lstat(path)
    except OSError:
        return None         # gone: a change too, once it is back (or said as an outage by whoever writes there)
    return (st.st_dev, st.st_ino)


class DirWatch:
    def __init__(self, paths: Sequence[str], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.known: Dict[str, Identity] = {p: identity(p) for p in dict.fromkeys(paths)}
        self.next_check = clock() + CHECK_S

    def replaced(self) -> List[str]:
        """The watched directories whose identity changed since the last call that returned them (each said once
        per change); [] between checks."""
        now = self.clock()
        if now < self.next_check:
            return []
        self.next_check = now + CHECK_S
        out = []
        for path, known in self.known.items():
            now_id = identity(path)
            if now_id is not None and now_id != known:
                self.known[path] = now_id
                out.append(path)
        return out
