"""Shared-memory snapshot slots: one file per (job, rank, slot) in /dev/shm, mapped MAP_SHARED.

A slot outlives the trainer that wrote it (no unlink on exit), so the node agent or a restarted
trainer can still read it after a crash. Layout of a slot file::

    [0, 4096)            header page
        [0, 88)          trainer-owned header (written by the trainer only; state written last)
        [2048, 2064)     agent-owned words: busy generation, released generation
    [4096, 4096+D)       data region: tensor bytes, grouped by shard file
    [4096+D, end)        meta region: JSON layout + skeletons of the snapshot

Single writer per field, so no locks: the trainer publishes with a seqlock-like protocol
(state=WRITING and a new generation first, data, then the header, state=COMPLETE last), and
readers re-check the generation after reading.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, NamedTuple, NoReturn, Optional, Tuple, Union, cast

from easyckpt import pages
from easyckpt.errors import ShmCapacityError, UntrustedFileError
from easyckpt.formats import paths
from easyckpt.units import human

SHM_DIR = os.environ.get("EASYCKPT_SHM_DIR", "/dev/shm")
PREFIX = "easyckpt-"
HEADER_BYTES = 4096
MAGIC = b"EZCKSLOT"
VERSION = 1
EMPTY, WRITING, COMPLETE = 0, 1, 2

# magic, version, state, step, generation, meta_len, meta_capacity, data_capacity, persist,
# meta_crc, pid, rank, world_size, header_crc
_HDR = struct.Struct("<8sIIqQQQQIIqII")
_CRC = struct.Struct("<I")
_CRC_AT = _HDR.size
_STATE_AT = 12
_AGENT_AT = 2048
_AGENT = struct.Struct("<QQ")
# "-s": a rank's own slots, written by its trainer (or restored into by the agent from a peer); "-p": the
# replica slots of a rank of another node, written by this node's agent (agent/replicas.py)
_NAME = re.compile(r"^easyckpt-([0-9a-f]{12})-r(\d{5})-([sp])([01])$")


def slot_path(job_id: str, rank: int, slot: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{job_id}-r{rank:05d}-s{slot}")


def replica_path(job_id: str, rank: int, slot: int) -> str:
    """Where this node holds replica slot ``slot`` (0 or 1) of ``rank``, a rank of another node."""
    return os.path.join(SHM_DIR, f"{PREFIX}{job_id}-r{rank:05d}-p{slot}")


class Segment(NamedTuple):
    path: str
    job_id: str
    rank: int
    slot: int
    replica: bool       # a replica of another node's rank (replica_path), not a slot of this node's


def list_segments(job_id: Optional[str] = None) -> Iterator[Segment]:
    """Every easyckpt segment on this node (or of one job): own slots and replicas."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return
    for name in sorted(names):
        m = _NAME.match(name)
        if m and (job_id is None or m.group(1) == job_id):
            yield Segment(os.path.join(SHM_DIR, name), m.group(1), int(m.group(2)), int(m.group(4)),
                          m.group(3) == "p")


@dataclass
class Header:
    state: int
    step: int
    generation: int
    meta_len: int
    meta_capacity: int
    data_capacity: int
    persist: bool
    meta_crc: int
    pid: int
    rank: int
    world_size: int

    @property
    def meta_offset(self) -> int:
        return HEADER_BYTES + self.data_capacity


def _header_crc(raw: bytes) -> int:
    # the state word is excluded: it is flipped on its own as the publish/unpublish step
    return zlib.crc32(raw[:_STATE_AT] + raw[_STATE_AT + 4:_HDR.size])


MIN_META_CAPACITY = 1 << 20


def slot_size(data_bytes: int, meta_len: int) -> int:
    """The size of a slot for ``data_bytes`` of tensors and metadata of ``meta_len`` bytes: room for the
    metadata to grow (the step's digits, the adapter's info) without growing the slot every snapshot."""
    return HEADER_BYTES + data_bytes + max(MIN_META_CAPACITY, 4 * meta_len)


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def shm_advice() -> str:
    return ("give the machine or container more shared memory: `docker run --shm-size=<size>` or "
            "`--ipc=host`; on Kubernetes mount an emptyDir with medium: Memory at /dev/shm; on a bare host "
            "`mount -o remount,size=<size> /dev/shm`. Or lower the number of ranks per node")


