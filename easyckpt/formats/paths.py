"""Relative paths inside a step directory: the one check every path taken from a slot, a manifest or a
marker passes before it touches the file system (docs/reliability.md promise 9).

A path is accepted only if it is relative, made of plain components (no empty, ``.`` or ``..``
component, no NUL or backslash) and, once joined to its step directory, still lies inside it with
symlinks resolved. Anything else is refused with the reason: the path may have been written by
someone else.

``open_regular`` is the one way easyckpt opens a file it reads (or appends to) in /dev/shm or a save dir:
a FIFO there would block an ordinary open for ever, a device or a symlink to /dev/zero would feed it
without end (docs/reliability.md promise 13). It opens without blocking and without following a symlink,
checks with fstat that the file is a regular one (and, if asked, how large), and names the file and its owner otherwise.
"""
from __future__ import annotations

import errno
import os
import pwd
import stat
from typing import Optional

from easyckpt.errors import UnsafePath, UntrustedFileError

MAX_RELPATH = 1024


def check_relpath(rel: object) -> str:
    """``rel`` if it is a safe relative path (string checks only); UnsafePath otherwise."""
    if not isinstance(rel, str) or not rel:
        raise UnsafePath(f"file name {rel!r} is not a non-empty string")
    if len(rel) > MAX_RELPATH or "\0" in rel or "\\" in rel:
        raise UnsafePath(f"file name {rel[:80]!r} is too long or holds a NUL or backslash")
    if rel.startswith("/"):
        raise UnsafePath(f"file name {rel!r} is absolute")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"file name {rel!r} has an empty, '.' or '..' component")
    return rel


def inside(base: str, rel: object) -> str:
    """The path of ``rel`` inside file-system directory ``base``, refused if it leaves ``base`` (symlinks
    resolved). (Under an object store's URL there are no symlinks: stepfiles.join takes a plain relative name.)"""
    path = os.path.join(base, check_relpath(rel))
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if os.path.commonpath([real_base, real]) != real_base or real == real_base:
        raise UnsafePath(f"file name {rel!r} resolves to {real}, outside the step directory {base}")
    return path


_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def owner_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _not_regular(path: str, st: os.stat_result) -> UntrustedFileError:
    kind = next((name for test, name in _KINDS if test(st.st_mode)), f"of mode {stat.filemode(st.st_mode)}")
    return UntrustedFileError(f"refusing {path}: it is {kind} owned by {owner_name(st.st_uid)}, not a regular file; "
                              f"another user may have planted it. Remove it (as its owner or root) and start again")


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o600, max_bytes: Optional[int] = None) -> int:
    """An fd of the regular file ``path``, opened with O_NONBLOCK (a FIFO opens at once instead of waiting
    for a writer), O_NOFOLLOW and O_CLOEXEC, checked with fstat, then set back to blocking. UntrustedFileError
    (a PermissionError, so an OSError) names the path, what it is and its owner: a FIFO, a device, a
    socket, a directory, a symlink, or more than ``max_bytes``."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:      # ELOOP: a symlink; ENXIO: a FIFO opened for writing with no reader, or a socket;
        # EISDIR: a directory opened for writing (a planted `mkdir` under a log's or the lock's name)
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        try:
            st = os.lstat(path)
        except OSError:
            raise exc from None
        if stat.S_ISREG(st.st_mode):
            raise
        raise _not_regular(path, st) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st)
        if max_bytes is not None and st.st_size > max_bytes:
            raise UntrustedFileError(f"refusing {path}: it holds {st.st_size} bytes, more than the {max_bytes} such a "
                                     f"file may (owned by {owner_name(st.st_uid)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def own_problem(path: str, st: os.stat_result) -> Optional[str]:
    """Why the file ``st`` describes is not this user's own, or None: owned by another user, or writable by
    group or others (in a shared save dir either lets another user plant or rewrite what easyckpt reads or
    appends to; docs/reliability.md promise 15)."""
    uid = os.geteuid()
    if st.st_uid == uid and not st.st_mode & 0o022:
        return None
    return (f"refusing {path}: it is owned by {owner_name(st.st_uid)} with mode {stat.filemode(st.st_mode)}, not "
            f"a file of this job's user (uid {uid}) that no one else can write; another user may have planted it. "
            f"Remove it (as its owner or root) and start again")


def open_own(path: str, flags: int = os.O_RDONLY, mode: int = 0o600, max_bytes: Optional[int] = None) -> int:
    """open_regular, and the file must be this user's own (own_problem): what easyckpt appends to (its logs),
    locks or trusts (the damaged record) is never a file someone else created. UntrustedFileError otherwise."""
    fd = open_regular(path, flags, mode, max_bytes)
    try:
        problem = own_problem(path, os.fstat(fd))
        if problem is not None:
            raise UntrustedFileError(problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def describe(path: str, own: bool = True) -> Optional[str]:
    """Why ``path``, where easyckpt expects a regular file (of its own if ``own``: a log, the lock), cannot be
    one, or None (missing is fine: easyckpt creates it; a path that cannot even be looked at, under a file, a
    symlink loop, a name too long, is said where the file is made, as log_file_path's own check does). Never opens
    it."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return str(_not_regular(path, st))
    return own_problem(path, st) if own else None
