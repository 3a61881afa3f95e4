"""Per-rank markers: rank r's files of a step are durable (formats/marker.py is their format). Written by each
rank's agent after its files are (a small atomic write into the step's staging dir, or under its final prefix on an
object store), read by the coordinator before the commit, which merges them into the manifest and drops them."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from easyckpt.formats import layout
from easyckpt.formats import manifest as mf
from easyckpt.formats.marker import Marker
from easyckpt.storage.base import Storage

MAX_RECORD_BYTES = 1 << 20     # markers are small JSON; a larger one is not ours


def write(storage: Storage, staging: str, step: int, rank: int, files: Dict[str, mf.FileEntry],
          info: Optional[Dict[str, Any]] = None) -> None:
    """Rank ``rank``'s files of ``step`` are durable in ``staging`` (written after they are)."""
    storage.write_atomic(os.path.join(staging, layout.marker_name(rank)),
                         Marker(rank, step, files, info or {}).to_json())


def read(storage: Storage, staging: str) -> Dict[int, Marker]:
    """rank -> its marker, for every valid marker in ``staging`` (none when it is gone)."""
    try:
        names = storage.listdir(staging)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for name in names:
        if layout.parse_marker(name) is None:
            continue
        try:
            marker = Marker.parse(storage.read(os.path.join(staging, name), 0, MAX_RECORD_BYTES))
        except (OSError, ValueError):
            continue
        out[marker.rank] = marker
    return out


def merge(found: Dict[int, Marker], step: int, world_size: int) -> Tuple[Dict[str, mf.FileEntry], Dict[str, Any]]:
    """(files, info) of ``step`` merged from every rank's marker, for its manifest; RuntimeError unless there is one
    per rank, all of that step."""
    steps = {m.step for m in found.values()}
    if set(found) != set(range(world_size)) or steps != {step}:
        raise RuntimeError(f"refusing to commit step {step}: shards from ranks {sorted(found)} for steps "
                           f"{sorted(steps)}, expected every rank of {world_size} at step {step}")
    files: Dict[str, mf.FileEntry] = {}
    info: Dict[str, Any] = {}
    for rank in sorted(found, reverse=True):   # what the adapter said on rank 0 wins
        files.update(found[rank].files)
        info.update(found[rank].info)
    return files, info


def manifest(owner: Any, job: str, step: int, world_size: int, found: Dict[int, Marker]) -> mf.Manifest:
    """The manifest of ``step`` of job ``job`` from every rank's marker, numbered with its run by ``owner`` (the
    save dir: commit.Owner); what both commit strategies write."""
    files, info = merge(found, step, world_size)
    return mf.build(step, job, owner.naming.framework, world_size, files, info, job_name=owner.job_name,
                    run_seq=owner.run_seq(info))
