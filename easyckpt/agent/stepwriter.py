"""Write one rank's snapshot from its shared-memory slot into a step's staging directory.

Runs in the node agent, never in a trainer. Each shard file is a small JSON header followed by the
tensor bytes, which go from the slot to the disk with O_DIRECT and no copy (the Storage interface's
Writer: storage/direct.py on POSIX); a thread checksums the same bytes from the mapping meanwhile.
Framework-native torch.save files are assembled from the trainer's pickle and the slot's bytes
(storage/nativefiles.py, formats/torchzip.py): the agent never unpickles. Every file name comes from the slot's checked metadata
(slotmeta.py) and stays inside the staging directory (paths.py); files are created exclusively, never
through a symlink. After the last byte the slot's generation is checked again: if the trainer had
started to overwrite the slot, the shard is discarded (docs/reliability.md promise 3: the values
persisted for step S are the values of step S).
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

from easyckpt import _faults as faults
from easyckpt.errors import SlotNotComplete, SnapshotChanged
from easyckpt.formats import manifest as mf
from easyckpt.ipc import shm, slotread
from easyckpt.storage import nativefiles, stepfiles
from easyckpt.storage.base import Storage, Writer
from easyckpt.storage.posix import PosixStorage

def persist_slot(slot_path: str, generation: int, staging: str, rank: int, direct_io: bool = True,
                 storage: Optional[Storage] = None
                 ) -> Tuple[int, Dict[str, mf.FileEntry], int, float, Dict[str, Any]]:
    """Persist the snapshot ``generation`` held in ``slot_path``;
    return (step, files, bytes, seconds, the adapter's info for the manifest).
    ``direct_io``: write around the page cache where the file system allows it. ``storage``: the save
    dir's back-end (the SaveDir's; POSIX by default)."""
    t0 = time.perf_counter()
    storage = storage if storage is not None else PosixStorage()
    slot = shm.Slot(slot_path, writable=False)
    try:
        try:
            complete = slotread.check(slot, expect_generation=generation)
        except SlotNotComplete as exc:
            raise SnapshotChanged(str(exc)) from None
        hdr, meta = complete.header, complete.meta
        assert slot.mm is not None      # check() refuses a slot too small to be mapped
        files: Dict[str, mf.FileEntry] = {}
        total = 0
        made_dirs = {staging}
        storage.make_own_dir(staging)      # never a directory another user made first in a shared save dir
        written: List[Writer] = []
        try:
            with memoryview(slot.mm) as view:
                for f in meta.files:
                    if not f.persist:
                        continue
                    rel = f.relpath
                    parent = os.path.dirname(os.path.join(staging, rel))
                    if parent not in made_dirs:
                        storage.makedirs(parent)
                        made_dirs.add(parent)
                    path = stepfiles.join(storage, staging, rel)    # after makedirs: no directory on the way leads out
                    out = storage.open_writer(path, direct=direct_io)
                    written.append(out)
                    digest, items = nativefiles.WRITERS[f.fmt](out, view, f)
                    out.finish()
                    size = out.size
                    files[rel] = mf.FileEntry(size, digest, f.fmt, items)
                    total += size
                    faults.inject("agent.persist_file", rank)
            # fsync once every file is written: where O_DIRECT was refused, the kernel writes the first
            # files back while the later ones are copied, instead of the copy waiting for each flush
            for out in written:
                out.sync()
        finally:
            for out in written:
                out.close()
        for d in sorted(made_dirs, key=len, reverse=True):
            storage.sync_dir(d)
        if slot.state() != (shm.COMPLETE, generation):
            raise SnapshotChanged(f"slot {slot_path} was overwritten while it was persisted")
        return hdr.step, files, total, time.perf_counter() - t0, dict(meta.info)
    finally:
        slot.close()
