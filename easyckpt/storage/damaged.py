"""Steps the loader rejected: the damaged record, and quarantine.

- The damaged record ({step directory name: why}) survives restarts; it is a hint, trusted only to order
  retention's deletions (a rejected step is never kept in place of a verified one). Only this user's own record is
  read (``Storage.read_own``): one planted in a shared save dir would have this job delete its intact steps
  (docs/reliability.md promise 15).
- Quarantine sets a committed step aside whole under a quarantine name (layout.quarantine_name): no loader,
  retention or commit takes it any more, nothing in it changes; ``easyckpt ls`` lists it
  (docs/reliability.md promise 12).
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, Optional, Set

from easyckpt import console
from easyckpt.errors import UntrustedFileError
from easyckpt.formats import layout
from easyckpt.formats import manifest as mf
from easyckpt.storage import stepfiles
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.base import Storage

_MAX_RECORD_BYTES = 1 << 20     # the record is small JSON; a larger one is not ours
_SAID: Set[str] = set()


def _say_once(text: str) -> None:
    """A warning on the console once per process: retention reads the damaged record after every commit."""
    if text not in _SAID:
        _SAID.add(text)
        console.warning(text)


def mark(storage: Storage, root: str, name: str, reason: str, log: AuditLog) -> None:
    """Record that the loader rejected committed step directory ``name`` of save dir ``root``."""
    log.emit("damaged", path=os.path.join(root, name), reason=reason[:500])
    record = _record(storage, root)
    if record is not None:
        record[name] = reason[:500]
        _write(storage, root, record)


def read(storage: Storage, root: str) -> Dict[str, str]:
    """{step directory name: why the loader rejected it}; empty when there is no valid record."""
    return _record(storage, root) or {}


def clear(storage: Storage, root: str, name: str) -> None:
    """A new commit under a name the loader once rejected is a new, verified checkpoint."""
    record = _record(storage, root)
    if record is not None and record.pop(name, None) is not None:
        _write(storage, root, record)


def _record(storage: Storage, root: str) -> Optional[Dict[str, str]]:
    """The damaged record as far as it is valid ({} when there is none); None when another user owns it or may
    write it: refused, said once, and never rewritten, for it orders deletions."""
    try:
        data = json.loads(storage.read_own(os.path.join(root, layout.DAMAGED_NAME), _MAX_RECORD_BYTES) or b"{}")
    except UntrustedFileError as exc:
        _say_once(f"{exc}; the job goes on without it (retention takes every step of this job as intact)")
        return None
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _write(storage: Storage, root: str, record: Dict[str, str]) -> None:
    storage.write_atomic(os.path.join(root, layout.DAMAGED_NAME), json.dumps(record, indent=1, sort_keys=True).encode())


def quarantine(storage: Storage, final: str, step: int, owns: Callable[[mf.Manifest], bool], reason: str,
               log: AuditLog) -> Optional[str]:
    """Set committed step ``step`` (at ``final``) aside under a quarantine name, whole. Logged first. Returns the new
    path, or None when there is no committed step of this job by that name (a request from a trainer never sets
    aside another job's step, nor one another user owns)."""
    man = stepfiles.read(final, storage=storage) if storage.is_dir(final) else None
    if man is None or man.step != step or not owns(man) or stepfiles.owner_problem(final, storage=storage):
        log.emit("warning", step=step, path=final, message="not set aside: no committed step of this job there")
        return None
    root, name = os.path.dirname(final), os.path.basename(final)
    stamp = time.time_ns() // 1000
    while True:
        dest = os.path.join(root, layout.quarantine_name(name, stamp))
        if not storage.exists(dest):
            break
        stamp += 1
    log.emit("quarantine", step=step, path=final, to=dest, reason=reason[:500])
    storage.set_aside(final, dest)     # an object store: copied, then the original deleted
    clear(storage, root, name)
    return dest
