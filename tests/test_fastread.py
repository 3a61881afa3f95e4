"""Whole-file reads at the disk's speed (storage/fastread.py): parallel O_DIRECT reads into one aligned
buffer, checksummed in file order on the way. The bytes and the checksum equal a plain read's for files
that are not a multiple of the block size, of one chunk and of several; a file shorter than its size
says so; a file system that refuses O_DIRECT is read through the page cache."""
from __future__ import annotations

import os

import pytest

from easyckpt.formats import manifest as mf
from easyckpt.storage import fastread


def opener(path):
    return lambda extra: os.open(path, os.O_RDONLY | extra)


@pytest.mark.parametrize("size", [10, fastread.SMALL + 123, 2 * fastread.CHUNK + 4097])
def test_the_bytes_and_their_checksum_are_the_files(tmp_path, size):
    path = tmp_path / "f.bin"
    data = os.urandom(size)
    path.write_bytes(data)
    got = []
    buf, digest = fastread.read_hashed(opener(str(path)), size, on_bytes=got.append)
    assert bytes(buf) == data and digest == mf.checksum(data) and sum(got) == size


def test_the_read_buffer_is_faulted_in_ahead_and_the_thread_ends_with_the_read(tmp_path, monkeypatch):
    """A thread faults the buffer in ahead of the readers (a read into memory not yet faulted in first
    faults its whole request in the kernel, with nothing in flight meanwhile): it is given the whole
    buffer, and it has ended when the read returns (it holds the mapping while it runs)."""
    import threading

    from easyckpt import pages

    walked, real = [], pages.populate_write

    def recording(mm, stop=None):
        walked.append(len(mm))
        return real(mm, stop)

    monkeypatch.setattr(pages, "populate_write", recording)
    size = 2 * fastread.CHUNK + 4097
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    buf, digest = fastread.read_hashed(opener(str(path)), size)
    assert bytes(buf) == data and digest == mf.checksum(data)
    assert walked == [-(-size // 4096) * 4096]
    assert not [t for t in threading.enumerate() if t.name == "easyckpt-fault-ahead"]


def test_a_file_shorter_than_its_size_is_an_error(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(fastread.CHUNK + 10))
    with pytest.raises(OSError, match="shrank"):
        fastread.read_hashed(opener(str(path)), 2 * fastread.CHUNK, what="f.bin")


def test_without_o_direct_the_page_cache_serves(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(fastread.SMALL * 2)
    path.write_bytes(data)
    flags = []

    def refuse_direct(extra):
        flags.append(extra)
        if extra:
            raise OSError(22, "Invalid argument")
        return os.open(str(path), os.O_RDONLY)

    buf, digest = fastread.read_hashed(refuse_direct, len(data))
    assert bytes(buf) == data and digest == mf.checksum(data) and flags == [os.O_DIRECT, 0]


def test_a_read_that_stops_delivering_is_given_up_with_what_it_waited_for(tmp_path, monkeypatch):
    """A hung file system (a network mount that stopped answering): the caller is not kept waiting for
    ever; it hears which bytes of which file did not arrive. The stuck read is simulated by a chunk
    reader that blocks until the test ends."""
    import threading

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(2 * fastread.CHUNK))
    release = threading.Event()
    real = fastread._read_range

    def stuck(fd, view, start, end, what, room=-1):
        if start >= fastread.CHUNK:
            release.wait(30)
            return
        real(fd, view, start, end, what, room)

    monkeypatch.setattr(fastread, "_read_range", stuck)
    monkeypatch.setattr(fastread, "STALL", 0.5)
    try:
        with pytest.raises(OSError, match=rf"f.bin: no data arrived for 0.5 s reading bytes {fastread.CHUNK}\.\."):
            fastread.read_hashed(opener(str(path)), 2 * fastread.CHUNK, what="f.bin")
    finally:
        release.set()
