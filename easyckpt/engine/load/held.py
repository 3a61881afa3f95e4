"""What this node's memory holds of a step written by another world size or layout: the complete snapshots of
any rank of the job, in the node's own slots (ranks that ran here) and in its replica slots (ranks of other
nodes, agent/replicas.py), each read and checked as every slot is (ipc/slotread.py).

The memory-backed reshard (resharded.py) lists them on every rank, agrees on a step the nodes hold whole
between them, and moves a slot between nodes as its bytes: ``slot_bytes`` reads them under the slot's seqlock
with their checksum, ``read_moved`` checks them on arrival and decodes them like any slot.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from easyckpt.engine.save import snapshot
from easyckpt.engine.seams import Payload
from easyckpt.errors import BadSlotMeta, SlotNotComplete, UntrustedFileError
from easyckpt.formats import manifest as mf
from easyckpt.ipc import shm, slotread

DIGEST_BYTES = len(mf.checksum(b"").encode())     # the checksum sent after a moved slot's bytes


@dataclass(frozen=True)
class Held:
    """One complete snapshot of rank ``rank`` (of the run that wrote it) in this node's memory."""
    path: str                      # its slot file on this node (shm.slot_path or shm.replica_path)
    rank: int
    replica: bool                  # a replica slot (another node's rank), else a slot of a rank that ran here
    step: int
    world_size: int
    layout: Optional[str]
    nbytes: int                    # what moving it to another node sends: header, tensors, metadata
    capacity: int                  # the slot's size as its header says (the metadata's room included)
    files: Tuple[Tuple[str, bool], ...]    # (relpath, persisted by this rank) of each of its files
    info: Tuple[Tuple[str, Any], ...]      # the adapter's info, as the manifest would merge it


def node_key() -> str:
    """This node, as the ranks tell nodes apart: the host's name and boot, and the /dev/shm its slots live in
    (ranks that share it see the same slots)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    st = os.stat(shm.SHM_DIR)
    return f"{socket.gethostname()}/{boot}/{st.st_dev}:{st.st_ino}"


def held_here(job_id: str, world_size: int, layout: Optional[str]) -> List[Held]:
    """The complete snapshots of the job in this node's memory taken on another world size or layout (those of
    this one are the memory and peer sources'). A slot that is not a regular file of this user is left out (the
    memory source names it), and so is one whose header names another rank than its file name, or a rank outside
    its world size: it is nobody's shard."""
    found = []
    for seg in shm.list_segments(job_id):
        try:
            done = slotread.read_complete(seg.path)
        except UntrustedFileError:
            continue
        if done is None:
            continue
        hdr, meta = done.header, done.meta
        if hdr.world_size == world_size and (layout is None or meta.layout == layout):
            continue
        if hdr.rank != seg.rank or not 0 <= hdr.rank < hdr.world_size:
            continue
        info = tuple(sorted((str(k), v) for k, v in meta.info.items()))
        files = tuple((f.relpath, f.persist) for f in meta.files)
        found.append(Held(seg.path, seg.rank, seg.replica, hdr.step, hdr.world_size, meta.layout,
                          hdr.meta_offset + hdr.meta_len, hdr.meta_offset + hdr.meta_capacity, files, info))
    return found


def slot_bytes(held: Held) -> bytearray:
    """The slot's bytes (as far as its metadata) and then their checksum, read under its seqlock: SlotNotComplete
    when it changed or no longer holds ``held.step``."""
    slot = shm.Slot(held.path, writable=False, populate=True)
    try:
        done = slotread.check(slot, expect_step=held.step)
        size = done.header.meta_offset + done.header.meta_len
        if size != held.nbytes:
            raise SlotNotComplete(f"{held.path} was rewritten since it was listed ({size} bytes, not {held.nbytes})")
        assert slot.mm is not None
        out = bytearray(size + DIGEST_BYTES)
        out[:size] = slot.mm[:size]
        slotread.ensure_unchanged(slot, done)
        out[size:] = mf.checksum(memoryview(out)[:size]).encode()
        return out
    finally:
        slot.close()


def verified(data: Payload, what: str) -> memoryview:
    """The slot's bytes of a move (slot_bytes' output as it arrived), checked against the checksum sent after them;
    ValueError when they are not what was sent."""
    body, digest = memoryview(data)[:-DIGEST_BYTES], bytes(data[-DIGEST_BYTES:]).decode("ascii", "replace")
    if mf.checksum(body) != digest:
        raise ValueError(f"{what}: the bytes that arrived do not match the sender's checksum")
    return body


def read_moved(data: Payload, held: Held, what: str) -> Dict[str, Any]:
    """``{relpath: tree}`` of a slot moved from another node (its bytes and checksum, from slot_bytes): checked
    against the checksum, then as any slot (header, metadata, step), its tensors copied out. ValueError when the bytes
    are not what was sent."""
    slot = shm.Slot.of_bytes(verified(data, what), held.capacity, what)
    try:
        # copied out, as from a slot: FSDP2's restore from views of these bytes died of SIGSEGV on the simulated
        # nodes (tests/test_many_nodes.py; the cause was not found), and a copy of one slot is cheap beside its move
        return snapshot.read_slot(slot, held.step)
    except (SlotNotComplete, BadSlotMeta) as exc:
        raise ValueError(f"{what}: {exc}") from None
    finally:
        slot.close()
