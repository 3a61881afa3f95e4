"""A sequential file writer that bypasses the page cache (O_DIRECT) and falls back to plain writes.

Why: a buffered write first copies every byte into the page cache, and its speed is then set by how
fast the kernel finds free pages, not by the disk. On the 2-core VMs this project runs on, 1 GB of
sendfile + fsync took 0.55–1.4 s from one run to the next, while O_DIRECT writes of the same bytes
straight from the snapshot's shared memory took a steady 0.27 s (3.7 GB/s). O_DIRECT also spends no
CPU on that copy and leaves the training's page cache alone.

O_DIRECT wants the file offset, the memory address and the length aligned to the device's logical
block. ``write_mapped`` sends bytes of a page-aligned mapping to the disk without a copy when the
file position and the mapping offset have the same phase (the shard format pads its header so they
do); every other byte goes through a small aligned bounce buffer. The last partial block is written
padded and the file truncated to its true size. File systems that refuse O_DIRECT (tmpfs, some FUSE
and network mounts) get plain writes, with the same bytes in the file.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
from typing import Optional

from easyckpt.formats.shardfile import BLOCK
from easyckpt.storage.base import Buffer

BOUNCE = 8 << 20        # bytes of the bounce buffer: big enough that each write keeps the disk busy
DIRECT_CHUNK = 64 << 20  # bytes per O_DIRECT write straight from a mapping

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class SequentialWriter:
    """Writes one new file front to back (storage.base.Writer). ``finish()`` must be called; ``sync()``
    (fsync) stays the caller's, so that it can sync many files after writing them all."""

    def __init__(self, path: str, direct: bool = True, mode: int = 0o644):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        self.direct = bool(direct and _O_DIRECT)
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(path, flags | _O_DIRECT, mode)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd < 0:
            self.fd = os.open(path, flags, mode)
        self.size = 0            # bytes given so far: the file's final size
        self._on_disk = 0        # bytes already written; a multiple of BLOCK while direct
        self._buf: Optional[mmap.mmap] = None
        self._fill = 0           # bytes waiting in the bounce buffer, which starts at _on_disk

    # ---- writing -------------------------------------------------------------------------------

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if not self.direct:
            self._pwrite_all(view, self.size)
            self._on_disk += n
        else:
            buf = self._bounce()
            while view:
                take = min(len(view), BOUNCE - self._fill)
                buf[self._fill:self._fill + take] = view[:take]
                self._fill += take
                view = view[take:]
                if self._fill == BOUNCE:
                    self._flush_bounce()
        self.size += n
        return n

    def write_mapped(self, view: memoryview, start: int, end: int) -> None:
        """Append ``view[start:end]``, where ``view`` covers a page-aligned mapping (mmap)."""
        if not self.direct or (self.size - start) % BLOCK:
            self.write(view[start:end])
            return
        head = min(end - start, -self.size % BLOCK)   # completes the bounce buffer's last block
        if head:
            self.write(view[start:start + head])
            start += head
        body = (end - start) // BLOCK * BLOCK
        if body:
            self._flush_bounce()
            pos = start
            while pos < start + body and self.direct:
                n = min(DIRECT_CHUNK, start + body - pos)
                self._pwrite_all(view[pos:pos + n], self._on_disk)
                self._on_disk += n
                self.size += n
                pos += n
            start = pos
        if start < end:
            self.write(view[start:end])

    def finish(self) -> None:
        """Write what is buffered (the last block padded with zeros, then cut to the true size)."""
        if self.direct and self._fill:
            padded = self._fill + (-self._fill % BLOCK)
            buf = self._bounce()
            buf[self._fill:padded] = bytes(padded - self._fill)
            with memoryview(buf) as mv:
                self._pwrite_all(mv[:padded], self._on_disk)
            self._on_disk += self._fill
            self._fill = 0
            os.ftruncate(self.fd, self.size)
        elif self._fill:
            self._flush_bounce()
        self._release()

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        self._release()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- internals -----------------------------------------------------------------------------

    def _bounce(self) -> mmap.mmap:
        if self._buf is None:
            self._buf = mmap.mmap(-1, BOUNCE)    # anonymous mappings are page-aligned
        return self._buf

    def _flush_bounce(self) -> None:
        """Write the bounce buffer; while direct it holds whole blocks except at ``finish``."""
        if self._fill:
            with memoryview(self._bounce()) as mv:
                self._pwrite_all(mv[:self._fill], self._on_disk)
            self._on_disk += self._fill
            self._fill = 0

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        while view:
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as exc:
                # a file system may accept O_DIRECT at open and refuse the first write (alignment
                # larger than BLOCK, or no support at all): go on with plain writes
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._go_buffered()
                continue
            if n == 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            view, offset = view[n:], offset + n

    def _go_buffered(self) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False

    def _release(self) -> None:
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:
                # a failed write leaves views of the buffer in its traceback's frames; closing now
                # would replace the real error (ENOSPC, EIO) with this one. The mapping goes with them.
                pass
            self._buf = None

    def __enter__(self) -> "SequentialWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
