"""The snapshot slot format, in process: the one reader (ipc/slotread.py) accepts a complete slot and
rejects every way a slot can be incomplete, torn, damaged, hostile or planted, each with a result that
says why. Slots are written by hand through ipc/shm.py (no torch, no trainer), in a private
directory standing in for /dev/shm, so nothing here touches the real one.
"""
from __future__ import annotations

import json
import os
import struct

import pytest

from easyckpt.errors import CheckpointError, UntrustedFileError
from easyckpt.formats.slotmeta import BadSlotMeta
from easyckpt.ipc import shm, slotread

JOB = "5107f0a7ab1e"
DATA = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0) + struct.pack("<2q", 7, 8)


@pytest.fixture(autouse=True)
def shm_dir(tmp_path, monkeypatch):
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    monkeypatch.setattr(shm, "SHM_DIR", str(d))
    return d


def _files(w=(0, 16), n=(16, 32), end=None):
    """One shard: float tensor "w" then int tensor "n", at these offsets from the data region's start."""
    b = shm.HEADER_BYTES
    return [{"relpath": "model.safetensors", "persist": True, "fmt": "safetensors", "start": b + w[0],
             "end": b + (end if end is not None else n[1]),
             "tensors": [["w", "F32", [4], b + w[0], b + w[1]], ["n", "I64", [2], b + n[0], b + n[1]]]}]


def write_slot(step=5, generation=1, files=None, meta_step=None, slot=0) -> str:
    """Publish a snapshot as the trainer does: generation first, data, metadata, header, state last."""
    path = shm.slot_path(JOB, 0, slot)
    s = shm.Slot.create_or_grow(path, shm.HEADER_BYTES + len(DATA) + 4096)
    try:
        s.begin_write(generation)
        s.mm[shm.HEADER_BYTES:shm.HEADER_BYTES + len(DATA)] = DATA
        meta = json.dumps({"files": _files() if files is None else files,
                           "step": step if meta_step is None else meta_step,
                           "skeletons": {"model.safetensors": {"w": {"__t": "w"}, "n": {"__t": "n"}}},
                           "info": {"iteration": step}}).encode()
        hdr = shm.Header(state=shm.COMPLETE, step=step, generation=generation, meta_len=len(meta),
                         meta_capacity=s.size - shm.HEADER_BYTES - len(DATA), data_capacity=len(DATA),
                         persist=True, meta_crc=0, pid=0, rank=0, world_size=2)
        s.publish(hdr, meta)
    finally:
        s.close()
    return path


