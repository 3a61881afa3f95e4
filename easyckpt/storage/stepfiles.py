"""Reading a step directory: its manifest, and the files the manifest lists, each path checked to stay
inside the step (formats/paths.py) and opened without following a symlink. Only files a manifest lists
are ever opened: a name found in the directory means nothing until the manifest vouches for it.

- ``load`` raises ManifestError naming the problem, for callers that must say why a step is rejected
  (loader, CLI); ``read`` returns None for callers that only ask "is this a checkpoint?".
- ``entry_path`` is the ONE place a listed relative path becomes a filesystem path: anything whose real
  path (symlinks followed) leaves the step directory is refused, and files are opened with O_NOFOLLOW, so
  a last component swapped for a symlink after that check is not followed either.

The manifest's format (fields, validation, checksums) is formats/manifest.py's; this module is the save
directory's side of it, so every read of a checkpoint's bytes goes through storage/. (An object store
would read these through Storage.read's ranges; on POSIX the unbuffered readinto into one buffer per
file avoids a copy.)
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
from easyckpt.storage import fastread, remotefiles
from easyckpt.storage.resolve import remote
from easyckpt.units import size_and_bytes


def load(step_dir: str) -> mf.Manifest:
    """The validated manifest of ``step_dir``. FileNotFoundError when there is none (not a checkpoint);
    ManifestError, with the reason, when it is unreadable, not JSON, or fails ``validate``."""
    store = remote(step_dir)
    raw = remotefiles.load_raw(store, step_dir) if store is not None else _read_manifest_file(step_dir)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{mf.MANIFEST_NAME} is not valid JSON ({exc})") from None
    try:
        return mf.validate(data)
    except ManifestError as exc:
        raise ManifestError(f"{mf.MANIFEST_NAME} is invalid: {exc}") from None


def _read_manifest_file(step_dir: str) -> bytes:
    path = os.path.join(step_dir, mf.MANIFEST_NAME)
    try:
        fd = paths.open_regular(path, max_bytes=mf.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except UntrustedFileError as exc:      # a FIFO, a device, a symlink, a huge file: never read
        raise ManifestError(f"{mf.MANIFEST_NAME}: {exc}") from None
    except OSError as exc:
        raise ManifestError(f"{mf.MANIFEST_NAME} cannot be opened ({exc.strerror}"
                            f"{': a symlink' if exc.errno == errno.ELOOP else ''})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(mf.MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(f"{mf.MANIFEST_NAME} unreadable ({exc.strerror})") from None
    if len(raw) > mf.MAX_MANIFEST_BYTES:
        raise ManifestError(f"{mf.MANIFEST_NAME} is larger than {size_and_bytes(mf.MAX_MANIFEST_BYTES)}")
    return raw


def read(step_dir: str) -> Optional[mf.Manifest]:
    """The manifest of ``step_dir``, or None when it is missing, unreadable or invalid (not a checkpoint).
    Callers that must say why use ``load``."""
    try:
        return load(step_dir)
    except (OSError, ManifestError):
        return None


def committed(step_dir: str, step: int) -> Optional[mf.Manifest]:
    """The manifest of ``step_dir`` when it commits ``step`` (valid, and of that step: a directory renamed
    to another step's name is not that step), else None. The one answer to "is this step committed"."""
    man, why = judge(step_dir, step)
    return man if why is None else None


def judge(step_dir: str, step: int) -> Tuple[Optional[mf.Manifest], Optional[str]]:
    """What the manifest of ``step_dir`` says of step ``step``, the one place a bad manifest becomes a
    reason: (manifest, None) when it commits that step; (None, None) when there is none (an interrupted save,
    a framework's own); (None, why) when it cannot be trusted; (manifest, why) when it is valid but another
    step's (a directory renamed by hand)."""
    try:
        man = load(step_dir)
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

def entry_path(step_dir: str, rel: str) -> str:
    """The filesystem path of listed file ``rel`` inside ``step_dir``; ManifestError when ``rel`` is not a
    plain relative path or its real path (symlinks followed) is not inside the step directory."""
    try:
        return paths.inside(step_dir, rel)
    except UnsafePath as exc:
        raise ManifestError(f"{exc}; refusing to read it") from None


def open_entry(step_dir: str, rel: str) -> io.FileIO:
    """Listed file ``rel`` opened for reading (unbuffered), never through a symlink as its last component.
    ManifestError for a path that leaves the step; OSError as open raises it."""
    if remote(step_dir) is not None:
        return io.BytesIO(read_entry(step_dir, rel))   # type: ignore[return-value]  # what callers use of a file
    path = entry_path(step_dir, rel)
    try:
        fd = paths.open_regular(path)
    except UntrustedFileError as exc:   # a symlink swapped in after entry_path looked, a FIFO, a device
        raise ManifestError(f"{rel}: {exc}") from None
    return os.fdopen(fd, "rb", buffering=0)


def read_entry_hashed(step_dir: str, rel: str, algo: str = mf.ALGO,
                      on_bytes: Optional[Callable[[int], None]] = None,
                      expect: Optional[int] = None) -> Tuple[memoryview, str]:
    """The whole of listed file ``rel`` and its checksum, read at the disk's speed (fastread.py: parallel
    O_DIRECT reads, checksummed on the way); opened as ``open_entry`` opens it. With ``expect`` (the manifest's
    size) a file of another size is refused (ManifestError) before a byte is allocated for it: the size the
    disk or the store reports is not trusted with memory."""
    store = remote(step_dir)
    if store is not None:
        buf, digest = remotefiles.read_whole(store, step_dir, rel, algo, on_bytes, expect)
        return buf, str(digest)
    path = entry_path(step_dir, rel)
    size = entry_size(step_dir, rel)
    mf.require_size(rel, size, expect)

    def open_fd(extra: int) -> int:
        try:
            return paths.open_regular(path, os.O_RDONLY | extra)
        except UntrustedFileError as exc:
            raise ManifestError(f"{rel}: {exc}") from None

    return fastread.read_hashed(open_fd, size, algo, on_bytes, what=rel)


def entry_size(step_dir: str, rel: str) -> int:
    """The size on disk of listed file ``rel`` (lstat: a symlink is not followed). OSError if missing."""
    store = remote(step_dir)
    if store is not None:
        return remotefiles.entry_size(store, step_dir, rel)
    st = os.lstat(entry_path(step_dir, rel))
    if not stat.S_ISREG(st.st_mode):
        raise ManifestError(f"{rel}: not a regular file")
    return st.st_size


def read_entry(step_dir: str, rel: str, on_bytes: Optional[Callable[[int], None]] = None,
               chunk: int = 64 << 20) -> Union[bytearray, memoryview]:
    """The whole of listed file ``rel`` (opened as ``open_entry`` opens it); ``on_bytes`` hears of each chunk."""
    store = remote(step_dir)
    if store is not None:
        return remotefiles.read_whole(store, step_dir, rel, None, on_bytes)[0]
    with open_entry(step_dir, rel) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:got + chunk] if on_bytes else view[got:])
            if not n:
                raise OSError(f"{rel} shrank while being read")
            got += n
            if on_bytes is not None:
                on_bytes(n)
    return buf


