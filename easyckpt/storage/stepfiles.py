"""Reading a step directory: its manifest, and the files the manifest lists, each path checked to stay
inside the step (formats/paths.py) and opened without following a symlink. Only files a manifest lists
are ever opened: a name found in the directory means nothing until the manifest vouches for it.

- ``load`` raises ManifestError naming the problem, for callers that must say why a step is rejected
  (loader, CLI); ``read`` returns None for callers that only ask "is this a checkpoint?".
- ``entry_path`` is the ONE place a listed relative path becomes a filesystem path: anything whose real
  path (symlinks followed) leaves the step directory is refused, and files are opened with O_NOFOLLOW, so
  a last component swapped for a symlink after that check is not followed either.

The manifest's format (fields, validation, checksums) is formats/manifest.py's; this module is the save
directory's side of it, so every read of a checkpoint's bytes goes through storage/, and through the
``Storage`` verbs alone (base.py: size, owner, read, read_hashed, read_ranges), whatever the back-end. Each
function takes the step's ``storage`` (a SaveDir's); without one, resolve.storage_for picks it from the name.
On an object store a listed name becomes a key only through ``paths.check_relpath`` (there are no symlinks to
refuse), and ownership is the bucket's policy (``Storage.owner`` is None).
"""
from __future__ import annotations

import errno
import io
import json
import os
import stat
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from easyckpt.errors import (
    CheckpointError,
    ManifestError,
    UnsafePath,
    UntrustedFileError,
)
from easyckpt.formats import manifest as mf
from easyckpt.formats import paths
from easyckpt.storage.base import Storage
from easyckpt.storage.resolve import storage_for
from easyckpt.units import size_and_bytes


ITEMS_AT_ONCE = 256 << 20      # read_items: the most bytes of items asked of the back-end in one read_ranges


def _of(step_dir: str, storage: Optional[Storage]) -> Storage:
    return storage if storage is not None else storage_for(step_dir)


def load(step_dir: str, *, storage: Optional[Storage] = None) -> mf.Manifest:
    """The validated manifest of ``step_dir``. FileNotFoundError when there is none (not a checkpoint);
    ManifestError, with the reason, when it is unreadable, not JSON, or fails ``validate``."""
    raw = _read_manifest(_of(step_dir, storage), step_dir)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{mf.MANIFEST_NAME} is not valid JSON ({exc})") from None
    try:
        return mf.validate(data)
    except ManifestError as exc:
        raise ManifestError(f"{mf.MANIFEST_NAME} is invalid: {exc}") from None


def _read_manifest(storage: Storage, step_dir: str) -> bytes:
    """The manifest's bytes, its size asked first: one larger than MAX_MANIFEST_BYTES is refused unread."""
    path = os.path.join(step_dir, mf.MANIFEST_NAME)
    try:
        size = storage.size(path)
        if size > mf.MAX_MANIFEST_BYTES:
            raise ManifestError(f"{mf.MANIFEST_NAME} is larger than {size_and_bytes(mf.MAX_MANIFEST_BYTES)}")
        raw = storage.read(path, 0, mf.MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError, ManifestError):
        raise
    except UntrustedFileError as exc:      # a FIFO, a device, a symlink, a huge file: never read
        raise ManifestError(f"{mf.MANIFEST_NAME}: {exc}") from None
    except OSError as exc:
        raise ManifestError(f"{mf.MANIFEST_NAME} cannot be opened ({exc.strerror or exc}"
                            f"{': a symlink' if exc.errno == errno.ELOOP else ''})") from None
    if len(raw) > mf.MAX_MANIFEST_BYTES:
        raise ManifestError(f"{mf.MANIFEST_NAME} is larger than {size_and_bytes(mf.MAX_MANIFEST_BYTES)}")
    return raw


def read(step_dir: str, *, storage: Optional[Storage] = None) -> Optional[mf.Manifest]:
    """The manifest of ``step_dir``, or None when it is missing, unreadable or invalid (not a checkpoint).
    Callers that must say why use ``load``."""
    try:
        return load(step_dir, storage=storage)
    except (OSError, ManifestError):
        return None


def committed(step_dir: str, step: int, *, storage: Optional[Storage] = None) -> Optional[mf.Manifest]:
    """The manifest of ``step_dir`` when it commits ``step`` (valid, and of that step: a directory renamed
    to another step's name is not that step), else None. The one answer to "is this step committed"."""
    man, why = judge(step_dir, step, storage=storage)
    return man if why is None else None


