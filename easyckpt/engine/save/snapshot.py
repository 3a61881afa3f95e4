"""Trainer side of a snapshot: copy one rank's state into a free shared-memory slot.

The layout (where each tensor lives in the slot) is computed on the first snapshot and reused as
long as the state has the same tensors. Both slots are allocated and mapped before the first snapshot
when the adapter can say how large its state will be (``prepare``, right after the load: a thread
reserves the first slot while the first iteration runs, the second once the first snapshot is taken), else
at the first snapshot; either way a
steady-state snapshot is a plain copy into warm memory, with no allocation and no pickling.

Slot choice. The agent may be reading a slot (busy) or owe it a persist (requested, not yet
released); such a slot is *reserved* and never overwritten. Of the others, the one with the older
snapshot is written, so the newest complete snapshot survives a crash in the middle of a copy.
When both slots are reserved (storage slower than save_storage_interval) the snapshot is skipped
rather than making training wait for storage. Likewise a snapshot that only goes to memory is skipped
when the second slot is still being prepared after a short wait (``SECOND_SLOT_WAIT``): the first slot
keeps the newest snapshot, and waiting for the rest of the preparation stalled the second save of a
4 GB state for 7.5 s on the test VM. A snapshot to be persisted waits for the slot.
"""
from __future__ import annotations

import json
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from easyckpt import _faults as faults
from easyckpt.engine.save import pinned
from easyckpt.engine.save.background import PendingSnapshot, copy_all
from easyckpt.engine.save.metajson import KeptJson, encode_meta
from easyckpt.engine.shards import shardload
from easyckpt.engine.shards.codecs import FLATTEN
from easyckpt.engine.shards.tree import Tensors, rebuild
from easyckpt.engine.shards.treeplan import Flattener
from easyckpt.errors import EasyCkptError, ShmCapacityError
from easyckpt.formats.shardfile import dtype_name
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.ipc import priority, shm, slotread
from easyckpt.units import human

_ALIGN = 64
# seconds a memory-only snapshot waits for the second slot's preparation before it is skipped: ample for
# small slots (tests take their steps for granted), short beside the seconds a large one can still need
SECOND_SLOT_WAIT = 0.5


@dataclass
class ShardSpec:
    """One shard file of a rank's state: its relative path, tree, and whether this rank persists it."""

    relpath: str
    tree: Any
    persist: bool = True
    fmt: ShardFormat = ShardFormat.SAFETENSORS    # what the file is (formats/shardformat.py says each)


@dataclass
class _Layout:
    signature: Tuple
    files: List[Dict[str, Any]]   # relpath, persist, start, end, tensors[(key, dtype, shape, begin, end)]
    data_bytes: int
    json: bytes
    order: List[List[int]]        # per file, its tensors' indices in the order they are laid out (_order_of)


@dataclass
class SnapshotResult:
    step: int
    slot: int
    generation: int
    nbytes: int
    seconds: float


def _build_layout(signature: Tuple, flat: List[Tuple[str, bool, str, List[Tuple[str, torch.Tensor]]]]) -> _Layout:
    files, pos, order = [], 0, []
    for relpath, persist, fmt, tensors in flat:
        pos += -pos % _ALIGN
        start = pos
        entries = []
        order.append(_order_of(tensors))
        for key, t in (tensors[i] for i in order[-1]):
            n = t.numel() * t.element_size()
            entries.append((key, dtype_name(t.dtype), list(t.shape), shm.HEADER_BYTES + pos,
                            shm.HEADER_BYTES + pos + n))
            pos += n
        files.append({"relpath": relpath, "persist": persist, "fmt": fmt, "start": shm.HEADER_BYTES + start,
                      "end": shm.HEADER_BYTES + pos, "tensors": entries})
    return _Layout(signature, files, pos, json.dumps(files, separators=(",", ":")).encode(), order)


def _order_of(tensors: List[Tuple[str, torch.Tensor]]) -> List[int]:
    """Biggest element size first: every tensor then starts at a multiple of its own item size while
    staying back to back (safetensors rejects gaps); same dtypes together, for a stable order. Kept with the
    layout: the next snapshots of the same signature take it from there instead of sorting again."""
    return sorted(range(len(tensors)), key=lambda i: (-tensors[i][1].element_size(), str(tensors[i][1].dtype)))


