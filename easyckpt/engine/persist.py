"""Write one rank's snapshot from its shared-memory slot into a step's staging directory.

Runs in the node agent, never in a trainer. Each shard file is a small JSON header followed by the
tensor bytes, which go from the slot to the disk with O_DIRECT and no copy (storage/direct.py); a
thread checksums the same bytes from the mapping meanwhile. Framework-native torch.save files go
through the same writer's bounce buffer. After the last byte the slot's generation is checked again:
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
from ..storage.direct import SequentialWriter
from ..storage.posix import fsync_dir
from . import manifest as mf
from . import shm
from .shardfile import encode_header, file_entries
from .tree import raw_bytes


class SnapshotChanged(RuntimeError):
    pass


def persist_slot(slot_path: str, generation: int, staging: str, rank: int,
                 direct_io: bool = True) -> Tuple[int, Dict[str, Any], int, float, Dict[str, Any]]:
    """Persist the snapshot ``generation`` held in ``slot_path``;
    return (step, files, bytes, seconds, the adapter's info for the manifest).
    ``direct_io``: write around the page cache where the file system allows it."""
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
        written: List[SequentialWriter] = []
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
                    out = SequentialWriter(path, direct=direct_io)
                    written.append(out)
                    fmt = f.get("fmt", "safetensors")
                    if fmt == "torch":
                        digest = _write_torch(out, view, f, meta["skeletons"][rel])
                    elif fmt == "raw":
                        data = raw_bytes(meta["skeletons"][rel])
                        out.write(data)
                        digest = mf.checksum(data)
                    else:
                        header = encode_header(file_entries(f["tensors"], f["start"]), meta["skeletons"][rel],
                                               data_phase=f["start"])
                        digest = _write_shard(out, header, view, f["start"], f["end"])
                    out.finish()
                    size = out.size
                    files[rel] = {"size": size, "checksum": digest, "format": fmt}
                    total += size
                    faults.inject("agent.persist_file", rank)
            # fsync once every file is written: where O_DIRECT was refused, the kernel writes the first
            # files back while the later ones are copied, instead of the copy waiting for each flush
            for out in written:
                os.fsync(out.fd)
        finally:
            for out in written:
                out.close()
        for d in sorted(made_dirs, key=len, reverse=True):
            fsync_dir(d)
        if slot.state() != (shm.COMPLETE, generation):
            raise SnapshotChanged(f"slot {slot_path} was overwritten while it was persisted")
        return hdr.step, files, total, time.perf_counter() - t0, meta.get("info") or {}
    finally:
        slot.close()


def _write_shard(out: SequentialWriter, header: bytes, view: memoryview, start: int, end: int) -> str:
    hasher = mf.Hasher()
    hasher.update(header)
    worker = threading.Thread(target=hasher.update, args=(view[start:end],), daemon=True)
    worker.start()
    try:
        out.write(header)
        out.write_mapped(view, start, end)
    finally:
        worker.join()
    return hasher.hexdigest()


class _HashingWriter:
    """A file object for torch.save that writes through ``out`` and checksums on the way."""

    def __init__(self, out: SequentialWriter):
        self.out, self.hasher = out, mf.Hasher()

    def write(self, data) -> int:
        self.hasher.update(data)
        return self.out.write(data)

    def flush(self) -> None:
        pass


def _write_torch(out: SequentialWriter, view: memoryview, f: Dict[str, Any], skeleton: Any) -> str:
    """A framework-native torch.save file. torch is imported here only: jobs whose layouts are all
    safetensors keep an agent that never loads it."""
    import warnings

    import torch
    import torch.utils.serialization as serialization

    from .shardfile import torch_dtype
    from .tree import unflatten_pickled

    # one storage per tensor, as a plain torch.save of the live state would have: consumers such as
    # torch.set_rng_state read a tensor's storage from its start, ignoring a view's offset
    tensors: Dict[str, Any] = {}
    with warnings.catch_warnings():   # the slot is mapped read-only; we only read through it
        warnings.simplefilter("ignore")
        for key, dtype, shape, b, e in f["tensors"]:
            dt = torch_dtype(dtype)
            tensors[key] = (torch.frombuffer(view[b:e], dtype=dt).view(shape) if e > b
                            else torch.empty(shape, dtype=dt))
    tree = unflatten_pickled(skeleton, tensors)
    writer = _HashingWriter(out)
    # the manifest's xxh3 already guards integrity; torch's per-record CRC32 would halve the speed
    serialization.config.save.compute_crc32 = False
    torch.save(tree, writer)
    del tree, tensors
    return writer.hasher.hexdigest()