def judge(step_dir: str, step: int, *, storage: Optional[Storage] = None
          ) -> Tuple[Optional[mf.Manifest], Optional[str]]:
    """What the manifest of ``step_dir`` says of step ``step``, the one place a bad manifest becomes a
    reason: (manifest, None) when it commits that step; (None, None) when there is none (an interrupted save,
    a framework's own); (None, why) when it cannot be trusted; (manifest, why) when it is valid but another
    step's (a directory renamed by hand)."""
    try:
        man = load(step_dir, storage=storage)
    except FileNotFoundError:
        return None, None
    except ManifestError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"{mf.MANIFEST_NAME} unreadable ({exc.strerror or exc})"
    if man.step != step:
        return man, f"{mf.MANIFEST_NAME} is of step {man.step}, not {step}"
    return man, None


# ---- listed files: the only paths a manifest can make us open --------------------------------------------

def join(storage: Storage, step_dir: str, rel: object) -> str:
    """The path of relative name ``rel`` inside ``step_dir``; UnsafePath when it is not a plain relative path or,
    on a file system, its real path (symlinks followed) leaves ``step_dir``. An object store has no symlinks: a
    plain relative name is inside by construction."""
    if storage.local:
        return paths.inside(step_dir, rel)
    return step_dir.rstrip("/") + "/" + paths.check_relpath(rel)


def entry_path(step_dir: str, rel: str, *, storage: Optional[Storage] = None) -> str:
    """The path of listed file ``rel`` inside ``step_dir``; ManifestError when ``rel`` is not a plain relative path
    or, on a file system, its real path (symlinks followed) is not inside the step directory. (An object store
    has no symlinks: a plain relative name is inside by construction.)"""
    try:
        return join(_of(step_dir, storage), step_dir, rel)
    except UnsafePath as exc:
        raise ManifestError(f"{exc}; refusing to read it") from None


def open_entry(step_dir: str, rel: str, *, storage: Optional[Storage] = None) -> io.FileIO:
    """Listed file ``rel`` opened for reading (unbuffered), never through a symlink as its last component.
    ManifestError for a path that leaves the step; OSError as open raises it. Where a path is no file (an object
    store) the whole file is fetched and handed over as one in memory."""
    storage = _of(step_dir, storage)
    if not storage.local:
        return io.BytesIO(read_entry(step_dir, rel, storage=storage))   # type: ignore[return-value]  # callers' use
    path = entry_path(step_dir, rel, storage=storage)
    try:
        fd = paths.open_regular(path)
    except UntrustedFileError as exc:   # a symlink swapped in after entry_path looked, a FIFO, a device
        raise ManifestError(f"{rel}: {exc}") from None
    return os.fdopen(fd, "rb", buffering=0)


def read_entry_hashed(step_dir: str, rel: str, algo: str = mf.ALGO,
                      on_bytes: Optional[Callable[[int], None]] = None,
                      expect: Optional[int] = None, *, storage: Optional[Storage] = None) -> Tuple[memoryview, str]:
    """The whole of listed file ``rel`` and its checksum, read at the back-end's speed (Storage.read_hashed:
    parallel O_DIRECT reads or ranged GETs, checksummed on the way). With ``expect`` (the manifest's size) a file
    of another size is refused (ManifestError) before a byte is allocated for it: the size the disk or the store
    reports is not trusted with memory."""
    buf, digest = _read_whole(_of(step_dir, storage), step_dir, rel, algo, on_bytes, expect)
    return buf, str(digest)


def _read_whole(storage: Storage, step_dir: str, rel: str, algo: Optional[str],
                on_bytes: Optional[Callable[[int], None]], expect: Optional[int] = None
                ) -> Tuple[memoryview, Optional[str]]:
    path = entry_path(step_dir, rel, storage=storage)
    size = _size(storage, path, rel)
    mf.require_size(rel, size, expect)
    try:
        return storage.read_hashed(path, algo, on_bytes, size)
    except UntrustedFileError as exc:     # swapped for a symlink or a FIFO since its size was asked
        raise ManifestError(f"{rel}: {exc}") from None


def _size(storage: Storage, path: str, rel: str) -> int:
    try:
        return storage.size(path)
    except UntrustedFileError as exc:     # a symlink, a FIFO, a device: never read
        raise ManifestError(f"{rel}: {exc}") from None


def entry_size(step_dir: str, rel: str, *, storage: Optional[Storage] = None) -> int:
    """The size of listed file ``rel`` (a symlink is not followed). OSError if missing."""
    storage = _of(step_dir, storage)
    return _size(storage, entry_path(step_dir, rel, storage=storage), rel)