def poke(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def rejection(path: str, **expect) -> Exception:
    """What ``check`` raises for ``path``, after making sure ``read_complete`` says None for it."""
    if "expect_generation" not in expect:       # read_complete's callers expect a step, never a generation
        assert slotread.read_complete(path, expect.get("expect_step")) is None
    s = shm.Slot(path, writable=False)
    try:
        with pytest.raises((slotread.SlotNotComplete, BadSlotMeta)) as err:
            slotread.check(s, **expect)
    finally:
        s.close()
    return err.value


def test_a_complete_slot_is_read_with_its_header_and_checked_metadata():
    path = write_slot(step=5, generation=3)
    done = slotread.read_complete(path, expect_step=5)
    assert done is not None and done.step == 5 and done.generation == 3 and done.path == path
    assert done.header.world_size == 2 and done.header.data_capacity == len(DATA)
    assert [f.relpath for f in done.meta.files] == ["model.safetensors"]
    assert done.meta.info == {"iteration": 5}


def test_an_empty_slot_or_one_being_written_is_not_complete():
    path = shm.slot_path(JOB, 0, 0)
    shm.Slot.create_or_grow(path, shm.HEADER_BYTES + 4096).close()     # allocated, never published
    assert "no complete snapshot" in str(rejection(path))
    path = write_slot()
    s = shm.Slot(path, writable=True)
    s.begin_write(2)        # the trainer starts the next snapshot into this slot
    s.close()
    assert "no complete snapshot" in str(rejection(path))
    assert slotread.read_complete(shm.slot_path(JOB, 0, 1)) is None     # no file at all


def test_a_header_whose_checksum_does_not_match_is_torn():
    path = write_slot(step=5, generation=1)
    # a new generation and a COMPLETE state are in place, but the rest of the header (and its CRC) is the
    # old one: what a reader sees if the trainer died between those stores
    poke(path, 24, struct.pack("<Q", 2))
    poke(path, 12, struct.pack("<I", shm.COMPLETE))
    assert "torn header" in str(rejection(path))


def test_a_half_written_header_is_torn():
    old = write_slot(step=5, generation=1, slot=0)
    new = write_slot(step=6, generation=2, slot=1)
    with open(new, "rb") as f:
        first_half = f.read(44)
    poke(old, 0, first_half)         # step and generation of the new header, the rest of the old one
    assert "torn header" in str(rejection(old))
    assert slotread.read_complete(new) is not None


def test_a_generation_that_moves_on_between_header_and_metadata_is_refused(monkeypatch):
    path = write_slot(step=5, generation=1)
    writer = shm.Slot(path, writable=True)
    read_meta = shm.Slot.read_meta

    def meta_after_the_trainer_moved_on(self, hdr):
        writer.begin_write(2)        # the trainer starts overwriting the slot right after the header was read
        return read_meta(self, hdr)

    monkeypatch.setattr(shm.Slot, "read_meta", meta_after_the_trainer_moved_on)
    reader = shm.Slot(path, writable=False)
    try:
        with pytest.raises(slotread.SlotNotComplete, match="changed while it was read"):
            slotread.check(reader)
        assert slotread.read_complete(path) is None      # and it stays refused while being written
    finally:
        reader.close()
        writer.close()


def test_a_slot_that_changed_after_it_was_checked_fails_the_recheck():
    path = write_slot(step=5, generation=1)
    reader, writer = shm.Slot(path, writable=False), shm.Slot(path, writable=True)
    try:
        done = slotread.check(reader)
        slotread.ensure_unchanged(reader, done)         # nothing happened: fine
        writer.begin_write(2)
        with pytest.raises(slotread.SlotNotComplete, match="changed while it was read"):
            slotread.ensure_unchanged(reader, done)
    finally:
        reader.close()
        writer.close()


def test_a_slot_holding_another_step_or_generation_than_expected_is_refused():
    path = write_slot(step=5, generation=4)
    assert "holds step 5, not step 6" in str(rejection(path, expect_step=6))
    assert "no longer holds generation 3" in str(rejection(path, expect_generation=3))
    assert slotread.read_complete(path, expect_step=5) is not None


def test_metadata_that_does_not_match_its_checksum_is_refused():
    path = write_slot()
    s = shm.Slot(path, writable=False)
    hdr = s.read_header()
    s.close()
    poke(path, hdr.meta_offset + 2, b"X")
    err = rejection(path)
    assert isinstance(err, slotread.SlotNotComplete) and "checksum" in str(err)


@pytest.mark.parametrize("files, why", [
    (_files(w=(0, 16), n=(8, 24), end=24), "right after the previous one"),        # n overlaps w
    (_files(w=(0, 16), n=(16, 4096 + 32)), "outside the data region"),            # n runs into the metadata
    (_files(w=(0, 12), n=(12, 28)), "is not 4 x 4 bytes"),                         # w is one float short
])
def test_metadata_whose_tensors_overlap_or_leave_the_data_region_is_refused(files, why):
    err = rejection(write_slot(files=files))
    assert isinstance(err, BadSlotMeta) and why in str(err), err


def test_metadata_naming_another_step_than_its_header_is_refused():
    err = rejection(write_slot(step=5, meta_step=4))
    assert isinstance(err, BadSlotMeta) and "metadata step 4 != header step 5" in str(err)


def test_a_slot_open_to_other_users_is_untrusted():
    path = write_slot()
    os.chmod(path, 0o644)
    with pytest.raises(UntrustedFileError, match="mode 0600"):
        slotread.read_complete(path)


def test_a_symlink_in_place_of_a_slot_is_untrusted(tmp_path):
    target = write_slot(slot=0)
    os.symlink(target, shm.slot_path(JOB, 0, 1))
    with pytest.raises(UntrustedFileError, match="symlink"):
        slotread.read_complete(shm.slot_path(JOB, 0, 1))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user (chown) needs root")
def test_a_slot_of_another_user_is_untrusted():
    path = write_slot()
    os.chown(path, 65534, 65534)     # nobody
    with pytest.raises(UntrustedFileError, match="owned by uid 65534"):
        slotread.read_complete(path)


def test_a_rejected_slot_is_a_checkpoint_error_for_callers_that_raise_it():
    assert issubclass(slotread.SlotNotComplete, CheckpointError)


def test_the_trainers_loader_and_the_one_reader_agree(shm_dir):
    """The loader's list of complete snapshots is the one reader's answer (the agent's recovery, persist
    and `easyckpt status` call the same reader)."""
    from easyckpt.engine.save import snapshot
    write_slot(step=5, generation=1, slot=0)
    write_slot(step=6, generation=2, slot=1, files=_files(w=(0, 16), n=(8, 24), end=24))   # bad metadata
    assert [(s.slot, s.step) for s in snapshot.complete_snapshots(JOB, 0)] == [(0, 5)]
    assert slotread.read_complete(shm.slot_path(JOB, 0, 1)) is None
