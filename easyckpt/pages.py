"""Faulting the pages of a writable mapping in ahead of a transfer that writes it whole: a snapshot slot
(ipc/shm.py) or a restore's read buffer (storage/fastread.py). Neither process- nor storage-specific."""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Callable, Optional

_MADV_POPULATE_WRITE = 23      # linux/mman.h, since Linux 5.14
POPULATE_CHUNK = 64 << 20      # bytes faulted in per call (populate_write says why)


def populate_write(mm: mmap.mmap, stop: Optional[Callable[[], bool]] = None) -> bool:
    """Fault every page of a writable mapping (a slot, or a restore's read buffer) in for writing, front
    to back. Through ctypes, which releases the GIL for the call (mmap.madvise holds it: seconds at a few
    GB). False where the kernel refuses it. ``stop``: asked between pieces; True ends the walk early.

    In POPULATE_CHUNK pieces: the kernel holds the process's mmap lock for reading through one call, so
    one call over a whole slot made the training thread's every mmap/munmap (a new tensor, a freed one)
    wait for all of it. Measured here, eight 256 MB tensors allocated, filled and freed while a 3 GB slot
    was prepared: 2.7-4.6 s with one call, 1.3-2.3 s with 64 MiB pieces, 0.8 s with no slot prepared."""
    for off in range(0, len(mm), POPULATE_CHUNK):
        if stop is not None and stop():
            return True
        if not populate_range(mm, off, min(POPULATE_CHUNK, len(mm) - off)):
            return False
    return True


def populate_range(mm: mmap.mmap, start: int, length: int) -> bool:
    """Fault the pages of ``mm`` from ``start`` (a multiple of the page size) for ``length`` bytes in for
    writing, in one call that releases the GIL: a piece of a buffer, by the thread that is about to fill it.
    False where the kernel refuses it (the pages then fault in as they are written)."""
    if not sys.platform.startswith("linux") or not length:
        return not length
    buf = ctypes.c_char.from_buffer(mm)
    try:
        return _libc().madvise(ctypes.c_void_p(ctypes.addressof(buf) + start), ctypes.c_size_t(length),
                               _MADV_POPULATE_WRITE) == 0
    finally:
        del buf           # the buffer export, or mm.close() would refuse


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