class Snapshotter:
    def __init__(self, job_id: str, rank: int, world_size: int, replica_copies: int = 0):
        """``replica_copies``: how many other nodes' snapshots this node holds (peer replicas): their
        room is part of the capacity check before the first snapshot."""
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.replica_copies = replica_copies
        self.paths = [shm.slot_path(job_id, rank, i) for i in (0, 1)]
        self.slots: List[Optional[shm.Slot]] = [None, None]
        self._pinned = [0, 0]    # address of each slot's mapping registered with CUDA, 0 if not
        self.layout: Optional[_Layout] = None
        self._views: List[Optional[List[torch.Tensor]]] = [None, None]
        self.generation = 0
        self._meta_cache = KeptJson()           # encode_meta's
        self._flattener = Flattener()           # each shard's walk written out for its shape (treeplan.py)
        self._preparing: Optional[List[threading.Thread]] = None    # the slots' preparation (prepare())
        self._prepared: List[Optional[shm.Slot]] = [None, None]
        self._ready = [threading.Event(), threading.Event()]    # set when the thread is done with slot i
        self._size = 0                            # of each slot prepare() reserves
        self._wanted = [threading.Event(), threading.Event()]   # a snapshot waits for slot i: stop faulting in
        self.skipped: Optional[str] = None    # why the last snapshot() returned None, if not both slots reserved
        self.rescan()

    def rescan(self) -> None:
        """Continue the generation count of the slots (a restarted trainer, a slot pulled from a peer)."""
        for path in self.paths:
            try:
                slot = shm.Slot(path, writable=False)
            except FileNotFoundError:
                continue
            if slot.mm is not None and slot.size >= shm.HEADER_BYTES:
                self.generation = max(self.generation, slot.state()[1])
            slot.close()

    # ---- slot management -----------------------------------------------------------------

    def _slot_size(self, meta_len: int) -> int:
        assert self.layout is not None
        return shm.slot_size(self.layout.data_bytes, meta_len)

    def prepare(self, data_bytes: int) -> Optional[str]:
        """Reserve and map both slots for about ``data_bytes`` of tensors on a thread of their own
        (Slot.reserve: system calls that release the GIL), so that the first
        snapshot finds them ready and waits only for what is left. Best effort: with no room in
        /dev/shm for the estimate nothing is prepared, and the first snapshot's own check says so.
        Returns why nothing is prepared, or None when the thread started."""
        if self._preparing is not None or any(s is not None for s in self.slots):
            return "the slots are already mapped"
        if data_bytes <= 0:
            return "no estimate of the state's size"
        size = shm.slot_size(data_bytes, 0)
        need = sum(max(0, size - _file_size(p)) for p in self.paths)
        if need and need + 2 * size * self.replica_copies > shm.free_bytes():
            return f"{shm.SHM_DIR} has {human(shm.free_bytes())} free, the slots need {human(need)} more"

        for event in self._ready + self._wanted:
            event.clear()
        self._size = size
        self._preparing = [self._prepare_thread(0, nice=True)]
        return None

    def _prepare_thread(self, i: int, nice: bool) -> threading.Thread:
        """A thread that reserves slot ``i`` and faults its pages in (until a snapshot waits for it). ``nice``:
        below training's priority (the first slot, while the first iteration runs: on a busy CPU the first
        touch of fresh memory then waits for the iteration, not the reverse; a 2 GB slot made the first
        iteration 3.5 times as long, bench_peer.py). The second slot is prepared once the first snapshot is
        taken, at training's own priority, so that it is ready within a few steps."""
        def run() -> None:
            if nice:
                priority.bulk_thread()
            path, size = self.paths[i], self._size
            try:
                slot = shm.Slot.create_or_grow(path, size, reserve=False) if _file_size(path) < size \
                    else shm.Slot(path, writable=True)
                # reserved and faulted in piece by piece until a snapshot waits for it (which does the rest on
                # more threads, _adopt). Reserving alone here and faulting in at the first snapshot made that
                # snapshot pay more than the first iteration gained (bench_peer.py, first iteration + first save:
                # 1.11 / 2.07-2.08 s at 1 / 2 GB, against 0.99-1.04 / 1.94-1.98 s this way)
                slot.reserve(stop=self._wanted[i].is_set)
                self._prepared[i] = slot
            except (OSError, EasyCkptError):
                pass                # the snapshot allocates, and reports, by itself
            finally:
                self._ready[i].set()
        thread = threading.Thread(target=run, daemon=True, name=f"easyckpt-slot{i}")
        thread.start()
        return thread

    def _prepare_second(self) -> None:
        """After the first snapshot: the second slot's turn (when prepare() reserves the slots)."""
        if self._preparing is not None and len(self._preparing) == 1:
            self._preparing.append(self._prepare_thread(1, nice=False))

    def wait_prepared(self, both: bool = True) -> None:
        """Both slots ready (what is left of their reservation done now, _adopt).
        ``both=False``: only wait for what was started (closing)."""
        if self._preparing is None:
            return
        for event in self._wanted:
            event.set()
        if both:
            self._prepare_second()
        for thread in self._preparing:
            thread.join()      # bounded: it stops after the piece of the slot it is reserving
        self._preparing = None
        prepared, self._prepared = self._prepared, [None, None]
        for i, slot in enumerate(prepared):
            try:
                if slot is not None and self.slots[i] is None and both:
                    self.slots[i], slot = self._adopt(slot), None
            finally:        # (no room for the first: the second is let go all the same)
                if slot is not None:
                    slot.close()

    @staticmethod
    def _adopt(slot: shm.Slot) -> shm.Slot:
        """A prepared slot, what its thread did not reserve reserved now (ShmCapacityError where there is no
        room: nothing may be written to a page that is not) and every page faulted in, on as many threads as torch
        copies with: the training thread waits for them either way."""
        slot.reserve(threads=min(8, torch.get_num_threads()))
        return slot

    def _ensure_slots(self, meta_len: int, persist: bool) -> bool:
        """Allocate (or grow) both slots before the first copy, after checking /dev/shm has room.
        The first snapshot needs one slot: while the preparation still works on the second, it takes
        the first as soon as that one is ready. Fresh memory is slow to hand out on some machines, and
        the first iteration pays for half of it. The next snapshot waits for the second slot if it is
        to be persisted; one for memory alone waits a little, then is skipped (False, ``skipped`` says
        why) while the first slot keeps the newest snapshot."""
        assert self.layout is not None      # snapshot() builds it before sizing the slots
        if self._preparing is not None and all(s is None for s in self.slots):
            self._wanted[0].set()
            self._ready[0].wait()          # bounded: the thread stops after the piece it is reserving
            first = self._prepared[0]
            if first is not None and first.size >= shm.HEADER_BYTES + self.layout.data_bytes + meta_len:
                self._prepared[0] = None
                self.slots[0] = self._adopt(first)
                if not self._ready[1].is_set():
                    return True
        elif self._preparing is not None and self.slots[0] is not None and self.slots[1] is None \
                and not persist:
            if not self._ready[1].wait(SECOND_SLOT_WAIT):
                self.skipped = (f"the second snapshot slot is still being prepared after {SECOND_SLOT_WAIT:g} s "
                                f"(fresh memory is slow to come by); the first slot keeps the newest snapshot")
                return False
        self.wait_prepared()
        size = self._slot_size(meta_len)
        need = 0
        for i, path in enumerate(self.paths):
            slot = self.slots[i]
            current = slot.size if slot is not None else _file_size(path)
            if current < shm.HEADER_BYTES + self.layout.data_bytes + meta_len:
                need += max(0, size - current)
        if need == 0:
            for i in (0, 1):
                if self.slots[i] is None:    # a slot of an earlier run of this job: mapped in one pass
                    self.slots[i] = shm.Slot(self.paths[i], writable=True, populate=True)
            return True
        free = shm.free_bytes()
        replicas = 2 * size * self.replica_copies     # peers' snapshots, double-buffered like the slots
        if need + replicas > free:
            held = (f" and {human(replicas)} for the replicas of {self.replica_copies} other node(s)' "
                    f"snapshots this node holds (replication_factor={self.replica_copies + 1}; "
                    f"replication_factor=1 holds none)") if replicas else ""
            raise ShmCapacityError(
                f"rank {self.rank} needs {human(need)} more in {shm.SHM_DIR} for its two snapshot "
                f"slots ({human(size)} each){held} but only {human(free)} are free; every rank "
                f"on this node needs as much. To fix: {shm.shm_advice()}")
        for i, path in enumerate(self.paths):
            slot = self.slots[i]
            if slot is not None:
                if slot.size >= size:
                    continue
                self._close_slot(i)
            self.slots[i] = shm.Slot.create_or_grow(path, size, threads=min(8, torch.get_num_threads()))
        return True

    def _dst_views(self, i: int) -> List[torch.Tensor]:
        views = self._views[i]
        if views is None:
            slot = self.slots[i]
            assert slot is not None and self.layout is not None    # a picked slot, after the layout is built
            base = torch.frombuffer(slot.mm, dtype=torch.uint8)
            views = self._views[i] = shardload.views(base, (t for f in self.layout.files for t in f["tensors"]))
        return views

    def _pick_slot(self) -> Optional[int]:
        # only this process writes these slots, so their headers are not re-checked against the metadata
        # (slotread.check); a header that is not COMPLETE marks a free slot holding nothing worth keeping
        best, best_step = None, None
        for i in (0, 1):
            slot = self.slots[i]
            if slot is None:               # the second slot, still being prepared (the first snapshot)
                continue
            hdr = slot.read_header()
            if slot.reserved(hdr):
                continue
            step = -1 if hdr is None else hdr.step
            if best_step is None or step < best_step:    # set together with best
                best, best_step = i, step
        return best

    # ---- the snapshot --------------------------------------------------------------------

    def snapshot(self, step: int, shards: Sequence[ShardSpec], persist: bool,
                 info: Optional[Dict[str, Any]] = None,
                 defer: Optional[Callable[[torch.Tensor], bool]] = None) -> Union[SnapshotResult, "PendingSnapshot", None]:
        """Copy ``shards`` into a free slot. ``defer``: tensors for which it is true are copied by a
        background thread (the result is then a PendingSnapshot, published when that copy ends)."""
        t0 = time.perf_counter()
        flat: List[Tuple[str, bool, str, Tensors]] = []
        skeletons: Dict[str, Any] = {}
        srcs: List[torch.Tensor] = []
        for spec in shards:
            fmt = ShardFormat.parse(spec.fmt)
            skeleton, tensors = self._flattener.flatten(spec.relpath, spec.tree) if fmt is ShardFormat.SAFETENSORS \
                else FLATTEN[fmt](spec.tree)
            skeletons[spec.relpath] = skeleton
            flat.append((spec.relpath, spec.persist, fmt.value, tensors))
        signature = tuple([(rp, p, f, tuple([(k, t.dtype, t.shape) for k, t in ts])) for rp, p, f, ts in flat])
        if self.layout is None or self.layout.signature != signature:
            self.layout = _build_layout(signature, flat)
            self._views = [None, None]
        for (_, _, _, tensors), order in zip(flat, self.layout.order):
            srcs.extend(tensors[i][1] for i in order)
        meta = encode_meta(self.layout.json, step, skeletons, info or {}, self._meta_cache)
        self.skipped = None
        if not self._ensure_slots(len(meta), persist):
            return None
        # (no tensor is on a GPU before CUDA is initialized: one call instead of a question per tensor)
        if torch.cuda.is_initialized() and any(s.is_cuda for s in srcs):
            self._pin_slots()
        i = self._pick_slot()
        if i is None:
            return None
        slot = self.slots[i]
        assert slot is not None     # _pick_slot picks a mapped slot
        self.generation += 1
        slot.begin_write(self.generation)
        dsts = self._dst_views(i)
        faults.inject("trainer.mid_snapshot", self.rank)
        hdr = shm.Header(state=shm.COMPLETE, step=step, generation=self.generation, meta_len=len(meta),
                         meta_capacity=slot.size - shm.HEADER_BYTES - self.layout.data_bytes,
                         data_capacity=self.layout.data_bytes, persist=persist, meta_crc=0,
                         pid=0, rank=self.rank, world_size=self.world_size)
        result = SnapshotResult(step, i, self.generation, self.layout.data_bytes, 0.0)
        if defer is None:
            copy_all(dsts, srcs)
            slot.publish(hdr, meta)
            self._prepare_second()
            result.seconds = time.perf_counter() - t0
            return result
        now = [(d, s) for d, s in zip(dsts, srcs) if not defer(s)]
        later = [(d, s) for d, s in zip(dsts, srcs) if defer(s)]
        if now:
            copy_all(*zip(*now))
        self._prepare_second()
        return PendingSnapshot(result, later, lambda: slot.publish(hdr, meta),
                               lambda: slot.begin_write(result.generation), t0, self.rank)

    def _pin_slots(self) -> None:
        """Page-lock both slots once, so device-to-host copies into them run asynchronously (DMA) on
        a side stream instead of staging through a pageable bounce buffer."""
        for i, slot in enumerate(self.slots):
            if slot is not None and not self._pinned[i]:
                self._pinned[i] = pinned.pin(slot)

    def _close_slot(self, i: int) -> None:
        if self._pinned[i]:
            pinned.unpin(self._pinned[i])
            self._pinned[i] = 0
        self._views[i] = None
        slot = self.slots[i]
        if slot is not None:
            slot.close()
        self.slots[i] = None

    def close(self, unlink: bool) -> None:
        self.wait_prepared(both=False)
        for i in (0, 1):
            self._close_slot(i)
        if unlink:
            for path in self.paths:
                shm.unlink_quiet(path)


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


