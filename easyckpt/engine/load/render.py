"""A step held whole by the nodes' memory, written out as storage would hold it, for an adapter whose restore reads
a step directory (Megatron's torch_dist reader, DeepSpeed's universal conversion): each file in the framework's
native layout from the slot that holds it (storage/nativefiles.py: the very bytes the agent persists), with its
manifest, in a private directory in this node's /dev/shm. Nothing of it goes to the save dir.

One rank per node writes it (the node's first rank in the load's gather): the ranks of a node share its memory,
and a step written once per rank would take as many times the room. resharded.py gives the directory to every
rank of the node; Checkpointer.load removes it once every rank restored (``remove``), and the next load removes
one that a load which died left behind (``remove_stale``).
"""
from __future__ import annotations

import os
import stat
import tempfile
from typing import Dict, Optional

from easyckpt.engine.load import held as heldmod
from easyckpt.engine.load.reshardplan import Whole, local
from easyckpt.engine.seams import Payload
from easyckpt.formats import manifest as mf
from easyckpt.ipc import shm, slotread
from easyckpt.storage import nativefiles, stepfiles
from easyckpt.storage.posix import PosixStorage

PREFIX = "easyckpt-render-"       # + job id + "-": never an easyckpt segment's name (shm._NAME)
_storage = PosixStorage()


def write(plan: Whole, here: str, moved: Dict[int, Payload], job_id: str, framework: str, room: float) -> str:
    """The directory holding step ``plan.step`` as storage would (its manifest last), written from this node's
    slots and the slots ``moved`` here; removed again on any failure. ``room``: what the restore takes in all, in
    times the step's bytes (it writes beside the step: ``beside``), free first, else OSError."""
    need = int(room * sum(h.nbytes for hs in plan.holders.values() for _, h in hs[:1]))
    if need > shm.free_bytes():
        raise OSError(f"{shm.SHM_DIR} has {shm.free_bytes()} bytes free, writing the step out and restoring it "
                      f"needs about {need}")
    directory = tempfile.mkdtemp(dir=shm.SHM_DIR, prefix=f"{PREFIX}{job_id}-")
    try:
        files: Dict[str, mf.FileEntry] = {}
        for old in sorted(plan.holders):
            held = local(plan, here, old)
            what = f"rank {old}'s slot of step {plan.step}"
            slot = shm.Slot(held.path, writable=False, populate=True) if held is not None else \
                shm.Slot.of_bytes(heldmod.verified(moved[old], what), plan.holders[old][0][1].capacity, what)
            try:
                files.update(_files(slot, plan.step, directory))
            finally:
                slot.close()
        man = mf.build(plan.step, job_id, framework, plan.world_size, files, plan.info())
        _storage.write_atomic(os.path.join(directory, mf.MANIFEST_NAME), man.to_bytes())
        return directory
    except BaseException:
        _storage.delete(directory)
        raise


def _files(slot: shm.Slot, step: int, directory: str) -> Dict[str, mf.FileEntry]:
    """Every persisted file of the open ``slot`` (checked for ``step``, and unchanged after) under ``directory``."""
    done = slotread.check(slot, expect_step=step)
    out: Dict[str, mf.FileEntry] = {}
    assert slot.mm is not None
    with memoryview(slot.mm) as view:
        for f in done.meta.files:
            if not f.persist:
                continue
            path = stepfiles.join(_storage, directory, f.relpath)
            _storage.makedirs(os.path.dirname(path))
            writer = _storage.open_writer(path, direct=False)
            try:
                digest, items = nativefiles.WRITERS[f.fmt](writer, view, f)
                writer.finish()
                out[f.relpath] = mf.FileEntry(writer.size, digest, f.fmt, items)
            finally:
                writer.close()
    slotread.ensure_unchanged(slot, done)
    return out


def beside(directory: str, what: str) -> str:
    """A directory for what the restore of the written-out step ``directory`` writes (``what``: e.g. "universal",
    DeepSpeed's converted copy): inside that private directory (mkdtemp's, mode 0700), so no other user can plant
    anything at its name in the shared /dev/shm, and ``remove`` takes it with the step. The manifest does not list
    it: nothing reads it as part of the step. Its maker creates and removes it."""
    if os.path.dirname(directory) != shm.SHM_DIR.rstrip("/") or \
            not os.path.basename(directory).startswith(PREFIX) or not what.isidentifier():
        raise ValueError(f"{directory} is no step written out by render.write")
    return os.path.join(directory, f".{what}")


def remove_stale(job_id: str) -> None:
    """Remove what a load of this job that died wrote out here. Called as the sources open, before the load's first
    gather: no rank of this load has written one yet."""
    try:
        names = os.listdir(shm.SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(f"{PREFIX}{job_id}-"):
            remove(os.path.join(shm.SHM_DIR, name), job_id)


def remove(directory: Optional[str], job_id: str) -> None:
    """Remove a directory ``write`` made (any rank of the node may: the first removal wins). Only a directory of
    ours by its name and owner, never through a symlink."""
    if not directory or os.path.dirname(directory) != shm.SHM_DIR.rstrip("/") or \
            not os.path.basename(directory).startswith(f"{PREFIX}{job_id}-"):
        return
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        _storage.delete(directory)      # (another rank of the node may be removing it too: both end well)

