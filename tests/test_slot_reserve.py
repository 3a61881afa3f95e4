"""A slot's memory is reserved by faulting its pages in for writing (ipc/shm.py, pages.py): where /dev/shm has
no room for a page, that is a ShmCapacityError before anything is copied, never a SIGBUS in the middle of a copy
(docs/reliability.md promise 6), and nothing the slot held before is lost. Here /dev/shm is a small tmpfs of
its own and its free space is made to look larger than it is: another process filled it between easyckpt's
check and its reservation. A SIGBUS would end the test process; these tests see errors."""
from __future__ import annotations

import mmap
import os
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

from test_slot_prepare import _resident_bytes

from easyckpt import pages
from easyckpt.engine.save.snapshot import ShardSpec, Snapshotter
from easyckpt.errors import ShmCapacityError
from easyckpt.ipc import shm

MiB = 1 << 20
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a small tmpfs standing in for /dev/shm needs root "
                                                          "(CI runs as root)")


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An 8 MiB tmpfs as /dev/shm, whose free space easyckpt's checks see as 1 GiB."""
    where = tmp_path / "tiny"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(where)], check=True, timeout=30)
    monkeypatch.setattr(shm, "SHM_DIR", str(where))
    monkeypatch.setattr(shm, "free_bytes", lambda: 1 << 30)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], timeout=30).returncode:
            subprocess.run(["umount", "--lazy", str(where)], check=True, timeout=30)   # never leave it mounted
            raise AssertionError(f"{where} was still in use: something kept a slot in it mapped")


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def _free(where: Path) -> int:
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize


def _reserving() -> None:
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        if pages.populate_errno(mm, 0, mmap.PAGESIZE) in pages.UNSUPPORTED:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (before Linux 5.14): posix_fallocate reserves slots")
    finally:
        mm.close()


@needs_root
def test_no_room_for_a_new_slot_is_a_clear_error_and_nothing_is_left(tiny, monkeypatch):
    _reserving()
    path = tiny / f"easyckpt-{uuid.uuid4().hex[:12]}-r00000-s0"
    for threads in (1, 2):
        with pytest.raises(ShmCapacityError, match=r"cannot reserve 16.0 MiB .*snapshot slot .*--shm-size"):
            shm.Slot.create_or_grow(str(path), 16 * MiB, threads=threads)
        assert not path.exists() and _free(tiny) == 8 * MiB      # the pages it got are given back


@needs_root
def test_no_room_to_grow_a_slot_keeps_it_at_its_old_size_with_its_snapshot(tiny, monkeypatch):
    _reserving()
    path = tiny / f"easyckpt-{uuid.uuid4().hex[:12]}-r00000-s0"
    slot = shm.Slot.create_or_grow(str(path), 2 * MiB)
    data = bytes(range(256)) * 16
    slot.mm[shm.HEADER_BYTES:shm.HEADER_BYTES + len(data)] = data
    slot.publish(shm.Header(state=shm.COMPLETE, step=7, generation=1, meta_len=2, meta_capacity=2 * MiB - 8192,
                            data_capacity=4096, persist=False, meta_crc=0, pid=0, rank=0, world_size=1), b"{}")
    slot.close()
    with pytest.raises(ShmCapacityError, match="cannot reserve"):
        shm.Slot.create_or_grow(str(path), 16 * MiB)
    assert os.path.getsize(path) == 2 * MiB
    kept = shm.Slot(str(path), writable=False)
    try:
        assert kept.read_header().step == 7 and bytes(kept.mm[shm.HEADER_BYTES:shm.HEADER_BYTES + len(data)]) == data
    finally:
        kept.close()
        os.unlink(path)


