"""The local tier on this node's disk (formats/tier.py names its files): a rank's snapshot copy and its record
written, the complete copies of a rank listed, one checked before it is read, the oldest pruned.

The agent writes (agent/localtier.py) and prunes; the trainer's loader lists and checks. The directory is
created as this user's and writable by no one else, every name is built from formats/tier.py, every file is
opened without following a symlink and without blocking, and a copy is read only when its record (written
last, atomically) says so and its size and checksum match it. Every delete is logged.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Callable, List, Optional

from easyckpt.errors import ManifestError
from easyckpt.formats import manifest as mf
from easyckpt.formats import tier as tf
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.direct import SequentialWriter
from easyckpt.storage.posix import PosixStorage

_storage = PosixStorage()
CHUNK = 64 << 20


@dataclass(frozen=True)
class TierCopy:
    path: str                 # the copy (the whole slot file)
    record: tf.TierRecord

    @property
    def step(self) -> int:
        return self.record.step


def directory(node_dir: str, job_id: str) -> str:
    return os.path.join(node_dir, tf.dir_name(job_id))


def write(where: str, record: tf.TierRecord, view: memoryview, still_whole: Callable[[], None],
          direct: bool = True, volatile: int = 0) -> tf.TierRecord:
    """Write ``view`` (a page-aligned mapping: the rank's slot) as the copy of ``record``'s step and rank, then
    its record with the size and checksum found on the way. ``still_whole`` is called once the copy is durable
    and raises when the source changed while it was read: the copy is then removed and no record written.
    The first ``volatile`` bytes may change while they are read, and rightly so (a slot's header, whose agent
    words a persist of the same snapshot sets when it ends): they are read once, and the copy and the checksum
    both take that one reading. Read twice, a persist ending between the write and the hash left a copy that
    never matched its record (seen on a loaded machine: the next resume passed the tier over as damaged)."""
    _storage.make_own_dir(where)
    copy = os.path.join(where, tf.copy_name(record.step, record.rank))
    rec = os.path.join(where, tf.record_name(record.step, record.rank))
    _storage.delete(rec)           # a rewrite of the same step: unreadable from here until the new record
    _storage.delete(copy)
    hasher, size = mf.Hasher(), len(view)
    # 0600, as the slot it copies: the whole training state, readable by this user alone (and the loader maps it
    # only as such, shm.Slot)
    out = SequentialWriter(copy, direct=direct, mode=0o600)
    try:
        head = bytes(view[:min(volatile, size)])
        out.write(head)
        hasher.update(head)
        for start in range(len(head), size, CHUNK):
            end = min(start + CHUNK, size)
            out.write_mapped(view, start, end)
            hasher.update(view[start:end])
        out.finish()
        out.sync()
        out.close()
        still_whole()
        _storage.sync_dir(where)
        done = tf.TierRecord(record.job_id, record.step, record.rank, record.world_size, record.layout, size,
                             hasher.hexdigest(), hasher.algo)
        _storage.write_atomic(rec, done.to_json())
    except BaseException:
        out.close()
        _storage.delete(copy)
        raise
    return done


def _names(where: str) -> List[str]:
    try:
        return _storage.listdir(where)
    except (FileNotFoundError, NotADirectoryError):
        return []


def listing(where: str, job_id: str, rank: int, log: Optional[AuditLog] = None) -> List[TierCopy]:
    """The copies of ``rank`` whose record is valid and whose size matches it, newest first. A record that
    cannot be trusted is logged and passed over (kept: nothing is deleted by a reader), and so is the whole
    directory when it is not this user's own (a symlink, another user's, writable by others)."""
    found: List[TierCopy] = []
    names = _names(where)
    if names:
        try:
            _storage.check_own_dir(where)
        except OSError as exc:
            if log is not None:
                log.record("warning", rank=rank, message=f"local tier passed over: {exc}")
            return found
    for name in names:
        parsed = tf.parse_name(name)
        if parsed is None or parsed[1] != rank or parsed[2] != "json":
            continue
        step = parsed[0]
        try:
            record = tf.TierRecord.parse(_storage.read(os.path.join(where, name), 0, tf.MAX_RECORD_BYTES + 1),
                                         job_id, step, rank)
            copy = os.path.join(where, tf.copy_name(step, rank))
            st = os.lstat(copy)
            if not stat.S_ISREG(st.st_mode) or st.st_size != record.size:
                raise ManifestError(f"{copy}: not a regular file of {record.size} bytes")
        except (OSError, ManifestError) as exc:
            if log is not None:
                log.record("warning", step=step, rank=rank, message=f"local tier copy passed over: {exc}")
            continue
        found.append(TierCopy(copy, record))
    return sorted(found, key=lambda c: -c.step)


def verify(copy: TierCopy, data: memoryview) -> None:
    """ManifestError unless ``data``, the copy as the loader mapped it (it then copies the tensors out of the same
    pages), is what its record describes (size and checksum)."""
    hasher, size = mf.Hasher(copy.record.algo), len(data)
    if size == copy.record.size:
        for start in range(0, size, CHUNK):
            hasher.update(data[start:start + CHUNK])
    problem = mf.size_problem(copy.path, size, copy.record.size)
    if problem is None and hasher.hexdigest() != copy.record.checksum:
        problem = (f"{copy.path}: checksum {hasher.hexdigest()}, its record says {copy.record.checksum} "
                   f"({copy.record.algo}): corrupted")
    if problem:
        raise ManifestError(problem)


def prune(where: str, job_id: str, rank: int, keep: int, log: AuditLog) -> List[int]:
    """Keep the newest ``keep`` complete copies of ``rank``; delete the older ones (record first: a copy without
    its record is never read) and unfinished copies older than the newest complete one. The steps deleted."""
    complete = [c.step for c in listing(where, job_id, rank)]
    newest = max(complete, default=-1)
    doomed = set(complete[keep:])
    for name in _names(where):
        parsed = tf.parse_name(name)
        if parsed is not None and parsed[1] == rank and parsed[2] == "slot" and parsed[0] < newest \
                and parsed[0] not in complete:
            doomed.add(parsed[0])
    for step in sorted(doomed):
        for name in (tf.record_name(step, rank), tf.copy_name(step, rank)):
            _storage.delete(os.path.join(where, name))
        log.emit("tier_delete", step=step, rank=rank, path=os.path.join(where, tf.copy_name(step, rank)),
                 message=f"local tier: step {step} of rank {rank} deleted (keeping the newest {keep})")
    return sorted(doomed)
