"""Snapshot slots reserved ahead of the first snapshot (Snapshotter.prepare, right after the load):
a thread allocates and maps both slots for the adapter's estimate of its state, the first snapshot then
uses them as they are; an estimate /dev/shm has no room for prepares nothing (the first snapshot's own
check speaks); and the estimate of an optimizer that has not stepped yet counts the moments its first
step creates. Sizes and identities are checked, never times."""
from __future__ import annotations

import os
import uuid

import pytest
import torch
from harness import SHM, wait_no_agent

import easyckpt
from easyckpt import pages
from easyckpt.engine.save import estimate
from easyckpt.engine.save.snapshot import ShardSpec, Snapshotter
from easyckpt.ipc import shm


def state(n: int = 1 << 16):
    return [ShardSpec("model.safetensors", {"w": torch.arange(n, dtype=torch.float32)})]


def test_prepared_slots_are_the_ones_the_first_snapshot_writes(tmp_path):
    snap = Snapshotter(f"t{uuid.uuid4().hex[:10]}", 0, 1)
    try:
        snap.prepare(4 << 18)            # 1 MiB of tensors, more than the state's 256 KiB
        snap.wait_prepared()
        prepared = list(snap.slots)
        assert all(s is not None and s.size >= shm.slot_size(4 << 18, 0) for s in prepared)
        result = snap.snapshot(1, state(), persist=False)
        assert result is not None and result.step == 1
        assert snap.slots == prepared and [os.path.getsize(p) for p in snap.paths] == [s.size for s in prepared]
    finally:
        snap.close(unlink=True)


def test_a_state_larger_than_the_estimate_grows_the_prepared_slots(tmp_path):
    snap = Snapshotter(f"t{uuid.uuid4().hex[:10]}", 0, 1)
    try:
        snap.prepare(1 << 10)       # its slots: 1 KiB of tensors and the 1 MiB of metadata room
        result = snap.snapshot(1, state(1 << 20), persist=False)      # 4 MiB: more than either holds
        assert result is not None
        assert all(os.path.getsize(p) >= shm.HEADER_BYTES + (4 << 20) for p in snap.paths)
    finally:
        snap.close(unlink=True)


def test_an_estimate_that_does_not_fit_in_dev_shm_prepares_nothing():
    snap = Snapshotter(f"t{uuid.uuid4().hex[:10]}", 0, 1)
    try:
        snap.prepare(shm.free_bytes() + (1 << 30))
        snap.wait_prepared()
        assert snap.slots == [None, None] and not any(os.path.exists(p) for p in snap.paths)
        assert snap.snapshot(1, state(), persist=False) is not None     # the first snapshot allocates
    finally:
        snap.close(unlink=True)


