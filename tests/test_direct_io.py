"""The O_DIRECT writer (storage/direct.py): the file holds exactly the bytes given, whatever mix of
buffered and zero-copy writes, phases and sizes, on a file system that takes O_DIRECT and on one that
refuses it."""
from __future__ import annotations

import mmap
import os
import random

import pytest

from easyckpt.formats.shardfile import BLOCK
from easyckpt.storage import direct
from easyckpt.storage.direct import BOUNCE, SequentialWriter


def _supports_direct(directory: str) -> bool:
    probe = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _source(nbytes: int, seed: int) -> mmap.mmap:
    mm = mmap.mmap(-1, nbytes)    # page-aligned, like a snapshot slot
    mm[:] = random.Random(seed).randbytes(nbytes)
    return mm


def _write_mix(path: str, src: mmap.mmap, seed: int, direct: bool = True, block: int = BLOCK):
    """Random pieces: small buffered writes, then mapped ranges of random phase and length."""
    rng = random.Random(seed)
    expected = bytearray()
    view = memoryview(src)
    with SequentialWriter(path, direct=direct) as out:
        for _ in range(12):
            if rng.random() < 0.4:
                data = rng.randbytes(rng.choice([1, 7, 100, BLOCK - 8, BLOCK + 3, BOUNCE + 5]))
                out.write(data)
                expected += data
            else:
                # half the ranges share the file's phase (the zero-copy path), half do not
                start = rng.randrange(0, len(src) // 2)
                if rng.random() < 0.5:
                    start -= (start - out.size) % block
                    start += block if start < 0 else 0
                end = min(len(src), start + rng.choice([0, 5, BLOCK, 3 * BLOCK + 17, BOUNCE * 2 + 999]))
                out.write_mapped(view, start, end)
                expected += src[start:end]
        out.finish()
        used_direct = out.direct
        assert out.size == len(expected)
    view.release()
    return bytes(expected), used_direct


@pytest.mark.parametrize("seed", range(6))
def test_the_file_holds_exactly_the_bytes_given_with_o_direct(tmp_path, seed):
    if not _supports_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT: the zero-copy path cannot be exercised here")
    src = _source(24 << 20, seed)
    path = str(tmp_path / "f.bin")
    expected, used_direct = _write_mix(path, src, seed)
    src.close()
    assert used_direct, "the writer fell back to plain writes on a file system that takes O_DIRECT"
    with open(path, "rb") as f:
        assert f.read() == expected
    assert os.path.getsize(path) == len(expected)   # the padded last block was cut off


def test_plain_writes_when_the_kernel_refuses_a_direct_write(tmp_path, monkeypatch):
    # file systems may take O_DIRECT at open and refuse the writes (a larger alignment, or none at
    # all): with the writer's block set to 8 bytes, the kernel refuses the misaligned O_DIRECT writes
    # for real (EINVAL) and the writer must go on with plain writes, losing no byte
    if not _supports_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT at open: no write to refuse")
    monkeypatch.setattr(direct, "BLOCK", 8)
    src = _source(4 << 20, 99)
    expected, used_direct = _write_mix(str(tmp_path / "f.bin"), src, 99, block=8)
    src.close()
    assert not used_direct, "no direct write was refused: the test did not reach the fallback"
    assert (tmp_path / "f.bin").read_bytes() == expected


def test_direct_io_off_writes_plainly(tmp_path):
    src = _source(4 << 20, 7)
    expected, used_direct = _write_mix(str(tmp_path / "f.bin"), src, 7, direct=False)
    src.close()
    assert not used_direct
    assert (tmp_path / "f.bin").read_bytes() == expected


def test_an_existing_file_is_never_overwritten(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        SequentialWriter(str(tmp_path / "f.bin"))
    assert (tmp_path / "f.bin").read_bytes() == b"keep"


_WRITE_PAST_LIMIT = r"""
import errno, mmap, resource, signal, sys
from easyckpt.storage.direct import SequentialWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # past the limit, write() fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
src = mmap.mmap(-1, 4 << 20)
for how in ("bounce", "mapped"):
    try:
        with SequentialWriter(f"{sys.argv[1]}/{how}.bin") as out:
            with memoryview(src) as view:
                if how == "bounce":
                    out.write(view[:len(view) - 100])
                else:
                    out.write(b"header")
                    out.write_mapped(view, 6, len(view))
            out.finish()
    except OSError as exc:
        assert exc.errno == errno.EFBIG, exc
        print(how, "EFBIG")
"""


def test_a_failed_write_reports_its_own_error(tmp_path):
    """ENOSPC or EIO mid-file must reach the caller as itself: a failed write leaves views of the bounce
    buffer alive in its traceback, and closing the writer must not turn that into a BufferError."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _WRITE_PAST_LIMIT, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bounce", "EFBIG", "mapped", "EFBIG"]