# ---- reading a snapshot back (loader) ---------------------------------------------------------

@dataclass
class SlotInfo:
    slot: int
    step: int
    generation: int
    world_size: int
    layout: Optional[str] = None     # the adapter's parallel layout (info "layout"), when it states one


def complete_snapshots(job_id: str, rank: int) -> List[SlotInfo]:
    """The complete, intact snapshots of ``rank`` on this node, newest first (storage serves otherwise)."""
    found = []
    for i in (0, 1):
        done = slotread.read_complete(shm.slot_path(job_id, rank, i))
        if done is not None:
            found.append(SlotInfo(i, done.step, done.generation, done.header.world_size, done.meta.layout))
    return sorted(found, key=lambda s: -s.step)


def read_snapshot(job_id: str, rank: int, slot_index: int, step: int) -> Dict[str, Any]:
    """Rebuild ``{relpath: tree}`` from a complete slot; tensors are copied out of shared memory so
    that nothing the trainer keeps aliases a slot it will overwrite later."""
    return read_slot_file(shm.slot_path(job_id, rank, slot_index), step)


def read_slot_file(path: str, step: int, check: Optional[Callable[[memoryview], None]] = None) -> Dict[str, Any]:
    """read_snapshot of the slot file at ``path``: a slot in /dev/shm, or its copy in the local tier. ``check``
    sees the whole mapping first and raises when it is not what it must be (a tier copy's checksum): one pass
    over the file's pages, which the tensors are then copied from."""
    slot = shm.Slot(path, writable=False, populate=check is not None)
    try:
        if check is not None:
            assert slot.mm is not None      # a file of the record's size (listing checked it) is mapped
            with memoryview(slot.mm) as whole:      # released even when check raises: the slot closes below
                check(whole)
        return read_slot(slot, step)
    finally:
        slot.close()


def read_slot(slot: shm.Slot, step: int) -> Dict[str, Any]:
    """``{relpath: tree}`` of the open ``slot`` once it passed slotread.check for ``step``, its tensors copied out (a
    slot in shared memory is reused by its writer; a moved slot's bytes, shm.Slot.of_bytes, are let go)."""
    done = slotread.check(slot, expect_step=step)
    with warnings.catch_warnings():   # the mapping is read-only and we only read through it
        warnings.simplefilter("ignore")
        base = torch.frombuffer(slot.mm, dtype=torch.uint8)
    trees = {}
    for f in done.meta.files:
        copies = [t.clone() for t in shardload.views(base, f.tensors)]
        trees[f.relpath] = rebuild(f.skeleton, {t.key: c for t, c in zip(f.tensors, copies)})
    del base
    slotread.ensure_unchanged(slot, done)
    return trees
