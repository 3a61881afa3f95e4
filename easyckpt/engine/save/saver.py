"""Taking a rank's snapshots, once the engine decided one is due (session.py: maybe_save, persist_now).

Order of one snapshot:
  1. ``settle``: a background copy still running ends first (a snapshot, a load and finalize all wait for it);
  2. the peers are introduced (once), the adapter's shards collected and copied into a free slot
     (snapshot.py), the optimizer-owned tensors possibly deferred to a background copy that ends before
     the optimizer's next step (overlap.py: the watched optimizers' pre-hook calls ``before_optimizer_step``);
  3. a skip (both slots still being persisted) is said once an episode (skips.py); a snapshot taken ends an
     episode, goes in the audit log, and is handed to the agent when it is to be persisted.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Protocol, Sequence

from easyckpt.config import Config, storage_interval
from easyckpt.engine.save.budget import SnapshotBudget
from easyckpt.engine.save.overlap import OptimizerWatch, auto_overlap
from easyckpt.engine.save.skips import SkipEpisodes
from easyckpt.engine.save.snapshot import PendingSnapshot, ShardSpec, SnapshotResult, Snapshotter
from easyckpt.engine.seams import AgentLink, Clock
from easyckpt.errors import AgentError, TornSnapshot
from easyckpt.formats import protocol
from easyckpt.formats.replies import StatusReply
from easyckpt.ipc import shm
from easyckpt.storage.auditlog import AuditLog

Collect = Callable[[], Sequence[ShardSpec]]
# what the adapter wants recorded in the manifest's "info" (e.g. {"protect": [best step]})
Info = Optional[Dict[str, Any]]


class AgentView(Protocol):
    """What the saver needs of what a rank knows of its agent (link/agentview.py's AgentView; a protocol here so
    that the save path does not import the link's)."""
    link: AgentLink

    def persist_seconds(self) -> Dict[int, float]: ...

    def requested(self, step: int) -> None: ...

    def status(self) -> Optional[StatusReply]: ...

    def after_request(self) -> None: ...


class Saver:
    def __init__(self, cfg: Config, rank: int, snapshotter: Snapshotter, log: AuditLog, clock: Clock,
                 agent: AgentView, budget: SnapshotBudget, *, introduce: Callable[[], None], run: Dict[str, Any]):
        """``introduce``: the engine's introduction of the peers, reached by every rank at its first snapshot (or
        load). ``run``: what every manifest's info says of this run (session.py)."""
        self.cfg, self.rank, self.snapshotter, self.log, self.clock = cfg, rank, snapshotter, log, clock
        self.view, self.client, self.budget = agent, agent.link, budget
        self.introduce, self.run = introduce, run
        self.last: Optional[SnapshotResult] = None
        self.last_persisted_step: Optional[int] = None
        self.last_complete_step: Optional[int] = None   # newest snapshot a crash would resume from
        self.skips = SkipEpisodes(rank, cfg.save_mem_interval, storage_interval(cfg), log)
        # overlap (overlap.py): a snapshot whose optimizer-owned tensors are still being copied
        self.pending: Optional[PendingSnapshot] = None
        self._pending_persist = False
        self.watch = OptimizerWatch(self.before_optimizer_step)
        self._overlap_on: Optional[bool] = None

    def in_loop(self, step: int, collect: Collect, persist: bool, info: Info,
                optimizer: Any) -> Optional[SnapshotResult]:
        """maybe_save's snapshot: ``optimizer`` watched when the overlap is on, its tensors then copied while the
        next forward/backward runs."""
        if optimizer is not None and self._overlap(optimizer):
            self.watch.add(optimizer)
        return self.snapshot(step, collect, persist=persist, info=info, overlap=bool(self.watch))

    def _overlap(self, optimizer: Any) -> bool:
        if self._overlap_on is None:
            if self.cfg.snapshot_overlap is None:
                ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                self._overlap_on, why = auto_overlap(optimizer, ranks)
            else:
                self._overlap_on, why = self.cfg.snapshot_overlap, "snapshot_overlap set"
            self.log.emit("overlap", rank=self.rank, on=self._overlap_on, message=why)
        return self._overlap_on

    def snapshot(self, step: int, collect: Collect, persist: bool, quiet: bool = False,
                 info: Info = None, overlap: bool = False) -> Optional[SnapshotResult]:
        self.settle()
        self.introduce()
        defer = self.watch.deferrable() if overlap else None
        shards = collect()
        info = {**(info or {}), **self.run, "budget": self.budget.info()}
        result = self.snapshotter.snapshot(step, shards, persist, info, defer)
        if result is None and self.snapshotter.skipped is None and not self.client.alive():
            # both slots reserved by an agent that died: a new agent releases them (docs/reliability.md promise 10)
            self.client.reattach("both snapshot slots stay reserved by it")
            result = self.snapshotter.snapshot(step, shards, persist, info, defer)
        if isinstance(result, PendingSnapshot):
            self.pending, self._pending_persist = result, persist
            return None
        if result is None and quiet:
            return None
        if result is None:
            behind = step - (self.last_complete_step if self.last_complete_step is not None else 0)
            pid = self.client.agent_pid
            why = self.snapshotter.skipped or (
                f"the easyckpt agent (pid {pid}) is stopped and holds both snapshot slots" if pid and shm.pid_stopped(pid)
                else f"both snapshot slots are still being persisted (storage is slower than "
                     f"save_storage_interval={self.skips.storage})")
            self.skips.skipped(step, behind, why, self.clock.monotonic())   # said once an episode (skips.py)
            return None
        self._done(result, persist)
        return result

    def _done(self, result: SnapshotResult, persist: bool, copy_seconds: Optional[float] = None) -> None:
        self.last = result
        self.last_complete_step = result.step
        self.skips.resumed(result.step, self.clock.monotonic(), self.view.persist_seconds)
        self.log.emit("snapshot", step=result.step, rank=self.rank, slot=result.slot, bytes=result.nbytes,
                      seconds=round(result.seconds, 6),
                      **({} if copy_seconds is None else {"background_seconds": round(copy_seconds, 6)}))
        if persist:
            self.request_persist(result)

    def settle(self) -> None:
        """Finish the background snapshot copy, if one runs: called by the watched optimizers' step
        pre-hook (the copy must end before the parameters change), and before anything else that
        snapshots, loads or finalizes. A failed copy is logged; training goes on (docs/reliability.md promise 2)."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        try:
            result = pending.wait()
        except TornSnapshot as exc:   # the loop changes what the overlap copies: copy synchronously from now on
            self._overlap_on = False
            self.watch.close()
            self.log.emit("warning", step=pending.result.step, rank=self.rank, message=str(exc))
            return
        except Exception as exc:   # noqa: BLE001 - the copy ran in another thread; report, keep training
            self.log.emit("error", step=pending.result.step, rank=self.rank,
                          message=f"background snapshot copy failed: {exc!r}")
            return
        self._done(result, self._pending_persist, pending.copy_seconds)

    def before_optimizer_step(self) -> None:
        pending = self.pending
        if pending is None:
            return
        if not pending.order_on_device() or pending.done():
            self.settle()

    def request_persist(self, result: SnapshotResult) -> None:
        try:
            self.client.send(protocol.Persist(self.rank, result.slot, result.generation, result.step))
            self.last_persisted_step = result.step
            self.view.requested(result.step)
        except AgentError as exc:   # never take training down for a failed persist (docs/reliability.md promise 2)
            self.log.emit("error", step=result.step, rank=self.rank, message=str(exc))
        self.view.after_request()