def read_entry(step_dir: str, rel: str, on_bytes: Optional[Callable[[int], None]] = None,
               chunk: int = 64 << 20, *, storage: Optional[Storage] = None) -> Union[bytearray, memoryview]:
    """The whole of listed file ``rel`` (opened as ``open_entry`` opens it); ``on_bytes`` hears of each piece."""
    return _read_whole(_of(step_dir, storage), step_dir, rel, None, on_bytes)[0]


def read_items(step_dir: str, rel: str, manifest: mf.Manifest, picked: Sequence[int],
               on_bytes: Optional[Callable[[int], None]] = None, keep: Optional[Dict[int, bytearray]] = None,
               *, storage: Optional[Storage] = None) -> Tuple[Optional[str], int]:
    """Read and checksum only items ``picked`` of listed file ``rel`` (its manifest ``items``, validated when
    the manifest was parsed): (the first problem or None, bytes read). What a rank needs of a large shared file.
    ``keep`` receives each checked item's bytes by index. Asked of the back-end (Storage.read_ranges) in batches
    of at most ITEMS_AT_ONCE bytes (one item alone may be more): memory stays bounded without ``keep``."""
    storage = _of(step_dir, storage)
    items = manifest.entry(rel).items or ()
    for i in picked:
        if type(i) is not int or not 0 <= i < len(items):
            return f"{rel}: no item {i!r}", 0
    path = entry_path(step_dir, rel, storage=storage)
    nbytes = 0
    for batch in _batches(list(picked), [items[i].length for i in picked]):
        try:
            fetched = storage.read_ranges(path, [(items[i].offset, items[i].length) for i in batch])
        except UntrustedFileError as exc:
            raise ManifestError(f"{rel}: {exc}") from None
        for i, data in zip(batch, fetched):
            problem = _item_problem(rel, i, items[i], data, manifest.algo)
            if problem:
                return problem, nbytes
            nbytes += len(data)
            if on_bytes is not None:
                on_bytes(len(data))
            if keep is not None:
                keep[i] = data if isinstance(data, bytearray) else bytearray(data)
    return None, nbytes


def _batches(picked: List[int], lengths: List[int]) -> List[List[int]]:
    out: List[List[int]] = []
    total = ITEMS_AT_ONCE
    for i, n in zip(picked, lengths):
        if total + n > ITEMS_AT_ONCE and (not out or out[-1]):
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def _item_problem(rel: str, i: int, item: Any, data: Union[bytes, bytearray], algo: str) -> Optional[str]:
    offset, length, digest, ident = item
    name = ident[0] if ident else "?"
    if len(data) != length:
        return f"{rel}: item {i} ({name}) cut short at byte {offset + len(data)}"
    got = mf.checksum(data, algo)
    if got != digest:
        return (f"{rel}: item {i} ({name}, bytes {offset}..{offset + length}) has checksum {got}, the manifest "
                f"records {digest} ({algo}): corrupted")
    return None


def check_sizes(step_dir: str, manifest: mf.Manifest, relpaths: Optional[Iterable[str]] = None,
                *, storage: Optional[Storage] = None) -> List[str]:
    """Cheap check: every listed file exists with its recorded size. Returns the problems found. On an object
    store the sizes come from one listing of the step's prefix (a request per 1000 objects), not a HEAD per
    file: a manifest of 30,000 files took `easyckpt ls` 46 s. On a file system each file is looked at alone
    (a listing would not say which names are symlinks leaving the step)."""
    storage = _of(step_dir, storage)
    rels = list(manifest.files if relpaths is None else relpaths)
    listed = dict(storage.files(step_dir)) if not storage.local and len(rels) > 1 else None
    problems = []
    for rel in rels:
        entry = manifest.files.get(rel)
        if entry is None:
            problems.append(f"{rel}: not in the manifest")
            continue
        try:
            path = entry_path(step_dir, rel, storage=storage)     # a plain relative name, or ManifestError
            if listed is None:
                size = _size(storage, path, rel)
            elif rel in listed:
                size = listed[rel]
            else:
                raise FileNotFoundError(rel)
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        except OSError:
            problems.append(f"{rel}: missing")
            continue
        problem = mf.size_problem(rel, size, entry.size)
        if problem:
            problems.append(problem)
    return problems


def read_verified(step_dir: str, rel: str, manifest: mf.Manifest, *, storage: Optional[Storage] = None) -> bytes:
    """The bytes of one listed file, after checking its size and checksum; ValueError if damaged or not
    listed (ManifestError is a ValueError too: a path that leaves the step)."""
    entry, algo = manifest.entry(rel), manifest.algo
    # one pass: read and checksum together; a file not of the manifest's size is refused before it is read
    data, digest = read_entry_hashed(step_dir, rel, algo, expect=entry.size, storage=storage)
    problem = mf.compare(rel, len(data), lambda: digest, entry, algo)
    if problem:
        raise CheckpointError(problem)
    return bytes(data)


