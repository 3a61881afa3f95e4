"""Which committed checkpoints stay: pruning after a successful commit.

Rules (promise 4): only directories that match the framework's naming AND carry a manifest of this
job; never the newest committed one; every delete is logged before it happens; a checkpoint the
loader rejected (commit.mark_damaged) never counts towards the ones kept, and goes once a newer
verified one exists, so a verified checkpoint is never deleted while a damaged one stays (promise 10); a directory is first
renamed out of sight (atomic) and then removed, so a crash mid-delete never leaves a half-deleted
directory under a checkpoint's name.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Iterable, List, Optional, Protocol, Set, Tuple

from easyckpt.config import Naming
from easyckpt.formats import manifest as mf
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.commit import read_damaged, trash_path
from easyckpt.storage.posix import fsync_dir


def step_dirs(save_dir: str, naming: Naming) -> List[Tuple[int, str]]:
    """(step, path) of every directory named like a step directory, newest first."""
    pattern = re.compile(naming.dir_regex)
    out = []
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return out
    for name in names:
        m = pattern.match(name)
        path = os.path.join(save_dir, name)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return sorted(out, reverse=True)


def committed(save_dir: str, naming: Naming, job_id: Optional[str] = None) -> List[Tuple[int, str]]:
    """Step directories with a valid manifest of the same step (of one job if given), newest first."""
    out = []
    for step, path in step_dirs(save_dir, naming):
        man = mf.read(path)
        if man is not None and man["step"] == step and (job_id is None or man.get("job_id") == job_id):
            out.append((step, path))
    return out


class RetentionPolicy(Protocol):
    def to_delete(self, committed_newest_first: List[Tuple[int, str]]) -> List[Tuple[int, str]]: ...


def protected(step_dir: str) -> Set[int]:
    """Steps the adapter asked to keep whatever their age (the HF Trainer's best checkpoint), as recorded
    in the manifest of the newest commit."""
    man = mf.read(step_dir) or {}
    return {int(s) for s in (man.get("info") or {}).get("protect", [])}


class KeepLast:
    """Keep the newest ``n`` committed checkpoints; protected steps are kept as well and count towards
    ``n`` (the Trainer's rule: at most max(n, protected + newest) remain)."""

    def __init__(self, n: Optional[int], protect: Iterable[int] = ()):
        self.n, self.protect = n, set(protect)

    def to_delete(self, committed_newest_first):
        if self.n is None or not committed_newest_first:
            return []
        keep = {committed_newest_first[0][0]} | (self.protect & {s for s, _ in committed_newest_first})
        room = max(self.n, len(keep)) - len(keep)
        out = []
        for step, path in committed_newest_first[1:]:   # index 0, the newest, is never returned
            if step in keep:
                continue
            if room > 0:
                room -= 1
                continue
            out.append((step, path))
        return out


def prune(save_dir: str, naming: Naming, job_id: str, policy: RetentionPolicy, log: AuditLog) -> List[int]:
    deleted = []
    ours = committed(save_dir, naming, job_id)
    damaged = read_damaged(save_dir)
    verified = [(s, p) for s, p in ours if os.path.basename(p) not in damaged]
    victims = [(s, p, "retention") for s, p in policy.to_delete(verified)]
    victims += [(s, p, f"damaged ({damaged[os.path.basename(p)]})") for s, p in ours[1:]
                if os.path.basename(p) in damaged and any(v > s for v, _ in verified)]
    for step, path, why in sorted(victims, reverse=True):
        log.emit("delete", step=step, path=path, reason=why)
        trash = trash_path(save_dir, job_id, path)
        os.rename(path, trash)
        fsync_dir(save_dir)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(step)
    return deleted