def check_owner(path: str, st: os.stat_result) -> None:
    """docs/reliability.md promise 9: a file in /dev/shm is trusted only if it is a regular file of this user
    that no one else can read or write (a symlink never gets here: every open uses O_NOFOLLOW)."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise UntrustedFileError(
            f"refusing {path}: it is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}, but easyckpt "
            f"only uses regular files of its own user (uid {os.geteuid()}) with mode 0600 there; another user may "
            f"have planted it. Remove it (as its owner or root) and start again")


def open_checked(path: str, flags: int) -> int:
    """An fd of ``path`` opened without blocking or following a symlink (paths.open_regular: a planted FIFO
    is refused at once, named with its owner), after the owner and mode check."""
    fd = paths.open_regular(path, flags)
    try:
        check_owner(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


class Slot:
    """One mapped slot file. Trainers open it read-write; the agent and loaders open it read-only.
    Whether a snapshot in it is complete is decided by slotread.py alone. Page-locking for CUDA is the
    trainer's business (engine/save/pinned.py): this module never imports torch."""

    def __init__(self, path: str, writable: bool, populate: bool = False):
        """``populate``: map every page now (one pass in the kernel), for a mapping that a transfer reads or
        writes whole: page faults one 4 KiB page at a time made that three times slower than the copy."""
        self.path = path
        self.writable = writable
        self.fd = open_checked(path, os.O_RDWR if writable else os.O_RDONLY)
        st = os.fstat(self.fd)
        self.size, self.inode = st.st_size, st.st_ino
        self.mm: Optional[mmap.mmap] = None
        # reserve(): where the pages not known to be reserved start, those not known to be mapped here, and the
        # size to give the file back on no room
        self._unreserved, self._unmapped, self._kept = 0, 0, self.size
        self._map(populate)

    def _map(self, populate: bool = False) -> None:
        if self.size == 0:
            self.mm = None
            return
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
        # a mapping we write: faulted in for writing, or the first copy into it write-faults every page
        # again (measured: 0.48 s instead of 0.36 s for the first 4 GB copy); MAP_POPULATE maps shared
        # pages for reading only, and stays the way where the kernel has no MADV_POPULATE_WRITE (< 5.14)
        if populate and self.writable:
            self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, prot)
            # faulting in for writing also allocates any page a killed process left unreserved, and fails with
            # EFAULT where there is no room for one (pages.py): no posix_fallocate pass over pages mostly there
            err = pages.populate_pieces(self.mm, 0, self.size)[1]
            if err == 0:
                self._unreserved = self._unmapped = self.size
                return
            if err not in pages.UNSUPPORTED:
                self._give_back(os.strerror(err))
            self.mm.close()
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self.mm = mmap.mmap(self.fd, self.size, flags, prot)

    @classmethod
    def create_or_grow(cls, path: str, size: int, touch: bool = True, reserve: bool = True,
                       threads: int = 1) -> "Slot":
        """Open the slot at ``path`` with at least ``size`` bytes, reserving the memory now: running out of
        /dev/shm is a ShmCapacityError here, before any copy, instead of a SIGBUS in the middle of a
        snapshot (docs/reliability.md promise 6). ``touch``: the new pages faulted into this mapping too (a
        replica receiver maps the slot populated instead). ``reserve=False``: only the header's page now, the
        rest by ``reserve`` (a thread of its own), which must be done before anything is written past the
        header. ``threads``: how many reserve the new pages at once (``reserve`` says how). Slots only grow: a
        reader may hold a mapping of the old size, and shrinking would SIGBUS it.
        """
        # exclusively, never through a symlink: a pre-created slot is someone else's (docs/reliability.md promise 9)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            fd = open_checked(path, os.O_RDWR)   # ours from an earlier run of this job, or refused
        try:
            current = os.fstat(fd).st_size
            if current < size:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        slot = cls(path, writable=True)
        slot._kept = current
        if current < size:
            slot._unreserved = current - current % mmap.PAGESIZE
            slot.reserve(threads=threads, upto=None if reserve else HEADER_BYTES, touch=touch)
        if current == 0:   # a fresh slot names its owner at once, so no one mistakes it for a leftover
            assert slot.mm is not None
            slot.mm[:_HDR.size] = _HDR.pack(MAGIC, VERSION, EMPTY, -1, 0, 0, 0, 0, 0, 0, os.getpid(), 0, 0)
        return slot

    def reserve(self, stop: Optional[Callable[[], bool]] = None, threads: int = 1, upto: Optional[int] = None,
                touch: bool = True) -> bool:
        """Reserve the pages create_or_grow left unreserved, to ``upto`` (the end) or until ``stop`` says so
        (``pages_reserved`` tells which), and fault them into this mapping (``touch``, those an earlier call
        reserved without it included): True when they are. No room: the slot is closed, the file given back its
        old size (a new one removed), ShmCapacityError.

        One thread: piece by piece (pages.POPULATE_CHUNK), posix_fallocate then MADV_POPULATE_WRITE. Several (the
        training thread waiting, no ``stop``): the pages faulted in for writing on all of them at once, which is
        what reserves them on tmpfs (pages.py), the kernel handing out and zeroing fresh pages on every core
        where fallocate takes one. 2 GB of /dev/shm on the 2-core test VM (create_or_grow, three rounds side by side):
        0.87-1.13 s on two threads, 1.56-1.64 s on one, faulting in alone on one thread 1.76-1.96 s."""
        assert self.mm is not None
        end = self.size if upto is None else min(upto, self.size)
        if threads > 1 and stop is None and touch:
            err = pages.populate_parallel(self.mm, min(self._unmapped, self._unreserved), end, threads)
            if err == 0:
                self._unreserved = self._unmapped = max(self._unreserved, end)
                return True
            if err not in pages.UNSUPPORTED:
                self._give_back(os.strerror(err))
        off, mapped = (min(self._unmapped, self._unreserved) if touch else self._unreserved), touch
        while off < end and not (stop is not None and stop()):
            n = min(pages.POPULATE_CHUNK, end - off)
            if off + n > self._unreserved:
                try:
                    os.posix_fallocate(self.fd, off, n)
                except OSError as exc:
                    self._give_back(exc.strerror or str(exc))
                self._unreserved = off + n
            if touch and pages.populate_errno(self.mm, off, n) == 0:
                self._unmapped = max(self._unmapped, off + n)
            else:
                mapped = False
            off += n
        return mapped

    @property
    def pages_reserved(self) -> bool:
        """Every page is reserved: the slot may be written anywhere."""
        return self._unreserved >= self.size

    def _give_back(self, why: str) -> NoReturn:
        size, kept = self.size, self._kept
        self.close()
        if kept == 0:
            unlink_quiet(self.path)
        elif kept < size:
            fd = open_checked(self.path, os.O_RDWR)
            try:
                os.ftruncate(fd, kept)
            finally:
                os.close(fd)
        raise ShmCapacityError(f"cannot reserve {human(size)} in {SHM_DIR} for snapshot slot {self.path} ({why}); "
                               f"{shm_advice()}")

    @classmethod
    def of_bytes(cls, data: Union[bytearray, memoryview], size: int, name: str) -> "Slot":
        """A read-only Slot over bytes this process holds alone (a slot moved from another node: nothing else
        writes them, so its seqlock holds by construction). ``size``: the slot's size as its header says (the
        bytes may end at its metadata, before the rest of the metadata's room)."""
        slot = cls.__new__(cls)
        slot.path, slot.writable, slot.fd, slot.inode = name, False, -1, 0
        slot.size = max(size, len(data))
        slot.mm = cast(Any, data)
        return slot

    def close(self) -> None:
        if self.mm is not None:
            try:
                if isinstance(self.mm, mmap.mmap):      # (bytes of our own, of_bytes: nothing to unmap)
                    self.mm.close()
            except BufferError:
                pass  # a tensor view still exports the buffer; the mapping dies with it
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- trainer-owned header -------------------------------------------------------------

    def read_header(self) -> Optional[Header]:
        """The header if it is COMPLETE and intact, else None (a torn or half-written slot)."""
        if self.mm is None or self.size < HEADER_BYTES:
            return None
        raw = bytes(self.mm[:_HDR.size + 4])        # (a slice of an mmap is bytes already; of_bytes' may be a view)
        fields = _HDR.unpack_from(raw)
        if fields[0] != MAGIC or fields[1] != VERSION:
            return None
        (crc,) = _CRC.unpack_from(raw, _CRC_AT)
        if crc != _header_crc(raw):
            return None
        hdr = Header(*fields[2:])
        hdr.persist = bool(hdr.persist)
        if hdr.state != COMPLETE:
            return None
        if hdr.meta_offset + hdr.meta_capacity > self.size:
            return None
        return hdr

    def state(self) -> Tuple[int, int]:
        """(state, generation) read without validation, for the seqlock re-check."""
        assert self.mm is not None
        state, = struct.unpack_from("<I", self.mm, _STATE_AT)
        gen, = struct.unpack_from("<Q", self.mm, 24)
        return state, gen

    def begin_write(self, generation: int) -> None:
        assert self.mm is not None
        struct.pack_into("<I", self.mm, _STATE_AT, WRITING)   # unpublish first ...
        struct.pack_into("<Q", self.mm, 24, generation)       # ... then move the generation on

    def publish(self, hdr: Header, meta: bytes) -> None:
        assert self.mm is not None
        off = hdr.meta_offset
        self.mm[off:off + len(meta)] = meta
        raw = bytearray(_HDR.pack(MAGIC, VERSION, WRITING, hdr.step, hdr.generation, len(meta),
                                  hdr.meta_capacity, hdr.data_capacity, int(hdr.persist),
                                  zlib.crc32(meta), os.getpid(), hdr.rank, hdr.world_size))
        raw += _CRC.pack(_header_crc(bytes(raw)))
        self.mm[:len(raw)] = bytes(raw)
        struct.pack_into("<I", self.mm, _STATE_AT, COMPLETE)  # IMPORTANT: last store of a snapshot

    def read_meta(self, hdr: Header) -> Optional[bytes]:
        assert self.mm is not None
        meta = bytes(self.mm[hdr.meta_offset:hdr.meta_offset + hdr.meta_len])
        return meta if zlib.crc32(meta) == hdr.meta_crc else None

    # ---- agent-owned words ----------------------------------------------------------------

    def agent_words(self) -> Tuple[int, int]:
        """(busy generation, released generation) as last written by the agent."""
        assert self.mm is not None
        return _AGENT.unpack_from(self.mm, _AGENT_AT)

    def reserved(self, hdr: Optional[Header]) -> bool:
        """The agent reads this slot (busy) or owes it a persist: the trainer must not overwrite it.
        ``hdr``: this slot's read_header()."""
        if hdr is None:
            return False
        busy, released = self.agent_words()
        return busy == hdr.generation or (hdr.persist and hdr.generation > released)


