"""Faulting the pages of a writable mapping in ahead of a transfer that writes it whole: a snapshot slot
(ipc/shm.py) or a restore's read buffer (storage/fastread.py). Neither process- nor storage-specific.

On a file in tmpfs (/dev/shm) faulting a page in for writing is also what allocates it: MADV_POPULATE_WRITE
then reserves the file's memory, and where there is no room for a page it fails with EFAULT, where a write
to that page would have raised SIGBUS. ipc/shm.py reserves slots that way (docs/reliability.md promise 6).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import sys
import threading
from typing import Callable, List, Optional, Tuple

_MADV_POPULATE_WRITE = 23      # linux/mman.h, since Linux 5.14
POPULATE_CHUNK = 64 << 20      # bytes faulted in per call (populate_write says why)
# what the kernel answers where it has no MADV_POPULATE_WRITE (before 5.14, or not Linux): the caller's fallback
UNSUPPORTED = (errno.EINVAL, errno.ENOSYS)


def populate_write(mm: mmap.mmap, stop: Optional[Callable[[], bool]] = None) -> bool:
    """Fault every page of a writable mapping (a slot, or a restore's read buffer) in for writing, front
    to back. Through ctypes, which releases the GIL for the call (mmap.madvise holds it: seconds at a few
    GB). False where the kernel refuses it. ``stop``: asked between pieces; True ends the walk early.

    In POPULATE_CHUNK pieces: the kernel holds the process's mmap lock for reading through one call, so
    one call over a whole slot made the training thread's every mmap/munmap (a new tensor, a freed one)
    wait for all of it. Measured here, eight 256 MB tensors allocated, filled and freed while a 3 GB slot
    was prepared: 2.7-4.6 s with one call, 1.3-2.3 s with 64 MiB pieces, 0.8 s with no slot prepared."""
    return populate_pieces(mm, 0, len(mm), stop)[1] == 0


def populate_pieces(mm: mmap.mmap, start: int, end: int,
                    stop: Optional[Callable[[], bool]] = None) -> Tuple[int, int]:
    """populate_write of ``[start, end)`` (``start`` a multiple of the page size): (the offset it got to, 0 or
    the errno that ended it). ``stop`` ends it between pieces, with no error."""
    off = start
    while off < end:
        if stop is not None and stop():
            break
        n = min(POPULATE_CHUNK, end - off)
        err = populate_errno(mm, off, n)
        if err:
            return off, err
        off += n
    return off, 0


def populate_parallel(mm: mmap.mmap, start: int, end: int, threads: int) -> int:
    """populate_pieces of ``[start, end)`` split in ``threads`` parts, each walked by a thread of its own (this one
    among them): 0 or the first errno. The kernel hands out and zeroes the fresh pages of a tmpfs file on every
    walking thread's core at once (ipc/shm.py's Slot.reserve has the figures)."""
    page = mmap.PAGESIZE
    part = -(-(end - start) // max(1, threads) // page) * page or page
    bounds = [(a, min(a + part, end)) for a in range(start, end, part)]
    errors: List[int] = [0] * len(bounds)

    def walk(i: int) -> None:
        errors[i] = populate_pieces(mm, *bounds[i])[1]
    helpers = [threading.Thread(target=walk, args=(i,), daemon=True, name="easyckpt-reserve")
               for i in range(1, len(bounds))]
    for t in helpers:
        t.start()
    if bounds:
        walk(0)
    for t in helpers:
        t.join()      # bounded: each walks a fixed range, a system call per piece
    return next((e for e in errors if e), 0)


def populate_range(mm: mmap.mmap, start: int, length: int) -> bool:
    """Fault the pages of ``mm`` from ``start`` (a multiple of the page size) for ``length`` bytes in for
    writing, in one call that releases the GIL: a piece of a buffer, by the thread that is about to fill it.
    False where the kernel refuses it (the pages then fault in as they are written)."""
    return populate_errno(mm, start, length) == 0


def populate_errno(mm: mmap.mmap, start: int, length: int) -> int:
    """populate_range's call: 0, or the errno it failed with (EFAULT: no room for a page of a tmpfs file;
    one of UNSUPPORTED where the kernel has no MADV_POPULATE_WRITE)."""
    if not length:
        return 0
    if not sys.platform.startswith("linux"):
        return errno.ENOSYS
    buf = ctypes.c_char.from_buffer(mm)
    try:
        if _libc().madvise(ctypes.c_void_p(ctypes.addressof(buf) + start), ctypes.c_size_t(length),
                           _MADV_POPULATE_WRITE) == 0:
            return 0
        return ctypes.get_errno() or errno.EINVAL
    finally:
        del buf           # the buffer export, or mm.close() would refuse


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
