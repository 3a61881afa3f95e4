"""The Storage interface: the few verbs the save directory needs from a back-end.

Everything easyckpt writes, renames, deletes or reads in a save directory goes through one ``Storage`` (owned
by a ``SaveDir``, storage/savedir.py, which alone knows the names; resolve.py picks the back-end from the save
directory's name, once). posix.py implements it for local and network file systems (O_DIRECT streaming from
direct.py, O_DIRECT reads from fastread.py); s3.py for S3-compatible object stores (reads shared with other
object stores in objectread.py). A back-end whose objects several writers replace (the job's lease on a store,
storelock.py) also implements ``Versioned``.

The order of calls a back-end sees for one checkpoint of step S on a file system (``stg`` = the staging dir
of S, ``final`` = the step dir of S; the order IS the design, see storage/renamecommit.py for why each step is
there; an object store's is storage/manifestcommit.py's):

    every rank r, in its node's agent (agent/stepwriter.py):
      1) makedirs(stg), makedirs(stg/<sub dirs>)
      2) open_writer(stg/<file>) per file → Writer.write / write_mapped ... → Writer.finish
      3) Writer.sync() for each file, then sync_dir() of every directory made in 1) (deepest first)
      4) write_atomic(stg/<marker of r>)                           rank r's files are durable
    coordinator (the agent of global rank 0), once every rank's marker is there (RenameCommit.commit):
      5) listdir(stg), read(stg/<marker>) per rank                 IMPORTANT: commit only after all ranks
      6) write_atomic(stg/<manifest>)                              the manifest lists every file, last
      7) delete(stg/<marker>) per rank, sync_dir(stg)
      8) rename_noreplace(stg, final)                              the step becomes visible, atomically
      9) sync_dir(save_dir)                                        ... and durably
     10) write_atomic(save_dir/<tracker>)                          a hint for the frameworks' own loaders
    then, only after a successful commit (SaveDir.prune), per step to delete:
     11) rename_noreplace(<step dir>, <trash dir>), sync_dir(save_dir), delete(<trash dir>)
    on a failed step, and at every agent start: delete(<staging or trash dir of this job>)

Reads (loader, operator tools; stepfiles.py reads a step's listed files through these alone): listdir, is_dir,
exists, size, owner, read (a small file or one range), read_hashed (a whole file, checksummed as it arrives),
read_into (a range into the caller's buffer), read_ranges (several ranges of one file).

A store without rename (S3, GCS) implements the same verbs differently and says so with
``has_rename = False``: there the commit is the manifest written last (Orbax's "commit file"), so the
writer writes the files under the final prefix directly (no staging), ``rename_noreplace`` is never called,
``write_atomic`` is a plain PUT (objects appear whole), ``sync``/``sync_dir`` are no-ops (a finished upload is
durable), ``delete`` of a tree deletes every object under the prefix, manifest FIRST so that a half-deleted
step is never mistaken for a checkpoint; a listing counts a step only when its manifest object exists, which
is already the loader's rule here. The save dir picks its commit strategy (commit.py) once, from has_rename:
there a step being written carries its job's claim object (layout.claim_name), written first and deleted by the
commit, so that an unfinished step is known as this job's and only its own next agent deletes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

Buffer = Union[bytes, bytearray, memoryview]


@runtime_checkable
class Writer(Protocol):
    """One new file, written front to back (a multipart upload for an object store)."""

    size: int          # bytes handed over so far: the file's final size

    def write(self, data: Buffer) -> int: ...

    def write_mapped(self, view: memoryview, start: int, end: int) -> None:
        """Append ``view[start:end]`` of a page-aligned mapping: the zero-copy path (O_DIRECT on POSIX)."""
        ...

    def finish(self) -> None:
        """Everything handed over is written (not yet durable)."""
        ...

    def sync(self) -> None:
        """The file's bytes are durable (its name only after ``sync_dir`` of its directory)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    has_rename: bool          # False: an object store; the commit is the manifest written last
    # True: its paths are the file system's, so a reader that takes only a path (torch.load, DCP's FileSystemReader,
    # DeepSpeed's loader) reads them in place; False: an object store's URLs, fetched into a local copy first
    local: bool

    def makedirs(self, path: str) -> None:
        """``path`` and its parents exist as directories (no-op for an object store)."""
        ...

    def make_own_dir(self, path: str) -> None:
        """A step's staging directory: created, or accepted only when it is this user's and no one else can
        write it (UntrustedFileError otherwise); a no-op for an object store."""
        ...

    def check_own_dir(self, path: str) -> None:
        """UntrustedFileError unless ``path`` is still this user's directory that no one else can write."""
        ...

    def open_writer(self, path: str, direct: bool = True) -> Writer:
        """A new file, created exclusively (FileExistsError if it exists), never through a symlink.
        ``direct``: around the page cache where the back-end can."""
        ...

    def write_atomic(self, path: str, data: Buffer) -> None:
        """Create or replace a small file so that readers see the old content or the new, never a mix, and
        the new one is durable (name included) when this returns."""
        ...

    def create_exclusive(self, path: str, data: Buffer) -> None:
        """Create a small file with ``data`` unless the name is taken (FileExistsError; AlreadyCommitted on a
        store): an object store's commit, the manifest's conditional PUT."""
        ...

    def abort_uploads(self, path: str) -> List[str]:
        """Drop the unfinished uploads under ``path`` (a killed writer's multipart uploads); their keys."""
        ...

    def sync_dir(self, path: str) -> None:
        """The names in directory ``path`` (files created or renamed into it) are durable."""
        ...

    def rename_noreplace(self, src: str, dst: str) -> None:
        """Rename directory ``src`` to ``dst`` atomically; FileExistsError if ``dst`` exists (never replaced)."""
        ...

    def set_aside(self, src: str, dst: str) -> None:
        """Move committed step ``src`` to the new name ``dst``, whole (a quarantine); FileExistsError if ``dst``
        exists. A file system renames (atomically, made durable); an object store copies every object, the
        manifest last, then deletes the originals, the manifest first: at every moment one of the two is a
        whole committed step (both for a moment; a crash between leaves both, the original taken up again)."""
        ...

    def listdir(self, path: str) -> List[str]:
        """Entry names of a directory; FileNotFoundError when there is none."""
        ...

    def is_dir(self, path: str) -> bool: ...

    def subdirs(self, path: str) -> List[str]:
        """Names of the directories in directory ``path`` (symlinks are none), in one listing; empty when there
        is none. What the step and staging listings read: one request on an object store, not one per name."""
        ...

    def is_file(self, path: str) -> bool:
        """A regular file (an object) under that name; a symlink is none. One request on an object store, where
        ``exists`` must also list the prefix."""
        ...

    def exists(self, path: str) -> bool:
        """Anything under that name (a dangling symlink too: a name that is taken)."""
        ...

    def delete(self, path: str) -> None:
        """Remove a file or a whole tree; a missing one is no error."""
        ...

    def delete_files(self, paths: List[str]) -> None:
        """Remove these files, by name (no tree, nothing listed; one request on an object store); a missing one is
        no error."""
        ...

    def files(self, path: str) -> List[Tuple[str, int]]:
        """(relative name, size) of every regular file under directory ``path``, recursively (symlinks are
        not followed); empty when there is none. What the operator tools count and list."""
        ...

    def mtime(self, path: str) -> float:
        """When ``path`` last changed (a prefix: its newest object); 0.0 when it is gone."""
        ...

    def read(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        """``length`` bytes from ``offset`` (-1: to the end), never through a symlink as the last component."""
        ...

    def read_own(self, path: str, max_bytes: int) -> bytes:
        """The whole of a small record easyckpt keeps for itself (the damaged record), only if this user wrote it:
        UntrustedFileError when another user owns it or may write it, FileNotFoundError when there is none. On
        an object store who may write is the bucket's policy: a plain read."""
        ...

    def size(self, path: str) -> int:
        """The size of regular file ``path`` (never through a symlink); FileNotFoundError when there is none,
        UntrustedFileError when it is no regular file (a FIFO, a device, a symlink, a directory)."""
        ...

    def owner(self, path: str) -> Optional[Tuple[int, int]]:
        """(owner uid, mode) of ``path`` (never through a symlink), or None when it is gone or the back-end has
        no owners (an object store: who may write is the bucket's policy)."""
        ...

    def read_hashed(self, path: str, algo: Optional[str] = None, on_bytes: Optional[Callable[[int], None]] = None,
                    size: Optional[int] = None) -> Tuple[memoryview, Optional[str]]:
        """The whole of regular file ``path`` and its checksum by ``algo`` (None: no checksum), computed in order
        as the bytes arrive (no pass of its own), read at the back-end's speed: parallel O_DIRECT reads on a file
        system (fastread.py), parallel ranged GETs on a store (objectread.py). ``size``: what ``size(path)`` said,
        when the caller asked it first (to refuse a file of the wrong size before a byte is allocated); None: it
        is asked here. OSError when the file is shorter than that; ``on_bytes`` hears of every piece."""
        ...

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        """``len(view)`` bytes from ``offset`` of ``path`` into ``view``; the bytes read, fewer only at its end."""
        ...

    def read_ranges(self, path: str, ranges: List[Tuple[int, int]]) -> Sequence[Union[bytes, bytearray]]:
        """The ``(offset, length)`` ranges of one file (fewer bytes than asked only at its end): the items of a
        shared file that a rank needs. In parallel on a store; one open file on a file system."""
        ...

    def check(self, url: str) -> None:
        """ConfigError naming what to fix when ``url`` cannot be used (a store's bucket unreachable with these
        credentials); nothing on a file system, whose checks are config.py's."""
        ...


@dataclass(frozen=True)
class Version:
    """One object as the store holds it now (``Versioned.read_version``): its first bytes, its version token (an
    ETag, a generation), and two times by the store's own clock, never this host's."""
    data: bytes
    etag: str
    modified: float             # when it was last written (whole seconds)
    store_now: Optional[float]  # the store's time when it answered (a reply's Date); None when it gives none

    @property
    def age(self) -> Optional[float]:
        """Seconds since the object was last written, by the store's clock; None when the store gave no time."""
        return None if self.store_now is None else self.store_now - self.modified


@runtime_checkable
class Versioned(Storage, Protocol):
    """A store with conditional writes of a small object that several writers replace (the job's lease,
    storelock.py): every object store's back-end; a file system locks with flock instead (joblock.py)."""

    def create_version(self, path: str, data: Buffer) -> str:
        """Create ``path`` unless it exists (AlreadyCommitted then); its version token."""
        ...

    def put_if_match(self, path: str, data: Buffer, etag: str) -> str:
        """Replace ``path`` only while it is still version ``etag`` (ObjectChanged otherwise); the new token."""
        ...

    def read_version(self, path: str, limit: int) -> Optional[Version]:
        """At most ``limit`` first bytes of ``path`` with its version and the store's times; None when absent."""
        ...