def read_items(step_dir: str, rel: str, manifest: mf.Manifest, picked: Sequence[int],
               on_bytes: Optional[Callable[[int], None]] = None, keep: Optional[Dict[int, bytearray]] = None
               ) -> Tuple[Optional[str], int]:
    """Read and checksum only items ``picked`` of listed file ``rel`` (its manifest ``items``, validated when
    the manifest was parsed): (the first problem or None, bytes read). What a rank needs of a large shared file.
    ``keep`` receives each checked item's bytes by index."""
    store = remote(step_dir)
    if store is not None:
        return remotefiles.read_items(store, step_dir, rel, manifest, picked, on_bytes, keep)
    items = manifest.entry(rel).items or ()
    algo, nbytes = manifest.algo, 0
    with open_entry(step_dir, rel) as f:
        for i in picked:
            if type(i) is not int or not 0 <= i < len(items):
                return f"{rel}: no item {i!r}", nbytes
            offset, length, digest, ident = items[i]
            f.seek(offset)
            buf = bytearray(length)
            view, got = memoryview(buf), 0
            while got < length:
                n = f.readinto(view[got:])
                if not n:
                    return f"{rel}: item {i} ({ident[0] if ident else '?'}) cut short at byte {offset + got}", nbytes
                got += n
            nbytes += length
            if on_bytes is not None:
                on_bytes(length)
            got_digest = mf.checksum(buf, algo)
            if got_digest != digest:
                return (f"{rel}: item {i} ({ident[0] if ident else '?'}, bytes {offset}..{offset + length}) has "
                        f"checksum {got_digest}, the manifest records {digest} ({algo}): corrupted"), nbytes
            if keep is not None:
                keep[i] = buf
    return None, nbytes


def check_sizes(step_dir: str, manifest: mf.Manifest, relpaths: Optional[Iterable[str]] = None) -> List[str]:
    """Cheap check: every listed file exists with its recorded size. Returns the problems found. On an object
    store the sizes come from one listing of the step's prefix (a request per 1000 objects), not a HEAD per
    file: a manifest of 30,000 files took `easyckpt ls` 46 s."""
    rels = list(manifest.files if relpaths is None else relpaths)
    store = remote(step_dir)
    listed = dict(store.files(step_dir)) if store is not None and len(rels) > 1 else None
    problems = []
    for rel in rels:
        entry = manifest.files.get(rel)
        if entry is None:
            problems.append(f"{rel}: not in the manifest")
            continue
        try:
            if listed is not None:
                remotefiles.key(step_dir, rel)        # a plain relative name, or ManifestError
                if rel not in listed:
                    raise FileNotFoundError(rel)
                size = listed[rel]
            else:
                size = entry_size(step_dir, rel)
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


