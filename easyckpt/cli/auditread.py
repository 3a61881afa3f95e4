"""Reading an audit log (storage/auditlog.py writes it) for ``easyckpt report``: untrusted input.

The file is opened without blocking and must be a regular file, not a symlink (formats/paths.open_regular: a
FIFO planted under its name is refused at once, naming it and its owner), of at most MAX_BYTES (the writers
rotate it near logcap.MAX_LOG_BYTES, so a larger one is not theirs). Each line is JSON, never anything
else; every field the report uses is checked for its type and range, and a line that fails is skipped and
counted, with why for the first few. A rotated older part (``<name>.1``) is read first when there is one; before
it, the history log's events older than the audit log's first (its commits and deletes that the rotations took away,
storage/auditlog.py), read the same way. A history log that cannot be read is said among the skipped, not fatal.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from easyckpt.formats import paths
from easyckpt.storage import logcap
from easyckpt.storage.auditlog import history_path

MAX_BYTES = logcap.MAX_LOG_BYTES + (1 << 20)     # the cap, plus the one write that may cross it
MAX_LINE = 1 << 16
MAX_STEP = 2 ** 62
WHY_KEPT = 5                                     # reasons kept for the skipped lines (the first ones)


@dataclass(frozen=True)
class Event:
    """One checked line: the fields the report draws, each of its type or None."""

    line: int
    time: float
    event: str
    source: str
    step: Optional[int] = None
    rank: Optional[int] = None
    seconds: Optional[float] = None
    nbytes: Optional[int] = None
    text: str = ""                 # source= of a load, the message of an error, ...


@dataclass
class AuditRead:
    path: str
    events: List[Event] = field(default_factory=list)
    skipped: int = 0
    why: List[str] = field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.why) < WHY_KEPT:
            self.why.append(f"{where}: {why}")


def read(path: str) -> AuditRead:
    """The events of the audit log at ``path`` (and of ``path``.1 before them, when it exists). OSError (an
    UntrustedFileError among them) when the file cannot be read as an audit log at all."""
    out = AuditRead(path)
    older = path + ".1"
    parts = [older] if os.path.lexists(older) else []
    for part in parts + [path]:
        _read_part(part, out)
    _history_before(path, out)
    return out


def _history_before(path: str, out: AuditRead) -> None:
    """The history log's events from before ``out``'s first, put first (see above)."""
    history = history_path(path)
    older = AuditRead(history)
    for part in (history + ".1", history):
        if os.path.lexists(part):
            try:
                _read_part(part, older)
            except OSError as exc:      # (a planted FIFO or symlink: refused, and the audit log still drawn)
                older.skip(os.path.basename(part), f"not read: {exc}")
    first = min((e.time for e in out.events), default=math.inf)
    out.events[:0] = [e for e in older.events if e.time < first]
    out.skipped += older.skipped
    out.why.extend(older.why[:max(0, WHY_KEPT - len(out.why))])


def _read_part(path: str, out: AuditRead) -> None:
    fd = paths.open_regular(path, max_bytes=MAX_BYTES)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:        # grew while read
        data = data[:MAX_BYTES]
    name = os.path.basename(path)
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"{name} line {number}"
        if len(raw) > MAX_LINE:
            out.skip(where, f"longer than {MAX_LINE} bytes")
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            out.skip(where, f"not JSON ({str(exc)[:60]})")
            continue
        event, why = _checked(record, number)
        if event is None:
            out.skip(where, why)
        else:
            out.events.append(event)


def _checked(record: Any, line: int) -> Tuple[Optional[Event], str]:
    if not isinstance(record, dict):
        return None, "not a JSON object"
    kind, when, source = record.get("event"), record.get("time"), record.get("source")
    if not isinstance(kind, str) or not 0 < len(kind) <= 64:
        return None, "no event name"
    if not isinstance(when, (int, float)) or not _number(when):
        return None, "time is not a number"
    if not isinstance(source, str) or len(source) > 64:
        return None, "source is not a short string"
    fields: Dict[str, Any] = {}
    for name, check in (("step", _count), ("rank", _count), ("bytes", _count), ("seconds", _seconds)):
        value = record.get(name)
        if value is None:
            continue
        if not check(value):
            return None, f"{name}={str(value)[:30]!r} is not what easyckpt writes there"
        fields["nbytes" if name == "bytes" else name] = value
    # a load event's own ``source`` field (where it loaded from) is written over the writer's name (auditlog.py)
    text = source if kind == "load" else record.get("message")
    if not isinstance(text, str):
        text = ""
    return Event(line, float(when), kind, source, text=text[:300], **fields), ""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_STEP


def _seconds(v: Any) -> bool:
    return _number(v) and 0 <= v < 1e9