def test_the_estimate_of_adam_before_its_first_step_is_its_state_after_it():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4).to(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = estimate.optimizer_bytes(opt)
    assert before > 0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert estimate.optimizer_bytes(opt) == before == estimate.tensor_bytes(opt.state_dict()["state"])
    assert estimate.optimizer_bytes(torch.optim.SGD(model.parameters(), lr=0.1)) == 0   # no state to come


def test_load_checkpoint_reserves_the_slots_before_the_first_save(tmp_path):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    easyckpt.initialize_easyckpt(str(tmp_path / "ckpt"), save_mem_interval=1, save_storage_interval=100,
                                 log_file_path=str(tmp_path / "audit.jsonl"), agent_idle_timeout=1)
    try:
        assert easyckpt.load_checkpoint(model, opt) == (0, None)
        from easyckpt.pytorch import _default
        snap = _default.require().engine.snapshotter
        snap.wait_prepared()
        sizes = [os.path.getsize(p) for p in snap.paths]
        assert all(n >= shm.HEADER_BYTES + 3 * 256 * 257 * 4 for n in sizes), sizes   # params + 2 moments
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        easyckpt.save_checkpoint_if_needed(1, model, opt)
        assert [os.path.getsize(p) for p in snap.paths] == sizes        # written as prepared, not grown
    finally:
        easyckpt.finalize_easyckpt()
    wait_no_agent(tmp_path / "ckpt")


def test_the_first_snapshot_takes_the_first_slot_while_the_second_is_still_being_prepared(monkeypatch):
    """The first snapshot needs one slot: it does not wait for the second (fresh memory is slow to come by
    on some machines, and the first iteration would pay for both). A later snapshot for memory alone waits
    a little for the second slot, then is skipped, saying why, and the first slot keeps step 1; one to be
    persisted waits for the second slot and writes it, so step 1 is still in memory while it is written."""
    import threading

    from easyckpt.engine.save import snapshot as snapshot_mod

    snap = Snapshotter(f"t{uuid.uuid4().hex[:10]}", 0, 1)
    release, real = threading.Event(), shm.Slot.create_or_grow

    def slow_second(path, size, **how):
        if path == snap.paths[1]:
            assert release.wait(30), "the test never released the second slot"
        return real(path, size, **how)

    monkeypatch.setattr(shm.Slot, "create_or_grow", staticmethod(slow_second))
    monkeypatch.setattr(snapshot_mod, "SECOND_SLOT_WAIT", 0.05)
    try:
        snap.prepare(4 << 18)
        first = snap.snapshot(1, state(), persist=False)
        assert first is not None and first.slot == 0 and snap.skipped is None
        assert snap.slots[1] is None and not release.is_set()       # taken before the second was ready
        assert snap.snapshot(2, state(), persist=False) is None     # memory only: skipped, not waited for
        assert "second snapshot slot is still being prepared" in snap.skipped
        assert snap.slots[1] is None and snap.slots[0].read_header().step == 1
        threading.Timer(0.2, release.set).start()
        third = snap.snapshot(3, state(), persist=True)             # to be persisted: waits for the slot
        assert release.is_set() and snap.skipped is None
        assert third is not None and third.slot == 1 and snap.slots[1] is not None
        assert snap.slots[0].read_header().step == 1 and snap.slots[1].read_header().step == 3
        assert snap.snapshot(4, state(), persist=False).slot == 0    # both ready: alternating again
    finally:
        release.set()
        snap.close(unlink=True)


def test_a_skipped_snapshot_is_logged_with_its_reason(tmp_path, monkeypatch):
    """The engine's log says which snapshot was skipped and why (the second slot, not storage)."""
    import json
    import threading

    from easyckpt.config import Config
    from easyckpt.engine.save import snapshot as snapshot_mod
    from easyckpt.engine.session import Engine

    release, real = threading.Event(), shm.Slot.create_or_grow
    monkeypatch.setattr(snapshot_mod, "SECOND_SLOT_WAIT", 0.05)
    log = tmp_path / "audit.jsonl"
    engine = Engine(Config(save_dir=str(tmp_path / "ckpt"), save_mem_interval=1, save_storage_interval=100,
                           log_file_path=str(log), autocheckpoint_on_sigterm=False, agent_idle_timeout=1))

    def slow_second(path, size, **how):
        if path == engine.snapshotter.paths[1]:
            assert release.wait(30), "the test never released the second slot"
        return real(path, size, **how)

    monkeypatch.setattr(shm.Slot, "create_or_grow", staticmethod(slow_second))
    try:
        engine.prepare(4 << 18)
        assert engine.maybe_save(1, state).step == 1
        assert engine.maybe_save(2, state) is None
    finally:
        release.set()
        engine.finalize(persist=False)
    wait_no_agent(tmp_path / "ckpt")
    skips = [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == "skip"]
    assert [(e["step"], e["behind"]) for e in skips] == [(2, 1)], skips
    assert "second snapshot slot is still being prepared" in skips[0]["message"], skips


def _resident_bytes(path: str) -> int:
    """Bytes of this process's mappings of ``path`` that are in its page tables (/proc/self/smaps Rss)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:          # a mapping's first line: range, perms, ..., path
                inside = len(head) >= 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


def test_a_slot_is_faulted_in_piece_by_piece_to_its_last_page(monkeypatch):
    """Populated in POPULATE_CHUNK pieces (one call over a whole slot held the mmap lock through it and
    stalled the training thread's allocations); every page is mapped, the last, partial piece included."""
    if not pages.sys.platform.startswith("linux") or not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs Linux's /proc/self/smaps to see which pages are mapped")
    calls = []
    libc = pages._libc()

    class Counting:
        def madvise(self, addr, length, advice):
            rc = libc.madvise(addr, length, advice)
            calls.append((length.value, rc))
            return rc

    monkeypatch.setattr(pages, "POPULATE_CHUNK", 64 << 10)
    monkeypatch.setattr(pages, "_libc", lambda: Counting())
    path = str(SHM / f"easyckpt-t{uuid.uuid4().hex[:10]}-piecewise")
    size = (1 << 20) + 3 * 4096 + 100                 # not a whole number of pieces, nor of pages
    slot = shm.Slot.create_or_grow(path, size)
    try:
        if not calls or calls[0][1] != 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (before Linux 5.14): MAP_POPULATE maps the slot")
        assert slot.size == size
        lengths = [n for n, _ in calls]
        assert sum(lengths) == size and max(lengths) == 64 << 10 and len(lengths) == -(-size // (64 << 10))
        assert _resident_bytes(path) == -(-size // 4096) * 4096
    finally:
        slot.close()
        os.unlink(path)


def test_faulting_in_stops_between_pieces_when_asked(monkeypatch):
    """populate_write asks ``stop`` before each piece (a restore's fault-ahead thread ends with the read)."""
    import mmap

    calls = []
    libc = pages._libc()

    class Counting:
        def madvise(self, addr, length, advice):
            rc = libc.madvise(addr, length, advice)
            calls.append(rc)
            return rc

    monkeypatch.setattr(pages, "POPULATE_CHUNK", 64 << 10)
    monkeypatch.setattr(pages, "_libc", lambda: Counting())
    mm = mmap.mmap(-1, 1 << 20)
    try:
        done = pages.populate_write(mm, stop=lambda: len(calls) >= 3)
        if calls and calls[0] != 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (before Linux 5.14)")
        assert done is True and len(calls) == 3            # of the 16 pieces
    finally:
        mm.close()