def read_verified(step_dir: str, rel: str, manifest: mf.Manifest) -> bytes:
    """The bytes of one listed file, after checking its size and checksum; ValueError if damaged or not
    listed (ManifestError is a ValueError too: a path that leaves the step)."""
    entry, algo = manifest.entry(rel), manifest.algo
    # one pass: read and checksum together; a file not of the manifest's size is refused before it is read
    data, digest = read_entry_hashed(step_dir, rel, algo, expect=entry.size)
    problem = mf.compare(rel, len(data), lambda: digest, entry, algo)
    if problem:
        raise CheckpointError(problem)
    return bytes(data)


def verify_file(step_dir: str, rel: str, manifest: mf.Manifest,
                on_bytes: Optional[Callable[[int], None]] = None, chunk: int = 16 << 20) -> Optional[str]:
    """Size and checksum of one listed file, read in chunks (memory stays flat for large shards);
    the problem found, or None. ``on_bytes`` hears of every chunk (a progress bar)."""
    store = remote(step_dir)
    if store is not None:
        return remotefiles.verify(store, step_dir, rel, manifest, on_bytes)
    entry = manifest.entry(rel)
    h = mf.Hasher(manifest.algo)
    size = 0
    try:
        with open_entry(step_dir, rel) as f:
            while True:
                data = f.read(chunk)
                if not data:
                    break
                h.update(data)
                size += len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
    except ManifestError as exc:
        return str(exc)
    except FileNotFoundError:
        return f"{rel}: missing"
    except OSError as exc:
        return f"{rel}: unreadable ({exc.strerror or exc})"
    return mf.compare(rel, size, h.hexdigest, entry, h.algo)


def damaged_message(step_dir: str, problems: List[str]) -> str:
    """What a tool that reads a committed step says when listed files fail their checks."""
    return (f"{step_dir} is damaged: {'; '.join(problems)}. Nothing was written; convert an older committed "
            f"step (`easyckpt verify SAVE_DIR` shows which are intact)")


TRAINER_STATE_MAX = 64 << 20     # the Trainer's trainer_state.json: a log history, never this large


def trainer_state_step(step_dir: str) -> Optional[int]:
    """``global_step`` of the HF Trainer's ``trainer_state.json`` in ``step_dir``, or None: missing, not a
    regular file (a FIFO, a link to /dev/zero), larger than TRAINER_STATE_MAX, or not what the Trainer writes."""
    state = trainer_state(step_dir)
    step = state.get("global_step") if state is not None else None
    # what the Trainer writes: an int (not a bool, a string or a float that int() would take)
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 1 << 62 else None


def trainer_state(step_dir: str) -> Optional[Dict[str, Any]]:
    """The HF Trainer's ``trainer_state.json`` in ``step_dir`` as the JSON object it holds, or None: missing, not
    a regular file, larger than TRAINER_STATE_MAX, not JSON or not an object. Untrusted: callers check each
    field they use."""
    store = remote(step_dir)
    try:
        if store is not None:
            raw = store.read(remotefiles.key(step_dir, "trainer_state.json"), 0, TRAINER_STATE_MAX + 1)
        else:
            fd = paths.open_regular(os.path.join(step_dir, "trainer_state.json"), max_bytes=TRAINER_STATE_MAX)
            with os.fdopen(fd, "rb") as f:
                raw = f.read(TRAINER_STATE_MAX + 1)
        if len(raw) > TRAINER_STATE_MAX:
            return None
        state = json.loads(raw)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def owner_problem(step_dir: str, rels: Iterable[str] = ()) -> Optional[str]:
    """Why ``step_dir`` cannot be trusted as this user's own checkpoint, or None: the directory, its manifest
    and the listed files ``rels`` (those a rank reads) must be owned by this user, and none writable by others
    (docs/reliability.md promise 13: in a shared save dir another user could have planted or re-sealed a
    step). Missing files are check_sizes's. On an object store who may write is the bucket's policy: nothing
    to check here."""
    if remote(step_dir) is not None:
        return None
    uid = os.geteuid()
    for rel in (None, mf.MANIFEST_NAME, *rels):
        try:
            st = os.lstat(step_dir if rel is None else entry_path(step_dir, rel))
        except (OSError, ManifestError):
            continue
        if st.st_uid != uid or st.st_mode & 0o002:
            return (f"{rel or os.path.basename(step_dir)} is owned by {paths.owner_name(st.st_uid)} with mode "
                    f"{stat.filemode(st.st_mode)}, not this job's user (uid {uid}): another user may have planted "
                    f"or rewritten it")
    return None
