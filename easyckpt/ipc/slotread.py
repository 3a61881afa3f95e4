"""The one reader of a snapshot slot: what "a complete snapshot" means, for every process.

A slot is complete when, read in this order,

1. its header is intact and says COMPLETE (magic, version, header CRC; shm.Slot.read_header),
2. it holds the step / generation the caller expects, if the caller expects one,
3. its metadata region matches the CRC the header carries,
4. that metadata passes slotmeta.parse (safe file names, tensors back to back inside the data region),
5. and the slot still says COMPLETE with the same generation afterwards: the trainer moves the
   generation on *before* it touches a published slot (shm.Slot.begin_write), so an unchanged
   generation means nothing read above was being rewritten meanwhile.

The trainer's loader, the agent's persist and recovery, and ``easyckpt status`` all use ``check`` or
``read_complete``; a reader that needs the bytes too (persist, load) keeps the slot open, reads, and
then calls ``ensure_unchanged`` to close the seqlock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from easyckpt.errors import BadSlotMeta, SlotNotComplete
from easyckpt.formats import slotmeta
from easyckpt.ipc import shm


@dataclass(frozen=True)
class CompleteSlot:
    """A slot that passed every check: its header and its parsed, validated metadata."""

    path: str
    header: shm.Header
    meta: slotmeta.SlotMeta

    @property
    def step(self) -> int:
        return self.header.step

    @property
    def generation(self) -> int:
        return self.header.generation


def check(slot: shm.Slot, expect_step: Optional[int] = None,
          expect_generation: Optional[int] = None) -> CompleteSlot:
    """The complete snapshot held by the open ``slot``; raises SlotNotComplete, or slotmeta.BadSlotMeta
    when the metadata itself is invalid (a damaged or hostile slot, not merely a busy one)."""
    hdr = slot.read_header()
    if hdr is None:
        raise SlotNotComplete(f"{slot.path} holds no complete snapshot (empty, being written, or a torn header)")
    if expect_step is not None and hdr.step != expect_step:
        raise SlotNotComplete(f"{slot.path} holds step {hdr.step}, not step {expect_step}")
    if expect_generation is not None and hdr.generation != expect_generation:
        raise SlotNotComplete(f"{slot.path} no longer holds generation {expect_generation} (now {hdr.generation})")
    raw = slot.read_meta(hdr)
    if raw is None:
        raise SlotNotComplete(f"{slot.path}: the metadata does not match the header's checksum "
                              f"(damaged, or being rewritten)")
    meta = slotmeta.parse(raw, hdr.step, shm.HEADER_BYTES, hdr.meta_offset)
    found = CompleteSlot(slot.path, hdr, meta)
    ensure_unchanged(slot, found)
    return found


def ensure_unchanged(slot: shm.Slot, found: CompleteSlot) -> None:
    """Close the seqlock: raise SlotNotComplete if the trainer started to rewrite ``slot`` since ``found``
    was read (anything read from it since then may mix two snapshots)."""
    if slot.state() != (shm.COMPLETE, found.generation):
        raise SlotNotComplete(f"{slot.path} changed while it was read (generation {found.generation} "
                              f"is no longer published)")


def read_complete(path: str, expect_step: Optional[int] = None) -> Optional[CompleteSlot]:
    """The complete snapshot in the slot file ``path``, or None when there is none (no file, or any
    check above fails). A file of another user or a symlink is not None but UntrustedFileError
    (docs/reliability.md promise 9): callers report it rather than treat it as an empty slot."""
    try:
        slot = shm.Slot(path, writable=False)
    except FileNotFoundError:
        return None
    try:
        return check(slot, expect_step)
    except (SlotNotComplete, BadSlotMeta):
        return None
    finally:
        slot.close()