class AgentView:
    """The agent's read-write handle on the two agent-owned words of a slot (nothing else)."""

    def __init__(self, path: str):
        fd = open_checked(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def set(self, busy: Optional[int] = None, released: Optional[int] = None) -> None:
        cur_busy, cur_rel = _AGENT.unpack_from(self.mm, _AGENT_AT)
        _AGENT.pack_into(self.mm, _AGENT_AT, cur_busy if busy is None else busy,
                         cur_rel if released is None else max(cur_rel, released))

    def close(self) -> None:
        self.mm.close()


def unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def segment_owner_pid(path: str) -> int:
    try:
        fd = paths.open_regular(path)
    except OSError:
        return 0
    try:
        raw = os.pread(fd, _HDR.size, 0)
    finally:
        os.close(fd)
    return _HDR.unpack_from(raw)[10] if len(raw) == _HDR.size and raw[:8] == MAGIC else 0


def peek(path: str) -> Tuple[int, int, int]:
    """(state, generation, step) of the slot at ``path``, (EMPTY, 0, -1) when there is none: one small read,
    no mapping, no check (the step means something only in a COMPLETE slot). Only for deciding whether to
    look closer (a new snapshot?) or to wait a moment (one being copied); what is then read goes through
    slotread."""
    try:
        fd = paths.open_regular(path)
    except OSError:
        return EMPTY, 0, -1
    try:
        raw = os.pread(fd, 32, 0)
    finally:
        os.close(fd)
    if len(raw) < 32:
        return EMPTY, 0, -1
    return (struct.unpack_from("<I", raw, _STATE_AT)[0], struct.unpack_from("<Q", raw, 24)[0],
            struct.unpack_from("<q", raw, 16)[0])


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def pid_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger): alive, holding its socket and slots, answering nothing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(1024)
    except OSError:
        return False
    return raw[raw.rfind(b")") + 2:][:1] in (b"T", b"t")


def segments_of(job_id: str) -> List[str]:
    return [p for p, *_ in list_segments(job_id)]
