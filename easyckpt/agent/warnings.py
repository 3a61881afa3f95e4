"""Warnings of the agent's background threads (peer replicas, the local tier), each said at most once a minute:
a peer that stays away or a full disk must not flood the log and the console. The newest few are kept for
``easyckpt status``. Thread-safe: the saying thread and the agent's loop (status) share it."""
from __future__ import annotations

import collections
import threading
import time
from typing import Deque, Dict, List

from easyckpt import console
from easyckpt.storage.auditlog import AuditLog

PERIOD = 60.0
FORGET_AT = 256     # messages remembered before the ones older than PERIOD are dropped


class Warnings:
    def __init__(self, log: AuditLog, keep: int = 4):
        self.log = log
        self._lock = threading.Lock()
        self._said: Dict[str, float] = {}
        self._recent: Deque[str] = collections.deque(maxlen=keep)

    def say(self, message: str) -> None:
        """To the audit log and the console, unless the same message was said less than PERIOD seconds ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._said.get(message, -1e9) < PERIOD:
                return
            if len(self._said) >= FORGET_AT:     # messages a minute old rate-limit nothing: a long run's many
                self._said = {m: t for m, t in self._said.items() if now - t < PERIOD}   # must not pile up
            self._said[message] = now
            self._recent.append(message)
        self.log.record("warning", message=message)
        console.warning(message)

    def recent(self) -> List[str]:
        with self._lock:
            return list(self._recent)