def verify_file(step_dir: str, rel: str, manifest: mf.Manifest, on_bytes: Optional[Callable[[int], None]] = None,
                chunk: int = 16 << 20, *, storage: Optional[Storage] = None) -> Optional[str]:
    """Size and checksum of one listed file, read piece by piece into one buffer (memory stays flat for large
    shards); the problem found, or None. ``on_bytes`` hears of every piece (a progress bar)."""
    storage = _of(step_dir, storage)
    entry = manifest.entry(rel)
    try:
        path = entry_path(step_dir, rel, storage=storage)
        size = _size(storage, path, rel)
        problem = mf.size_problem(rel, size, entry.size)
        if problem:
            return problem
        h = mf.Hasher(manifest.algo)
        buf = memoryview(bytearray(min(size, chunk)))
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            got = storage.read_into(path, off, buf[:n])
            if got != n:
                return f"{rel}: {got} bytes at offset {off}, expected {n} (it changed while being read)"
            h.update(buf[:n])
            if on_bytes is not None:
                on_bytes(n)
    except ManifestError as exc:
        return str(exc)
    except FileNotFoundError:
        return f"{rel}: missing"
    except OSError as exc:
        return f"{rel}: unreadable ({exc.strerror or exc})"
    return mf.compare(rel, size, h.hexdigest, entry, manifest.algo)


def damaged_message(step_dir: str, problems: List[str]) -> str:
    """What a tool that reads a committed step says when listed files fail their checks."""
    return (f"{step_dir} is damaged: {'; '.join(problems)}. Nothing was written; convert an older committed "
            f"step (`easyckpt verify SAVE_DIR` shows which are intact)")


TRAINER_STATE_MAX = 64 << 20     # the Trainer's trainer_state.json: a log history, never this large


def trainer_state_step(step_dir: str, *, storage: Optional[Storage] = None) -> Optional[int]:
    """``global_step`` of the HF Trainer's ``trainer_state.json`` in ``step_dir``, or None: missing, not a
    regular file (a FIFO, a link to /dev/zero), larger than TRAINER_STATE_MAX, or not what the Trainer writes."""
    state = trainer_state(step_dir, storage=storage)
    step = state.get("global_step") if state is not None else None
    # what the Trainer writes: an int (not a bool, a string or a float that int() would take)
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 1 << 62 else None


def trainer_state(step_dir: str, *, storage: Optional[Storage] = None) -> Optional[Dict[str, Any]]:
    """The HF Trainer's ``trainer_state.json`` in ``step_dir`` as the JSON object it holds, or None: missing, not
    a regular file, larger than TRAINER_STATE_MAX, not JSON or not an object. Untrusted: callers check each
    field they use."""
    storage = _of(step_dir, storage)
    try:
        path = os.path.join(step_dir, "trainer_state.json")
        if storage.size(path) > TRAINER_STATE_MAX:       # a FIFO or a device: refused by size, never read
            return None
        raw = storage.read(path, 0, TRAINER_STATE_MAX + 1)
        if len(raw) > TRAINER_STATE_MAX:
            return None
        state = json.loads(raw)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def owner_problem(step_dir: str, rels: Iterable[str] = (), *, storage: Optional[Storage] = None) -> Optional[str]:
    """Why ``step_dir`` cannot be trusted as this user's own checkpoint, or None: the directory, its manifest
    and the listed files ``rels`` (those a rank reads) must be owned by this user, and none writable by others
    (docs/reliability.md promise 13: in a shared save dir another user could have planted or re-sealed a
    step). Missing files are check_sizes's. Where the back-end has no owners (an object store: who may write is
    the bucket's policy) there is nothing to check."""
    storage = _of(step_dir, storage)
    uid = os.geteuid()
    for rel in (None, mf.MANIFEST_NAME, *rels):
        try:
            owner = storage.owner(step_dir if rel is None else entry_path(step_dir, rel, storage=storage))
        except ManifestError:
            continue
        if owner is None:
            continue
        st_uid, mode = owner
        if st_uid != uid or mode & 0o002:
            return (f"{rel or os.path.basename(step_dir)} is owned by {paths.owner_name(st_uid)} with mode "
                    f"{stat.filemode(mode)}, not this job's user (uid {uid}): another user may have planted "
                    f"or rewritten it")
    return None
