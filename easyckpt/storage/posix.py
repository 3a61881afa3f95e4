"""POSIX storage: the Storage interface (base.py) for local and network file systems, and its primitives:
fsync discipline, no-replace rename, atomic small-file writes.

Everything that makes bytes durable or visible on disk goes through these few functions, so the rules
of the durable sequence (docs/reliability.md) are enforced in one place:
- a file is durable after ``fsync(file)``; its *name* is durable only after ``fsync(parent dir)``;
- a directory becomes visible by ``rename`` and must never replace an existing one;
- a small file (manifest, tracker, marker) is written to a temp name, fsynced, then renamed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple, Union

from easyckpt.errors import UntrustedFileError
from easyckpt.formats.paths import open_own, open_regular, owner_name
from easyckpt.storage import fastread
from easyckpt.storage.base import Buffer
from easyckpt.storage.direct import SequentialWriter

PathLike = Union[str, "os.PathLike[str]"]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def fsync_dir(path: PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_noreplace(src: PathLike, dst: PathLike) -> None:
    """Rename ``src`` to ``dst``; raise FileExistsError if ``dst`` exists.

    Plain rename(2) silently replaces an empty directory, which would let a commit clobber a step
    directory; renameat2(RENAME_NOREPLACE) refuses atomically. Some file systems (older NFS) do not
    support the flag: there we fall back to check-then-rename, racy only against a second writer,
    which the job lock already excludes.
    """
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST or err == errno.ENOTEMPTY:
            raise FileExistsError(err, f"refusing to replace existing {dst}")
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), str(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, f"refusing to replace existing {dst}")
    os.rename(src, dst)


def atomic_write(path: PathLike, data: Buffer) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or the new, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW   # a planted symlink is never written through
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:      # a leftover of a process with our pid (or a planted name): the name only goes
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    fsync_dir(path.parent)


def write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def probe_writable(directory: PathLike) -> None:
    """Create, fsync and remove a probe file: the only reliable test (os.access lies for root and
    for read-only mounts)."""
    # the pid alone is not unique: every node of a job probes the shared save dir, and pids repeat across
    # hosts (in containers every rank's trainer is the same small pid)
    probe = Path(directory) / f".easyckpt-probe-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"x")
        os.fsync(fd)
    finally:
        os.close(fd)
        _unlink_quiet(probe)


def check_own_dir(path: PathLike) -> None:
    """``path`` is a real directory (never a symlink) of this user that nobody else can write; else
    UntrustedFileError naming its owner and mode (docs/reliability.md promise 13: a shared, sticky save dir
    lets any user create a name first, a staging directory's name included)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UntrustedFileError(
            f"refusing {path}: {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a directory'} owned by "
            f"{owner_name(st.st_uid)} with mode {stat.filemode(st.st_mode)}; easyckpt writes a step only into a "
            f"directory of its own user (uid {os.geteuid()}) that no one else can write. Another user may have "
            f"planted it in the shared save dir: remove it (as its owner or root); this step is not saved")


