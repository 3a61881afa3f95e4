"""The audit log: one JSON line per event (snapshot, persist, commit, load, delete, error, ...).

Trainers and the agent append to the same file; each line is one ``write`` on an O_APPEND
descriptor, so lines from different processes never interleave. ``emit`` also says warnings and errors
on the console (console.py), as one readable line; every event goes to the ``easyckpt.audit`` logger at
DEBUG. ``record`` writes the file only, for callers that word the console line themselves. The file is
capped in size (logcap.py): over the cap it becomes ``<name>.1`` and a new one is started.

The events of a checkpoint's life (HISTORY: committed, deleted, moved aside) are also appended to the history log
beside it (``easyckpt-history.log``, history_path), which nothing else writes to: a line a persist, not a line a
snapshot, so the record of what was saved and deleted outlives the audit log's rotations (at a few snapshot
lines a second from every rank of a node, the audit log and its ``.1`` hold only the last hours). It is
capped the same way (a cap's worth of commits is years of a job's).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set

from easyckpt import console
from easyckpt.errors import EasyCkptError
from easyckpt.formats import paths
from easyckpt.storage import logcap

WARNINGS = ("warning", "skip")
# made once (json.dumps with an option builds one per call): a line is written at every snapshot
_LINE = json.JSONEncoder(default=str)
# the fields every line starts with (record)
_HEAD = frozenset(("time", "event", "source", "host", "pid"))
# the events also written to the history log (see above); not the local tier's (a node's cache, copied as often as
# every few snapshots)
HISTORY = frozenset(("commit", "delete", "quarantine", "sigterm_save"))


def history_path(path: str) -> str:
    """The history log beside the audit log ``path``: ``easyckpt.log`` -> ``easyckpt-history.log``."""
    root, ext = os.path.splitext(path)
    return f"{root}-history{ext or '.log'}"


class AuditLog:
    def __init__(self, path: Optional[str], source: str, history: bool = True):
        """``history``: the HISTORY events also go to the history log (not for a log of its own command's deletes:
        ``easyckpt prune``'s)."""
        self.path = path
        self.keeps_history = history
        self.source = source
        self._fd: Optional[int] = None
        self._history: Optional[int] = None     # the history log's descriptor, opened at its first line
        self._opening = threading.Lock()        # (the agent logs commits from its persister thread too)
        self._said: Set[str] = set()            # the paths whose failed rotation or open was said (once each)
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
            self._fd = fd       # (the history log is opened again at its next line)

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
        if self._fd is not None and self.path:
            data = (line + "\n").encode()
            self._fd = self._append(self._fd, self.path, data)
            if event in HISTORY and self.keeps_history:
                self._append_history(data)

    def _append_history(self, data: bytes) -> None:
        assert self.path
        path = history_path(self.path)
        with self._opening:
            if self._history is None:
                try:
                    self._history = self._open(path)
                except (OSError, EasyCkptError) as exc:    # a planted file: refused, said once (the audit log has it)
                    self._say_once(path, f"cannot open the history log {path}: {exc}")
                    return
        self._history = self._append(self._history, path, data)

    def _head(self, event: str, pid: int) -> str:
        """``, "event": ..., "source": ..., "host": ..., "pid": ...`` as json writes them (kept per pid: a fork)."""
        if pid != self._pid:
            self._pid, self._heads = pid, {}
        head = self._heads.get(event)
        if head is None:
            head = self._heads[event] = ", " + _LINE.encode(
                {"event": event, "source": self.source, "host": self.host, "pid": pid})[1:-1]
        return head

    def _append(self, fd: int, path: str, data: bytes) -> int:
        """Write ``data`` at the end of the log at ``fd``; over the size cap, rotate the file (or follow another
        writer's rotation). Returns the descriptor to write on."""
        try:
            os.write(fd, data)
        except OSError as exc:  # the log must never take training down
            console.warning(f"cannot write the audit log {path}: {exc}")
        try:
            if not logcap.over_cap_appended(fd):
                return fd
            # False: the file was rotated away twice by the others while this writer was silent (an agent between
            # two commits), so the line went into a file no one can read, as would every later one: it is written
            # again in the new file, which this writer follows from now on
            kept = logcap.rotate(fd, path)
            new = self._open(path)
        except OSError as exc:      # said once: a rotation that cannot happen must not add a line a write
            self._say_once(path, f"the audit log {path} is over {logcap.MAX_LOG_BYTES} bytes and cannot be "
                                 f"rotated: {exc}")
            return fd
        os.close(fd)
        if not kept:
            try:
                os.write(new, data)
            except OSError as exc:
                console.warning(f"cannot write the audit log {path}: {exc}")
        return new

    def _say_once(self, path: str, text: str) -> None:
        if path not in self._said:
            self._said.add(path)
            console.warning(text)

    def close(self) -> None:
        for fd in (self._fd, self._history):
            if fd is not None:
                os.close(fd)
        self._fd = self._history = None


def readable(event: str, fields: Dict[str, Any]) -> str:
    """An event as a console line: its message, else its fields as ``key=value``."""
    message = fields.get("message")
    if isinstance(message, str) and message:
        return message
    return f"{event}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
