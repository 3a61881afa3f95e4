"""Write one rank's snapshot from its shared-memory slot into a step's staging directory.

Runs in the node agent, never in a trainer. Each shard file is a small JSON header followed by the
tensor bytes, which the kernel copies from the slot to the file (sendfile); a thread checksums the
same bytes from the mapping meanwhile. After the last byte the slot's generation is checked again:
if the trainer had started to overwrite the slot, the shard is discarded (promise 3: the values
persisted for step S are the values of step S).
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, List, Tuple

from .. import faults
from ..storage.posix import copy_range, fsync_dir, write_all
from . import manifest as mf
from . import shm
from .shardfile import encode_header, file_entries


class SnapshotChanged(RuntimeError):
    pass


def persist_slot(slot_path: str, generation: int, staging: str, rank: int) -> Tuple[int, Dict[str, Any], int, float]:
    """Persist the snapshot ``generation`` held in ``slot_path``; return (step, files, bytes, seconds)."""
    t0 = time.perf_counter()
    slot = shm.Slot(slot_path, writable=False)
    try:
        hdr = slot.read_header()
        if hdr is None or hdr.generation != generation:
            raise SnapshotChanged(f"slot {slot_path} no longer holds generation {generation}")
        meta_raw = slot.read_meta(hdr)
        if meta_raw is None:
            raise SnapshotChanged(f"slot {slot_path} has damaged metadata")
        meta = json.loads(meta_raw)
        files: Dict[str, Any] = {}
        total = 0
        made_dirs = {staging}
        os.makedirs(staging, exist_ok=True)
        written: List[int] = []
        try:
            with memoryview(slot.mm) as view:
                for f in meta["files"]:
                    if not f["persist"]:
                        continue
                    rel = f["relpath"]
                    path = os.path.join(staging, rel)
                    parent = os.path.dirname(path)
                    if parent not in made_dirs:
                        os.makedirs(parent, exist_ok=True)
                        made_dirs.add(parent)
                    header = encode_header(file_entries(f["tensors"], f["start"]), meta["skeletons"][rel])
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    written.append(fd)
                    digest = _write_shard(fd, header, slot.fd, view, f["start"], f["end"])
                    size = len(header) + f["end"] - f["start"]
                    files[rel] = {"size": size, "checksum": digest}
                    total += size
                    faults.inject("agent.persist_file", rank)
            # fsync only once every file is written: the kernel writes the first files back while the
            # later ones are copied, instead of the copy waiting for each flush in turn
            for fd in written:
                os.fsync(fd)
        finally:
            for fd in written:
                os.close(fd)
        for d in sorted(made_dirs, key=len, reverse=True):
            fsync_dir(d)
        if slot.state() != (shm.COMPLETE, generation):
            raise SnapshotChanged(f"slot {slot_path} was overwritten while it was persisted")
        return hdr.step, files, total, time.perf_counter() - t0
    finally:
        slot.close()


def _write_shard(fd: int, header: bytes, src_fd: int, view: memoryview, start: int, end: int) -> str:
    hasher = mf.Hasher()
    hasher.update(header)
    worker = threading.Thread(target=hasher.update, args=(view[start:end],), daemon=True)
    worker.start()
    try:
        write_all(fd, header)
        copy_range(src_fd, fd, start, end - start)
    finally:
        worker.join()
    return hasher.hexdigest()
