"""Reading a step on an object store: stepfiles.py's verbs for a step prefix (``s3://bucket/.../step_N``).

stepfiles.py calls these when a step directory is a URL (resolve.remote), so the loader, the CLI and retention
read a step the same way wherever it lies. What differs from a file system:

- a listed name becomes a key only through ``paths.check_relpath`` (no ``..``, no absolute path, nothing
  but our own naming); there are no symlinks to refuse.
- a file is read by ranged GETs in parallel (``PIECE`` bytes each, the store's pool of threads) straight into
  one buffer, and checksummed piece by piece in order; items of a shared file are fetched alone, the same way.
- ownership is the bucket's policy, not a file mode: ``owner_problem`` has nothing to check.
- every object read is bounded: a manifest larger than MAX_MANIFEST_BYTES is refused before it is read whole.
"""
from __future__ import annotations

import mmap
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from easyckpt import pages
from easyckpt.errors import ManifestError, UnsafePath
from easyckpt.formats import manifest as mf
from easyckpt.formats import paths
from easyckpt.storage.s3 import S3Storage
from easyckpt.units import size_and_bytes

PIECE = 32 << 20         # one ranged GET; a file is fetched as many of these at once as the pool runs
_MAPPED = 1 << 20        # a file at least this large is read into an anonymous mapping (_room)


def key(step_dir: str, rel: str) -> str:
    """The URL of listed file ``rel`` of ``step_dir``; ManifestError when ``rel`` is not a plain relative path."""
    try:
        return step_dir.rstrip("/") + "/" + paths.check_relpath(rel)
    except UnsafePath as exc:
        raise ManifestError(f"{exc}; refusing to read it") from None


def load_raw(store: S3Storage, step_dir: str) -> bytes:
    """The manifest object's bytes; FileNotFoundError when there is none (not a checkpoint)."""
    url = step_dir.rstrip("/") + "/" + mf.MANIFEST_NAME
    size = store.size(url)
    if size > mf.MAX_MANIFEST_BYTES:
        raise ManifestError(f"{mf.MANIFEST_NAME} is larger than {size_and_bytes(mf.MAX_MANIFEST_BYTES)}")
    return store.read(url, 0, mf.MAX_MANIFEST_BYTES + 1)


def entry_size(store: S3Storage, step_dir: str, rel: str) -> int:
    return store.size(key(step_dir, rel))


def _room(size: int) -> Tuple[memoryview, Optional[mmap.mmap]]:
    """A writable buffer of ``size`` bytes for a file's ranged GETs, and its mapping when it is one. A bytearray
    zeroes every page first, one fault at a time (77 ms of the 240 ms a 144 MB file took from the local RGW);
    an anonymous mapping faulted by the threads that fill it as they write is slower still (they contend for
    the mapping); MAP_POPULATE makes the pages present in one call (about 49 ms), but before the first GET. So
    the mapping's pages are made present piece by piece, each by the thread about to fill it, beside the other
    pieces' transfers (_fill). Measured from the local RGW, a 144 MB and a 72 MB file read at once, seven fresh
    processes each, taken in turn: median 0.312 s against 0.348 s with MAP_POPULATE; the raw client's ranged GETs
    into fresh bytes 0.288 s (a probe, not kept; the whole restore's ratio is benchmarks/bench_s3_checkpoint.py's).
    pages.populate_range releases the GIL for the call, which mmap.madvise would hold."""
    if size < _MAPPED:
        return memoryview(bytearray(size)), None
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memoryview(mm), mm


def _fill(store: S3Storage, url: str, whole: memoryview, mm: Optional[mmap.mmap], off: int, n: int) -> int:
    """One piece of a file into its place in ``whole``: its pages made present first (pages.populate_range; where
    the kernel refuses, they fault in as the GET writes them), then one ranged GET."""
    if mm is not None:
        pages.populate_range(mm, off, n)
    return store.read_into(url, off, whole[off:off + n])