def _unlink_quiet(path: PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """``len(view)`` bytes of ``fd`` from ``offset`` into ``view``; fewer only at the file's end."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


class PosixStorage:
    """storage.base.Storage on a POSIX file system; files stream through direct.SequentialWriter
    (O_DIRECT where the file system allows it, the same bytes either way)."""

    has_rename = True
    local = True

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def make_own_dir(self, path: str) -> None:
        # every rank of a step (on every node) makes the same staging dir: the first one creates it, and
        # each accepts it only as a directory of this user that no one else can write (check_own_dir)
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        check_own_dir(path)

    def check_own_dir(self, path: str) -> None:
        check_own_dir(path)

    def open_writer(self, path: str, direct: bool = True) -> SequentialWriter:
        return SequentialWriter(path, direct=direct)

    def write_atomic(self, path: str, data: Buffer) -> None:
        atomic_write(path, data)

    def write_sparse(self, path: str, size: int, pieces: Iterable[Tuple[int, Buffer]]) -> None:
        """A new file of ``size`` bytes holding only ``pieces`` (offset, bytes); the rest is a hole, which
        reads as zeros and takes no disk: the parts of a large shard one reader takes. Not durable (a scratch
        copy); FileExistsError if the name is taken."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            for offset, data in pieces:
                view, done = memoryview(data).cast("B"), 0
                if offset < 0 or offset + len(view) > size:
                    raise ValueError(f"{path}: a piece at {offset} of {len(view)} bytes lies outside its {size}")
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)

    def create_exclusive(self, path: str, data: Buffer) -> None:
        """A new small file with ``data``, durable with its name; FileExistsError if the name is taken."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(os.path.dirname(path) or ".")

    def abort_uploads(self, path: str) -> List[str]:
        """A file system has no unfinished uploads: a killed writer's file is in its staging directory."""
        return []

    def sync_dir(self, path: str) -> None:
        fsync_dir(path)

    def rename_noreplace(self, src: str, dst: str) -> None:
        rename_noreplace(src, dst)

    def set_aside(self, src: str, dst: str) -> None:
        rename_noreplace(src, dst)
        fsync_dir(os.path.dirname(dst) or ".")

    def listdir(self, path: str) -> List[str]:
        return os.listdir(path)

    def is_dir(self, path: str) -> bool:
        # lstat: a symlink is no step or staging directory (a step dir linked to / would have `ls` walk the disk)
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            return False

    def subdirs(self, path: str) -> List[str]:
        try:
            with os.scandir(path) as entries:
                return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def is_file(self, path: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except OSError:
            return False

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def delete(self, path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            # a tree half removed (EIO, a file another user owns) goes on the next start of its job:
            # only names in trash or staging are ever deleted this way
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink_quiet(path)

    def delete_files(self, paths: List[str]) -> None:
        for path in paths:
            _unlink_quiet(path)

    def files(self, path: str) -> List[Tuple[str, int]]:
        out = []
        for root, _dirs, names in os.walk(path):
            for name in names:
                full = os.path.join(root, name)
                try:
                    st = os.lstat(full)           # a symlink is never followed, nor counted
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append((os.path.relpath(full, path), st.st_size))
        return out

    def mtime(self, path: str) -> float:
        try:
            return os.lstat(path).st_mtime
        except OSError:
            return 0.0

    def read(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        # O_NONBLOCK: a FIFO planted under a tracker's or marker's name must not hang the reader
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            if length < 0:
                length = max(0, st.st_size - offset)
            out = bytearray()
            while len(out) < length:
                chunk = os.pread(fd, length - len(out), offset + len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)
        finally:
            os.close(fd)

    def read_own(self, path: str, max_bytes: int) -> bytes:
        fd = open_own(path, os.O_RDONLY, max_bytes=max_bytes)
        try:
            return os.pread(fd, max_bytes, 0)
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        fd = open_regular(path)       # a symlink, a FIFO, a device: UntrustedFileError naming what it is
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def owner(self, path: str) -> Optional[Tuple[int, int]]:
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return st.st_uid, st.st_mode

    def read_hashed(self, path: str, algo: Optional[str] = None, on_bytes: Optional[Callable[[int], None]] = None,
                    size: Optional[int] = None) -> Tuple[memoryview, Optional[str]]:
        """Parallel O_DIRECT reads (fastread.py), every open O_NOFOLLOW and of a regular file only."""
        return fastread.read_hashed(lambda extra: open_regular(path, os.O_RDONLY | extra),
                                    self.size(path) if size is None else size, algo, on_bytes,
                                    what=os.path.basename(path))

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        fd = open_regular(path)
        try:
            return _pread_full(fd, view, offset)
        finally:
            os.close(fd)

    def read_ranges(self, path: str, ranges: List[Tuple[int, int]]) -> List[bytearray]:
        fd = open_regular(path)       # one open file for every range: none read from a file swapped meanwhile
        try:
            out: List[bytearray] = []
            for offset, length in ranges:
                buf = bytearray(length)
                got = _pread_full(fd, memoryview(buf), offset)
                out.append(buf if got == length else buf[:got])
            return out
        finally:
            os.close(fd)

    def check(self, url: str) -> None:
        """A file system's checks (writable, this user's) are config.py's, made when a job starts."""