@needs_root
def test_a_slot_a_killed_process_left_half_reserved_is_refused_before_it_is_written(tiny, monkeypatch):
    """A trainer killed while it reserved a slot leaves a file of the full size whose later pages were never
    allocated. Opened for writing again (a restarted trainer, the agent receiving a replica), it is reserved
    again first: with no room, a clear error instead of a SIGBUS at the first copy; the file is left as it is."""
    _reserving()
    path = tiny / f"easyckpt-{uuid.uuid4().hex[:12]}-r00000-s0"
    half = shm.Slot.create_or_grow(str(path), 16 * MiB, reserve=False)      # the header's page only
    half.close()
    assert os.path.getsize(path) == 16 * MiB and _allocated(path) < 8 * MiB
    with pytest.raises(ShmCapacityError, match="cannot reserve"):
        shm.Slot(str(path), writable=True, populate=True)
    assert os.path.getsize(path) == 16 * MiB
    os.unlink(path)


@needs_root
def test_a_snapshot_with_no_room_left_for_its_slot_fails_clearly_and_leaves_nothing(tiny, monkeypatch):
    """The snapshotter's whole path: the slots prepared on a thread for an estimate /dev/shm seemed to have room
    for, the first snapshot then finishing the reservation itself: a ShmCapacityError from the snapshot, no slot
    left behind, the tmpfs as it was."""
    _reserving()
    snap = Snapshotter(uuid.uuid4().hex[:12], 0, 1)
    try:
        assert snap.prepare(10 * MiB) is None
        with pytest.raises(ShmCapacityError, match="cannot reserve"):
            snap.snapshot(1, [ShardSpec("model.safetensors", {"w": torch.ones(10 * MiB // 4)})], persist=False)
    finally:
        snap.close(unlink=True)
    assert os.listdir(tiny) == [] and _free(tiny) == 8 * MiB


def test_a_new_slot_is_reserved_to_its_last_page_on_several_threads(tmp_path):
    """Every page of a new slot is allocated before create_or_grow returns, split among the threads asked for
    (a size that is no whole number of pages, nor of pieces)."""
    path = Path(shm.SHM_DIR) / f"easyckpt-t{uuid.uuid4().hex[:10]}-reserve"
    size = 3 * MiB + 5 * 4096 + 100
    slot = shm.Slot.create_or_grow(str(path), size, threads=3)
    try:
        assert slot.pages_reserved and _allocated(path) >= size
    finally:
        slot.close()
        os.unlink(path)


def test_prepared_slots_are_reserved_to_their_last_page_once_the_first_snapshot_takes_them(tmp_path):
    snap = Snapshotter(f"t{uuid.uuid4().hex[:10]}", 0, 1)
    try:
        snap.prepare(4 * MiB)
        assert snap.snapshot(1, [ShardSpec("model.safetensors", {"w": torch.ones(MiB)})], persist=False) is not None
        first = snap.slots[0]        # faulted in by the snapshot's own threads: the copy found every page mapped
        assert first is not None and first.pages_reserved and _resident_bytes(first.path) >= first.size
        snap.wait_prepared()
        assert all(s is not None and s.pages_reserved and _allocated(Path(s.path)) >= s.size for s in snap.slots)
    finally:
        snap.close(unlink=True)


def test_parallel_faulting_in_covers_every_piece_once(monkeypatch):
    """populate_parallel's parts: page-aligned, back to back from start to end, each walked in pieces."""
    calls = []
    libc = pages._libc()

    class Counting:
        def madvise(self, addr, length, advice):
            calls.append((addr.value, length.value))
            return libc.madvise(addr, length, advice)

    monkeypatch.setattr(pages, "POPULATE_CHUNK", 64 << 10)
    monkeypatch.setattr(pages, "_libc", lambda: Counting())
    mm = mmap.mmap(-1, MiB + 3 * 4096)
    try:
        err = pages.populate_parallel(mm, 4096, len(mm), 3)
        if err in pages.UNSUPPORTED:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (before Linux 5.14)")
        assert err == 0
        base = min(a for a, _ in calls) - 4096
        spans = sorted((a - base, a - base + n) for a, n in calls)
        assert spans[0][0] == 4096 and spans[-1][1] == len(mm)
        assert all(a == b for (_, a), (b, _) in zip(spans, spans[1:])), spans
        assert all(a % mmap.PAGESIZE == 0 for a, _ in spans)
    finally:
        mm.close()
