"""The audit log: one JSON line per event (snapshot, persist, commit, load, delete, error, ...).

Trainers and the agent append to the same file; each line is one ``write`` on an O_APPEND
descriptor, so lines from different processes never interleave. ``emit`` also says warnings and errors
on the console (console.py), as one readable line; every event goes to the ``easyckpt.audit`` logger at
DEBUG. ``record`` writes the file only, for callers that word the console line themselves. The file is
capped in size (logcap.py): over the cap it becomes ``<name>.1`` and a new one is started.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional

from easyckpt import console
from easyckpt.formats import paths
from easyckpt.storage import logcap

WARNINGS = ("warning", "skip")
# made once (json.dumps with an option builds one per call): a line is written at every snapshot
_LINE = json.JSONEncoder(default=str)
# the fields every line starts with (record)
_HEAD = frozenset(("time", "event", "source", "host", "pid"))


class AuditLog:
    def __init__(self, path: Optional[str], source: str):
        self.path = path
        self.source = source
        self._fd: Optional[int] = None
        self._cap_said = False
        # the node's name, asked once per log: a system call at every line otherwise (a line per snapshot)
        self.host = socket.gethostname()
        # called with each event as written (engine/link/metrics.py counts snapshots and skips from them)
        self.listeners: List[Callable[[str, Dict[str, Any]], None]] = []
        self._pid = 0                       # see _head
        self._heads: Dict[str, str] = {}
        if path:
            self._fd = self._open(path)

    @staticmethod
    def _open(path: str) -> int:
        # never through a symlink planted in the save dir, never blocked by a FIFO, never a file another user
        # made (they could read, rewrite or cut its deletes; docs/reliability.md promises 9, 13 and 15)
        return paths.open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def reopen(self) -> None:
        """Open the log's path again: the directory it was in was replaced (agent/dirwatch.py), so the descriptor
        points at a file no one can read any more. The new file passes the same checks as the first."""
        if self.path:
            fd = self._open(self.path)
            self.close()
            self._fd = fd

    def emit(self, event: str, **fields: Any) -> None:
        self.record(event, **fields)
        if event == "error":
            console.error(readable(event, fields))
        elif event in WARNINGS:
            console.warning(readable(event, fields))

    def record(self, event: str, **fields: Any) -> None:
        now, pid = round(time.time(), 6), os.getpid()
        record = {"time": now, "event": event, "source": self.source, "host": self.host, "pid": pid, **fields}
        if _HEAD.isdisjoint(fields):
            # the same text as the whole record's JSON, its fixed part encoded once per event and process: a
            # snapshot writes a line, and encoding the whole record was a third of the line's cost
            line = "".join(('{"time": ', float.__repr__(now), self._head(event, pid),
                            ", " + _LINE.encode(fields)[1:] if fields else "}"))
        else:           # a field named like the fixed ones replaces its value where it stands (a load's source)
            line = _LINE.encode(record)
        console.audit_logger.debug("%s", line)
        for listener in self.listeners:
            try:
                listener(event, record)
            except Exception as exc:  # noqa: BLE001 - the figures must never take training down
                console.audit_logger.debug("audit listener failed on %s: %r", event, exc)
        if self._fd is not None:
            try:
                os.write(self._fd, (line + "\n").encode())
            except OSError as exc:  # the log must never take training down
                console.warning(f"cannot write the audit log {self.path}: {exc}")
            self._cap()

    def _head(self, event: str, pid: int) -> str:
        """``, "event": ..., "source": ..., "host": ..., "pid": ...`` as json writes them (kept per pid: a fork)."""
        if pid != self._pid:
            self._pid, self._heads = pid, {}
        head = self._heads.get(event)
        if head is None:
            head = self._heads[event] = ", " + _LINE.encode(
                {"event": event, "source": self.source, "host": self.host, "pid": pid})[1:-1]
        return head

    def _cap(self) -> None:
        """Over the size cap: rotate the file (or follow another writer's rotation) and write on in a new one."""
        assert self._fd is not None and self.path
        try:
            if not logcap.over_cap_appended(self._fd) or not logcap.rotate(self._fd, self.path):
                return
            fd = self._open(self.path)
        except OSError as exc:
            if not self._cap_said:      # said once: a rotation that cannot happen must not add a line a write
                self._cap_said = True
                console.warning(f"the audit log {self.path} is over {logcap.MAX_LOG_BYTES} bytes and cannot be "
                                f"rotated: {exc}")
            return
        os.close(self._fd)
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def readable(event: str, fields: Dict[str, Any]) -> str:
    """An event as a console line: its message, else its fields as ``key=value``."""
    message = fields.get("message")
    if isinstance(message, str) and message:
        return message
    return f"{event}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