def _pieces(size: int) -> List[Tuple[int, int]]:
    return [(off, min(PIECE, size - off)) for off in range(0, size, PIECE)]


def read_whole(store: S3Storage, step_dir: str, rel: str, algo: Optional[str] = None,
               on_bytes: Optional[Callable[[int], None]] = None,
               expect: Optional[int] = None) -> Tuple[memoryview, Optional[str]]:
    """The whole of listed file ``rel`` (and its checksum when ``algo``): ranged GETs in parallel into one buffer.
    With ``expect`` (the manifest's size) an object of another size is refused (ManifestError) before the
    buffer is allocated."""
    url = key(step_dir, rel)
    size = store.size(url)
    mf.require_size(rel, size, expect)
    whole, mm = _room(size)
    h = mf.Hasher(algo) if algo else None
    # each piece straight from its socket into its place in the buffer, in the pool's threads; checksummed here
    # in order as they arrive
    futures = [(off, n, store.pool.submit(_fill, store, url, whole, mm, off, n)) for off, n in _pieces(size)]
    for off, n, fut in futures:
        got = fut.result()
        if got != n:     # every piece whole: an object replaced while read is not stitched together
            raise OSError(f"{rel} changed while being read: {got} bytes at offset {off}, asked {n}")
        if h is not None:
            h.update(whole[off:off + n])
        if on_bytes is not None:
            on_bytes(n)
    return whole, (h.hexdigest() if h is not None else None)


def read_items(store: S3Storage, step_dir: str, rel: str, manifest: mf.Manifest, picked: Sequence[int],
               on_bytes: Optional[Callable[[int], None]], keep: Optional[Dict[int, bytearray]]
               ) -> Tuple[Optional[str], int]:
    """stepfiles.read_items on the store: the picked items fetched in parallel, each checked alone."""
    url = key(step_dir, rel)
    items = manifest.entry(rel).items or ()
    for i in picked:
        if type(i) is not int or not 0 <= i < len(items):
            return f"{rel}: no item {i!r}", 0
    fetched = store.read_ranges(url, [(items[i].offset, items[i].length) for i in picked]) if picked else []
    nbytes = 0
    for i, data in zip(picked, fetched):
        offset, length, digest, ident = items[i]
        name = ident[0] if ident else "?"
        if len(data) != length:
            return f"{rel}: item {i} ({name}) cut short at byte {offset + len(data)}", nbytes
        nbytes += length
        if on_bytes is not None:
            on_bytes(length)
        got = mf.checksum(data, manifest.algo)
        if got != digest:
            return (f"{rel}: item {i} ({name}, bytes {offset}..{offset + length}) has checksum {got}, the manifest "
                    f"records {digest} ({manifest.algo}): corrupted"), nbytes
        if keep is not None:
            keep[i] = bytearray(data)
    return None, nbytes


def verify(store: S3Storage, step_dir: str, rel: str, manifest: mf.Manifest,
           on_bytes: Optional[Callable[[int], None]]) -> Optional[str]:
    """stepfiles.verify_file on the store: size, then the checksum read piece by piece (memory stays flat)."""
    entry = manifest.entry(rel)
    try:
        url = key(step_dir, rel)
        size = store.size(url)
        problem = mf.size_problem(rel, size, entry.size)
        if problem:
            return problem
        h = mf.Hasher(manifest.algo)
        for off, n in _pieces(size):
            data = store.read(url, off, n)
            if len(data) != n:
                return f"{rel}: the store returned {len(data)} bytes at offset {off}, expected {n}"
            h.update(data)
            if on_bytes is not None:
                on_bytes(n)
    except ManifestError as exc:
        return str(exc)
    except FileNotFoundError:
        return f"{rel}: missing"
    except OSError as exc:
        return f"{rel}: unreadable ({exc})"
    return mf.compare(rel, size, h.hexdigest, entry, manifest.algo)
