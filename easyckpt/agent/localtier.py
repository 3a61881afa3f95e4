"""The local tier (Config.save_local_interval): every save_local_interval-th step, each local rank's snapshot is
copied from its shared-memory slot to this node's disk (storage/tierfiles.py), where it outlives the agent, a
reboot and /dev/shm; the newest max_local_ckpt_num steps stay.

A thread of its own, never the agent's loop: it looks at the local ranks' slots every POLL seconds, and copies a
rank's newest complete snapshot of a due step that is newer than the last one it wrote (a due snapshot that both
slots' next snapshots overwrite before a look, in steps shorter than POLL, is missed: the next due one is taken). While it copies, the slot
is marked busy (slots.reserved: the trainer does not overwrite it), except when that would take the trainer's
last free slot (a persist holds the other): then it waits for the next look. The copy is checked against the
slot's seqlock before its record is written (a snapshot rewritten meanwhile is not kept). A failure (a full
disk) is said once a minute at most and costs nothing else: training and storage persists go on.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Tuple

from easyckpt.agent import slots
from easyckpt.agent.warnings import Warnings
from easyckpt.config import Config
from easyckpt.errors import SlotNotComplete
from easyckpt.formats import tier as tf
from easyckpt.ipc import priority, shm, slotread
from easyckpt.storage import tierfiles
from easyckpt.storage.auditlog import AuditLog

POLL = 0.05         # a look is two small reads per rank; a due snapshot overwritten sooner than this is missed


class LocalTier:
    def __init__(self, cfg: Config, log: AuditLog):
        self.cfg, self.log = cfg, log
        self.every = cfg.save_local_interval
        self.where = tierfiles.directory(cfg.node_dir, cfg.job_id)
        self.written: Dict[int, int] = {}          # rank -> the newest step copied (this thread's alone)
        self._seen: Optional[Tuple[Tuple[int, int, int], ...]] = None   # the slots' headers at the last look
        self._copying = False
        self._closed = threading.Event()
        self.warnings = Warnings(log)      # once a minute at most each: a full disk must not flood the log
        self._thread: Optional[threading.Thread] = None
        if self.every is not None:
            self._thread = threading.Thread(target=self._loop, name="easyckpt-local-tier", daemon=True)
            self._thread.start()

    def busy(self) -> bool:
        """A copy under way (the agent does not leave in the middle of one)."""
        return self._copying

    def close(self, timeout: float = 60.0, finish: bool = False) -> None:
        """Stop looking; a copy under way ends first (at most ``timeout`` seconds are waited for it). With
        ``finish`` (every trainer has left, so no slot it needs can be pinned) one last look copies a due
        snapshot the thread has not taken yet: the thread runs niced and looks every POLL seconds, and on a loaded
        machine the last snapshot's persist and commit can be done before it has looked once (the job's last
        due step was then missing from the tier, and the next resume read the store instead)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if finish and not self._thread.is_alive():
                try:
                    self.look(last=True)
                except Exception as exc:  # noqa: BLE001 - best effort, as the thread's looks
                    self.warnings.say(f"local tier: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        priority.bulk_thread()
        while not self._closed.wait(POLL):
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 - the tier is best effort; training never depends on it
                self.warnings.say(f"local tier: {type(exc).__name__}: {exc}")

    def look(self, last: bool = False) -> None:
        """One look at the local ranks' slots: copy what is due (the thread's body; tests call it directly).
        ``last``: the trainers have left, so a slot may be pinned though the other one is reserved."""
        assert self.every is not None
        job = self.cfg.job_id
        ranks = sorted({seg.rank for seg in shm.list_segments(job) if not seg.replica})
        peeked = {(r, i): shm.peek(shm.slot_path(job, r, i)) for r in ranks for i in (0, 1)}
        seen = tuple(peeked.values())
        if seen == self._seen:
            return       # no slot changed since the last look
        self._seen = seen
        if not any(state == shm.COMPLETE and step % self.every == 0 and step > self.written.get(r, -1)
                   for (r, _), (state, _, step) in peeked.items()):
            return       # no slot's header says a due step: its metadata is not read (every snapshot's case)
        per_rank = slots.complete_snapshots(job, ranks, self.log)
        for rank in ranks:
            due = [s for s in per_rank[rank] if s % self.every == 0 and s > self.written.get(rank, -1)]
            if not due:
                continue
            step = max(due)
            slot, generation = per_rank[rank][step]
            if not last and slots.trainers_last_free(job, rank, slot):
                self._seen = None    # a persist holds the other slot, and pinning this one would stall the
                continue             # trainer: looked at again next time (a released persist changes no header)
            self._copying = True
            try:
                self._copy(rank, slot, generation, step)
            except SlotNotComplete:
                pass        # overwritten before or while it was copied: the next due step is taken
            finally:
                self._copying = False

    def _copy(self, rank: int, slot: int, generation: int, step: int) -> None:
        job, t0 = self.cfg.job_id, time.perf_counter()
        with slots.reserved(job, rank, slot, generation, release=False) as path:
            opened = shm.Slot(path, writable=False)
            try:
                done = slotread.check(opened, expect_step=step, expect_generation=generation)
                assert opened.mm is not None        # a complete slot is mapped
                record = tf.TierRecord(job, step, rank, done.header.world_size, done.meta.layout or "", 0, "", "")
                written = tierfiles.write(self.where, record, memoryview(opened.mm),
                                          lambda: slotread.ensure_unchanged(opened, done), self.cfg.direct_io,
                                          volatile=shm.HEADER_BYTES)
            finally:
                opened.close()
        self.written[rank] = step
        seconds = round(time.perf_counter() - t0, 6)
        self.log.emit("tier_saved", step=step, rank=rank, bytes=written.size, seconds=seconds, path=self.where)
        tierfiles.prune(self.where, job, rank, self.cfg.max_local_ckpt_num, self.log)

