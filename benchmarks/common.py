"""Pieces shared by the benchmarks: a synthetic training state, the hardware floors (a raw copy into
a warm buffer, a raw sequential write + fsync) and the discipline every disk measurement follows.

GB means 10**9 bytes everywhere in the benchmarks.
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

GB = 10**9
WRITE_CHUNK = 8 << 20  # bytes per os.write of the raw write
DIRECT_CHUNK = 64 << 20  # bytes per O_DIRECT write of the raw direct write


# Relative sizes of the model's parameters: a few big matrices of different shapes and one small
# vector, like a real network, so that the snapshot handles mixed sizes rather than one blob.
_PARAM_SHARES: List[Tuple[str, float, int]] = [
    # (name, share of the parameter bytes, row length)
    ("embed.weight", 0.30, 1024),
    ("block0.attn.weight", 0.25, 3072),
    ("block0.mlp.weight", 0.25, 4096),
    ("head.weight", 0.199, 1024),
    ("head.bias", 0.001, 0),          # 0: a 1-D tensor
]


# ---- the state -------------------------------------------------------------------------------

def build_state(gb: float) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """A model dict and an optimizer-state dict (Adam layout) whose tensors sum to ``gb`` GB.

    The optimizer holds exp_avg and exp_avg_sq for every parameter, so the parameters themselves
    are a third of the bytes. Tensors are filled with random values so every page is really
    backed (torch.empty / zeros could leave untouched pages, which copy far faster than real data).
    """
    param_elems = gb * GB / 4 / 3
    gen = torch.Generator().manual_seed(0)
    model: Dict[str, torch.Tensor] = {}
    for name, share, row in _PARAM_SHARES:
        n = max(1, int(param_elems * share))
        shape = (n,) if row == 0 else (max(1, n // row), row)
        model[name] = torch.empty(shape, dtype=torch.float32).uniform_(generator=gen)
    state = {
        name: {"step": 1000,
               "exp_avg": torch.empty_like(p).uniform_(generator=gen),
               "exp_avg_sq": torch.empty_like(p).uniform_(generator=gen)}
        for name, p in model.items()
    }
    optimizer = {"state": state,
                 "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                   "params": list(model)}]}
    return model, optimizer


def all_tensors(model: Dict[str, torch.Tensor], optimizer: Dict[str, Any]) -> List[torch.Tensor]:
    tensors = list(model.values())
    for entry in optimizer["state"].values():
        tensors += [entry["exp_avg"], entry["exp_avg_sq"]]
    return tensors


def nbytes_of(tensors: List[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def raw_copy(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    # the same per-tensor copy_ the snapshot does, minus slots, layout and header
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def raw_write(path: str, tensors: List[torch.Tensor]) -> int:
    """Sequential os.write of the tensor bytes into one file, then fsync: the disk's floor.

    Written in WRITE_CHUNK pieces: on the test VM one write() of a whole 100 MB tensor was
    erratically 3-10x slower than the same bytes in 8 MiB calls, and the floor should be the
    best a plain writer gets, not an artefact of call size.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    total = 0
    try:
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")   # no copy: the tensor's own memory
            while view:
                n = os.write(fd, view[:WRITE_CHUNK])
                view = view[n:]
                total += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def direct_buffer() -> mmap.mmap:
    """The page-aligned source of ``raw_write_direct``, filled once outside the timed region with random
    bytes (so a compressing or deduplicating device gains nothing)."""
    buf = mmap.mmap(-1, DIRECT_CHUNK)      # anonymous mappings are page-aligned, as O_DIRECT needs
    buf[:] = np.random.default_rng(0).integers(0, 256, DIRECT_CHUNK, dtype=np.uint8).tobytes()
    return buf


def raw_write_direct(path: str, nbytes: int, buf: mmap.mmap) -> int:
    """``nbytes`` written with O_DIRECT from ``buf`` (``direct_buffer``) over and over, then fsync: the
    device's own limit, with no page cache in the way (the buffered raw write above also measures how
    fast the kernel finds free pages for the cache, which on these VMs swings 3x from run to run).
    Returns 0 where the file system refuses O_DIRECT (tmpfs on old kernels, some network mounts)."""
    if not hasattr(os, "O_DIRECT"):
        return 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:    # refused; anything else (ENOSPC, EACCES) is a real problem
            return 0
        raise
    total = 0
    try:
        with memoryview(buf) as view:
            while total < nbytes:
                n = min(len(view), nbytes - total) // 4096 * 4096   # O_DIRECT: whole blocks
                if n == 0:
                    break
                total += os.write(fd, view[:n])
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def raw_read_direct(path: str, buf: mmap.mmap) -> int:
    """Every file under ``path`` read with O_DIRECT into ``buf`` (``direct_buffer``), one sequential
    stream of whole-buffer requests, no checksum, nothing kept: the device's own read limit, no page
    cache in the way. Returns the bytes read, 0 where the file system refuses O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return 0
    paths = [path] if os.path.isfile(path) else sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    total = 0
    with memoryview(buf) as view:
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    return 0
                raise
            try:
                while True:
                    n = os.readv(fd, [view])
                    total += n
                    if n < len(view):
                        break
            finally:
                os.close(fd)
    return total


def alloc_copy(srcs: List[torch.Tensor]) -> List[torch.Tensor]:
    """A copy of ``srcs`` into newly allocated memory: what any restore from memory pays at least
    (the kernel hands out and zeroes every page first), however the bytes are laid out."""
    return [s.clone() for s in srcs]


def settle_disk() -> None:
    """Flush every dirty page before a disk measurement so it does not pay for the previous one.

    This also commits the unlink of the previous measurement's files, and with it the discards an
    ext4 mounted with ``-o discard`` issues for the freed blocks, outside the timed region.
    """
    os.sync()


def warm_free_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of anonymous memory and free it again, just before a disk measurement.

    Why: a file write first copies into page cache, so its speed depends on how fast the kernel
    gets free pages. On a VM with free page reporting (virtio-balloon, common in the cloud),
    pages that stayed free for ~2 s are handed back to the host, and touching them again costs a
    host fault each: a write then runs 3-5x slower depending only on how long the machine was idle
    before it, which would make the comparison a lottery. Faulting a pool in and unmapping it puts
    that many hot pages on the free lists, which the measured write reuses at once; every disk
    measurement (persist, raw write, torch.save) gets the same treatment, so the ratio stays fair,
    and on bare metal this is a no-op in effect.
    """
    pool = mmap.mmap(-1, nbytes)
    try:
        arr = np.frombuffer(pool, dtype=np.uint8)
        arr[::mmap.PAGESIZE] = 1   # one store per page faults it in
        del arr                    # drop the buffer export, or close() would refuse
    finally:
        pool.close()               # munmap: the pages go back to the kernel's free lists, hot


def timed_disk_op(fn: Callable[[], Any], pool_bytes: int) -> Tuple[float, Any]:
    """Time ``fn`` after putting the machine in the same state as for every other disk op."""
    settle_disk()
    warm_free_memory(pool_bytes)
    return timed(fn)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def evict(path: str) -> None:
    """Drop a file (or every file under a directory) from the page cache, so that a read measures the
    disk, as a restart on a fresh node would, not a copy out of cached pages. Works without root for
    clean pages: call it after the data was fsynced."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median(xs: List[float]) -> float:
    return statistics.median(xs)
