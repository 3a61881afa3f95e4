"""The commit: the only module that renames step directories or writes markers, manifests, trackers.

Order of operations (RELIABILITY.md, "the durable sequence"); the order IS the design:

  all ranks, per shard (persist.py): write files into the staging dir → fsync each file and dir
  all ranks:        write_shard_marker()      rank r's files are durable (temp, fsync, rename)
  coordinator:      ready_ranks() == world    IMPORTANT: commit only after every rank's marker
  coordinator:      commit():
      1. merge the markers into the manifest; write it (temp, fsync, rename); drop the markers
      2. fsync the staging dir
      3. rename staging → final name, never over an existing directory
      4. fsync save_dir (the rename is durable only now)
      5. update the tracker (temp, fsync, rename, fsync save_dir): a hint for the frameworks' own
         loaders; easyckpt's loader trusts manifests, so a crash between 4 and 5 loses nothing.
  then:             retention.prune()  (only after a successful commit)

A crash anywhere leaves either no visible step directory (before 3) or a complete one (after 3).
Staging directories carry this job's id in their name, so a restart removes only its own leftovers.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

from easyckpt import faults
from easyckpt.config import Naming
from easyckpt.formats import manifest as mf
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.posix import atomic_write, fsync_dir, rename_noreplace

STAGING_PREFIX = ".easyckpt-staging-"
TRASH_PREFIX = ".easyckpt-trash-"
_MARKER = ".easyckpt-done-rank-{:05d}.json"


def staging_dir(save_dir: str, job_id: str, final_name: str) -> str:
    return os.path.join(save_dir, f"{STAGING_PREFIX}{job_id}-{final_name}")


def write_shard_marker(staging: str, rank: int, step: int, files: Dict[str, Dict[str, Any]],
                       info: Optional[Dict[str, Any]] = None) -> None:
    atomic_write(os.path.join(staging, _MARKER.format(rank)),
                 json.dumps({"rank": rank, "step": step, "files": files, "info": info or {}}).encode())


def read_markers(staging: str) -> Dict[int, Dict[str, Any]]:
    out = {}
    try:
        names = os.listdir(staging)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith(".easyckpt-done-rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(staging, name), "rb") as f:
                    marker = json.loads(f.read())
                out[int(marker["rank"])] = marker
            except (OSError, ValueError, KeyError):
                continue
    return out


def commit(save_dir: str, job_id: str, step: int, world_size: int, naming: Naming, log: AuditLog,
           extra: Optional[Dict[str, Any]] = None) -> Tuple[str, int]:
    """Make step ``step`` a committed checkpoint; every rank's marker must be present.
    Returns the final directory and the bytes it holds."""
    final_name = naming.dir_name(step)
    staging = staging_dir(save_dir, job_id, final_name)
    markers = read_markers(staging)
    steps = {m["step"] for m in markers.values()}
    if set(markers) != set(range(world_size)) or steps != {step}:
        raise RuntimeError(f"refusing to commit step {step}: shards from ranks {sorted(markers)} for steps "
                           f"{sorted(steps)}, expected every rank of {world_size} at step {step}")
    files: Dict[str, Dict[str, Any]] = {}
    info: Dict[str, Any] = {}
    for rank in sorted(markers, reverse=True):   # what the adapter said on rank 0 wins
        files.update(markers[rank]["files"])
        info.update(markers[rank].get("info") or {})
    manifest = mf.build(step, job_id, naming.framework, world_size, files, {**(extra or {}), "info": info})
    atomic_write(os.path.join(staging, mf.MANIFEST_NAME), json.dumps(manifest, indent=1).encode())
    faults.inject("agent.after_manifest")
    for rank in markers:
        os.unlink(os.path.join(staging, _MARKER.format(rank)))
    fsync_dir(staging)
    faults.inject("agent.before_rename")
    final = os.path.join(save_dir, final_name)
    if os.path.lexists(final):
        _retire_existing(save_dir, job_id, final, log)
    rename_noreplace(staging, final)
    faults.inject("agent.after_rename")
    fsync_dir(save_dir)
    _clear_damaged(save_dir, final_name)
    faults.inject("agent.before_tracker")
    if naming.tracker:
        atomic_write(os.path.join(save_dir, naming.tracker), naming.tracker_format.format(step).encode())
    faults.inject("agent.after_tracker")
    return final, sum(f["size"] for f in files.values())


def add_file(step_dir: str, rel: str, data: bytes) -> None:
    """Add a derived file (e.g. a converter's output) to a committed step: durable before it is listed."""
    path = os.path.join(step_dir, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, data)


def add_to_manifest(step_dir: str, entries: Dict[str, Dict[str, Any]]) -> None:
    """List files already written by add_file in the step's manifest (rewritten atomically)."""
    man = mf.read(step_dir)
    if man is None:
        raise ValueError(f"{step_dir} has no valid manifest")
    man["files"].update(entries)
    man["files"] = dict(sorted(man["files"].items()))
    atomic_write(os.path.join(step_dir, mf.MANIFEST_NAME), json.dumps(man, indent=1).encode())


DAMAGED_NAME = ".easyckpt-damaged.json"


def mark_damaged(save_dir: str, dir_name: str, reason: str, log: AuditLog) -> None:
    """Record that the loader rejected committed step directory ``dir_name`` (retention.py then never
    keeps it in place of a verified one). The record survives restarts; it is a hint, never trusted
    for more than ordering deletions."""
    record = read_damaged(save_dir)
    record[dir_name] = reason[:500]
    log.emit("damaged", path=os.path.join(save_dir, dir_name), reason=reason[:500])
    atomic_write(os.path.join(save_dir, DAMAGED_NAME), json.dumps(record, indent=1, sort_keys=True).encode())


def read_damaged(save_dir: str) -> Dict[str, str]:
    """{step directory name: why the loader rejected it}; empty when there is no valid record."""
    try:
        fd = os.open(os.path.join(save_dir, DAMAGED_NAME), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        data = json.loads(os.read(fd, 1 << 20) or b"{}")
    except ValueError:
        return {}
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _clear_damaged(save_dir: str, dir_name: str) -> None:
    """A new commit under a name the loader once rejected is a new, verified checkpoint."""
    record = read_damaged(save_dir)
    if record.pop(dir_name, None) is not None:
        atomic_write(os.path.join(save_dir, DAMAGED_NAME), json.dumps(record, indent=1, sort_keys=True).encode())


def trash_path(save_dir: str, job_id: str, victim: str) -> str:
    """Where a directory goes before it is deleted (a rename is atomic, rmtree is not); named after the
    job, so that a restart of this job finishes only its own deletions."""
    return os.path.join(save_dir, f"{TRASH_PREFIX}{job_id}-{os.path.basename(victim)}-{os.getpid()}")


def _retire_existing(save_dir: str, job_id: str, final: str, log: AuditLog) -> None:
    """A step directory of the same name exists (a run resumed from an older step reached it again).
    Replace it only if it is a checkpoint of this job: a foreign directory is never touched (promise 4)."""
    man = mf.read(final)
    if man is None and os.listdir(final):
        raise FileExistsError(f"{final} exists and is not an easyckpt checkpoint; refusing to replace it")
    if man is not None and man.get("job_id") != job_id:
        raise FileExistsError(f"{final} holds a checkpoint of another job ({man.get('job_id')}); refusing to "
                              f"replace it: move it away, or give this job another save_dir")
    trash = trash_path(save_dir, job_id, final)
    log.emit("delete", path=final, reason="replaced by a newer commit of the same step")
    os.rename(final, trash)
    fsync_dir(save_dir)
    shutil.rmtree(trash, ignore_errors=True)


def staging_dirs(save_dir: str, job_id: str) -> List[str]:
    prefix = f"{STAGING_PREFIX}{job_id}-"
    return sorted(os.path.join(save_dir, n) for n in os.listdir(save_dir) if n.startswith(prefix))


def remove_staging(save_dir: str, job_id: str, log: AuditLog, only: Optional[str] = None) -> None:
    """Remove this job's staging (and trash) leftovers; never anything without our prefix and id."""
    own = (f"{STAGING_PREFIX}{job_id}-", f"{TRASH_PREFIX}{job_id}-")
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if not name.startswith(own) or (only is not None and path != only):
            continue
        log.emit("delete", path=path, reason="staging leftover")
        shutil.rmtree(path, ignore_errors=True)
