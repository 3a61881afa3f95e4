"""The audit log: one JSON line per event (snapshot, persist, commit, load, delete, error, ...).

Trainers and the agent append to the same file; each line is one ``write`` on an O_APPEND
descriptor, so lines from different processes never interleave.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Optional

logger = logging.getLogger("easyckpt")


class AuditLog:
    def __init__(self, path: Optional[str], source: str):
        self.path = path
        self.source = source
        self._fd: Optional[int] = None
        if path:
            # never through a symlink planted in the save dir (promise 9)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        record = {"time": round(time.time(), 6), "event": event, "source": self.source,
                  "host": socket.gethostname(), "pid": os.getpid(), **fields}
        level = logging.ERROR if event == "error" else logging.WARNING if event in ("warning", "skip") \
            else logging.DEBUG
        logger.log(level, "%s %s", event, fields)
        if self._fd is not None:
            try:
                os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())
            except OSError as exc:  # the log must never take training down
                logger.warning("easyckpt: cannot write audit log %s: %s", self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
