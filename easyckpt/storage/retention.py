"""Which committed checkpoints stay: pruning after a successful commit (the agent's jobdir.py and
``easyckpt prune`` run it).

Rules (docs/reliability.md promise 4): only directories that match the framework's naming AND carry a manifest of this
job; never the newest committed one; every delete is logged before it happens; a checkpoint the
loader rejected (SaveDir.mark_damaged) never counts towards the ones kept, and goes once a newer
verified one exists, so a verified checkpoint is never deleted while a damaged one stays
(docs/reliability.md promise 10).
Each delete is SaveDir.delete_dir: renamed out of sight (atomic), then removed, so a crash mid-delete
never leaves a half-deleted directory under a checkpoint's name.

What to keep is a policy object with one verb (``to_delete``); the rules above bind every policy.
"""
from __future__ import annotations

import os
from typing import (
    TYPE_CHECKING,
    Iterable,
    List,
    Optional,
    Protocol,
    Set,
    Tuple,
)

from easyckpt.formats.manifest import Manifest
from easyckpt.storage.auditlog import AuditLog

if TYPE_CHECKING:
    from easyckpt.storage.savedir import SaveDir

Committed = List[Tuple[int, str]]     # (step, path), newest first


class RetentionPolicy(Protocol):
    def to_delete(self, committed_newest_first: Committed) -> Committed: ...


def protected(man: Optional[Manifest]) -> Set[int]:
    """Steps the adapter asked to keep whatever their age (the HF Trainer's best checkpoint), as recorded
    in the (validated) manifest of the newest commit."""
    return man.protect if man is not None else set()


class KeepLast:
    """Keep the newest ``n`` committed checkpoints; protected steps are kept as well and count towards
    ``n`` (the Trainer's rule: at most max(n, protected + newest) remain)."""

    def __init__(self, n: Optional[int], protect: Iterable[int] = ()):
        self.n, self.protect = n, set(protect)

    def to_delete(self, committed_newest_first: Committed) -> Committed:
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


def prune(sd: "SaveDir", policy: RetentionPolicy, log: AuditLog) -> List[int]:
    """This job's committed steps, newest commit first (run, then step: SaveDir.committed), go through
    ``policy``; a damaged one goes once a newer verified one exists, and nothing newer than the newest
    verified one is ever deleted."""
    deleted = []
    ours = sd.committed(own=True)
    damaged = sd.read_damaged()
    verified = [(s, p) for s, p in ours if os.path.basename(p) not in damaged]
    newest_verified = next((i for i, (_, p) in enumerate(ours) if os.path.basename(p) not in damaged), None)
    if newest_verified is None:
        return []
    victims = [(s, p, "retention") for s, p in policy.to_delete(verified)]
    victims += [(s, p, f"damaged ({damaged[os.path.basename(p)]})") for s, p in ours[newest_verified + 1:]
                if os.path.basename(p) in damaged]
    rank = {p: i for i, (_, p) in enumerate(ours)}
    for step, path, why in sorted(victims, key=lambda v: rank[v[1]]):
        sd.delete_dir(path, log, why, step=step)
        deleted.append(step)
    return deleted
