"""Assemble a torch.save file (a zip archive of stored records) from bytes: the agent's side of a
framework-native shard, without torch and without unpickling.

The trainer pickles the shard's tree itself (torchpickle.flatten_pickled: ``data.pkl`` with storage record i
as a persistent reference); the agent writes that pickle and the tensor bytes straight from the slot
as the records torch.save writes, in its order:

    archive/data.pkl · .format_version · .storage_alignment · byteorder · data/0 … data/N-1 ·
    version · .data/serialization_id

Every record is stored (no compression). Like torch.save with ``compute_crc32=False`` (what the
agent used before), the CRC fields are 0: torch's reader does not check them, the manifest's xxh3
checksum guards the file instead, and computing CRC-32 would halve the write speed. A record's data
starts on a 64-byte boundary (torch's storage alignment, which ``torch.load(mmap=True)`` relies on);
large tensors start at the same offset modulo 4096 as in the slot, so the O_DIRECT writer sends them
from the shared memory without a copy. Zip64 records appear where a size or offset needs them.
"""
from __future__ import annotations

import os
import struct
from typing import Callable, List, Optional, Sequence

from easyckpt.formats.shardfile import BLOCK

ARCHIVE = "archive/"
HEAD = "archive/data.pkl"     # the name of a file's first item (manifest items): the records before any storage
ALIGN = 64
_PHASE_MIN = 1 << 20       # tensors at least this large are placed in the slot's phase (zero copy)
_MAX32 = 0xFFFFFFFF
_DOS_DATE = 0x21           # 1980-01-01: a fixed date keeps the bytes reproducible


class _Entry:
    __slots__ = ("name", "offset", "size")

    def __init__(self, name: bytes, offset: int, size: int):
        self.name, self.offset, self.size = name, offset, size


def write_torch_file(write: Callable[[bytes], None], write_slot: Callable[[int, int], None], position: Callable[[], int],
                     pickle_bytes: bytes, storages: Sequence[Sequence[int]], slot_phase: bool = True,
                     at_storage: Optional[Callable[[int], None]] = None,
                     after_storage: Optional[Callable[[int], None]] = None) -> None:
    """``write(data)`` appends bytes, ``write_slot(begin, end)`` appends slot bytes, ``position()`` is the
    file's size so far. ``storages``: (begin, end) in the slot of storage record i. ``slot_phase=False``:
    records are only 64-byte aligned, so the archive's size depends on its contents' sizes alone (an item of
    a distributed-checkpoint file, whose offset and length the trainer states before the agent writes it).
    ``at_storage(i)`` is called right before storage i's bytes, ``after_storage(i)`` right after them
    (where the items of a partial read begin and end)."""
    entries: List[_Entry] = []

    def record(name: str, size: int, phase: int) -> None:
        raw = (ARCHIVE + name).encode()
        start = position()
        zip64 = size >= _MAX32
        z64 = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        base = start + 30 + len(raw) + len(z64) + 4     # + the padding field's own header
        pad = (phase - base) % (BLOCK if phase % ALIGN == 0 and size >= _PHASE_MIN else ALIGN) \
            if phase >= 0 else (-base) % ALIGN
        extra = z64 + struct.pack("<HH", 0x4246, pad) + bytes(pad)   # 'FB', as torch pads
        small = _MAX32 if zip64 else size
        write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, _DOS_DATE, 0, small, small,
                          len(raw), len(extra)) + raw + extra)
        entries.append(_Entry(raw, start, size))

    def small_record(name: str, data: bytes) -> None:
        record(name, len(data), -1)
        write(data)

    small_record("data.pkl", pickle_bytes)
    small_record(".format_version", b"1")
    small_record(".storage_alignment", str(ALIGN).encode())
    small_record("byteorder", b"little")
    for i, (begin, end) in enumerate(storages):
        record(f"data/{i}", end - begin, begin % BLOCK if slot_phase else -1)
        if at_storage is not None:
            at_storage(i)
        if end > begin:
            write_slot(begin, end)
        if after_storage is not None:
            after_storage(i)
    small_record("version", b"3\n")
    small_record(".data/serialization_id", str(int.from_bytes(os.urandom(16), "little")).zfill(40).encode())
    _central_directory(write, position, entries)


def torch_file_size(pickle_len: int, sizes: Sequence[int]) -> int:
    """The size of ``write_torch_file(..., slot_phase=False)`` with a pickle of ``pickle_len`` bytes and
    storage records of ``sizes`` bytes."""
    total = 0

    def add(data: bytes) -> None:
        nonlocal total
        total += len(data)

    def add_slot(begin: int, end: int) -> None:
        nonlocal total
        total += end - begin

    write_torch_file(add, add_slot, lambda: total, bytes(pickle_len), [(0, n) for n in sizes], slot_phase=False)
    return total


def _central_directory(write: Callable[[bytes], None], position: Callable[[], int], entries: List[_Entry]) -> None:
    cd_start = position()
    out = bytearray()
    for e in entries:
        big = [v for v in (e.size, e.size) if v >= _MAX32] + ([e.offset] if e.offset >= _MAX32 else [])
        extra = struct.pack("<HH", 1, 8 * len(big)) + b"".join(struct.pack("<Q", v) for v in big) if big else b""
        size = _MAX32 if e.size >= _MAX32 else e.size
        offset = _MAX32 if e.offset >= _MAX32 else e.offset
        version = 45 if big else 20
        out += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, 0, 0, 0, _DOS_DATE, 0, size, size,
                           len(e.name), len(extra), 0, 0, 0, 0, offset) + e.name + extra
    write(bytes(out))
    cd_size, count = len(out), len(entries)
    if count >= 0xFFFF or cd_start >= _MAX32 or cd_size >= _MAX32:
        z64_at = position()
        write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start)
              + struct.pack("<IIQI", 0x07064B50, 0, z64_at, 1))
        write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _MAX32, _MAX32, 0))
    else:
        write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))
