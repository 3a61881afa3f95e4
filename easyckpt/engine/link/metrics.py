"""The run's checkpointing figures on one rank, as numbers a training loop's logger takes (TensorBoard, W&B, the
Trainer's ``log_history``), and rank 0's summary line at the end of training.

Nothing here measures anything: the figures are gathered from what the engine already knows.

    snapshots, skips, stall   the audit log's ``snapshot`` and ``skip`` events as this rank writes them
                              (storage/auditlog.py listeners): a snapshot's ``seconds`` is the time the training
                              thread spent in it (engine/save/snapshot.py times it)
    cost as the step pays it  the snapshot budget's medians (engine/save/budget.py: a step after a snapshot against one
                              after none), and its loss bound (Cadence.bound)
    persists, commits         each persist handed to the agent and each status reply (engine/link/agentview.py); a
                              commit's latency runs from its request to the moment this rank learned of it, so it
                              is late by up to the status poll (agentview.STATUS_EVERY) at most

Every key starts with ``easyckpt/``; a figure not known yet (a cost before the budget measured one, a commit
before the first) is left out rather than reported as 0. docs/metrics.md lists the keys.
"""
from __future__ import annotations

import collections
import statistics
import threading
from typing import Any, Deque, Dict, Optional

from easyckpt import console
from easyckpt.engine.link.agentview import AgentView
from easyckpt.engine.save.budget import SnapshotBudget
from easyckpt.engine.seams import Clock
from easyckpt.formats.replies import StatusReply
from easyckpt.storage.auditlog import AuditLog
from easyckpt.units import human

PREFIX = "easyckpt/"
MAX_ASKED = 256           # persist requests whose commit is still awaited, kept for their latency
MEDIAN_WINDOW = 4096      # the newest snapshots the median stall is taken over (a long run's list stays bounded)


class RunMetrics:
    """One rank's figures; fed by the audit log, the agent view and the budget it is given."""

    def __init__(self, rank: int, log: AuditLog, view: AgentView, budget: SnapshotBudget, clock: Clock):
        self.rank, self.log, self.budget, self.clock = rank, log, budget, clock
        self._lock = threading.Lock()       # a background snapshot copy is recorded from the optimizer's hook
        self.snapshots = self.skipped = self.persists = self.commits = 0
        self.snapshot_bytes = self.bytes_written = 0
        self.stall_total = 0.0
        self.stall_last: Optional[float] = None
        self.stalls: Deque[float] = collections.deque(maxlen=MEDIAN_WINDOW)
        self.committed: Optional[int] = None          # the newest step this rank saw committed
        self.latency: Optional[float] = None          # of that commit: request to seen, seconds
        self.persist_seconds: Optional[float] = None  # of that commit: the agent's write, seconds
        self._asked: Dict[int, float] = {}            # step -> when it was handed to the agent (monotonic)
        self._first_request: Optional[int] = None     # commits of earlier steps belong to another run
        self.summary: Optional[str] = None            # rank 0's line, once said
        log.listeners.append(self._event)
        view.on_requested.append(self._requested)
        view.on_status.append(self._status)

    # ---- fed ---------------------------------------------------------------------------------------

    def _event(self, event: str, record: Dict[str, Any]) -> None:
        with self._lock:
            if event == "snapshot":
                self.snapshots += 1
                self.snapshot_bytes = int(record.get("bytes") or 0)
                seconds = float(record.get("seconds") or 0.0)
                self.stall_last = seconds
                self.stall_total += seconds
                self.stalls.append(seconds)
            elif event == "skip":
                self.skipped += 1
            elif event == "sigterm_save" and isinstance(record.get("step"), int):
                self._committed(record["step"], None, None)

    def _requested(self, step: int) -> None:
        with self._lock:
            self.persists += 1
            if self._first_request is None:
                self._first_request = step
            self._asked.setdefault(step, self.clock.monotonic())
            if len(self._asked) > MAX_ASKED:      # a rank that never hears of commits (not rank 0) stays bounded
                del self._asked[next(iter(self._asked))]

    def _status(self, status: StatusReply) -> None:
        with self._lock:
            for step, nbytes, seconds in sorted(status.commits):
                self._committed(step, nbytes, seconds)

    def _committed(self, step: int, nbytes: Optional[int], seconds: Optional[float]) -> None:
        """A commit seen (lock held); each step counted once, only steps this run handed on."""
        if self._first_request is None or step < self._first_request:
            return
        if self.committed is not None and step <= self.committed:
            if step == self.committed and nbytes is not None and self.persist_seconds is None:
                self.bytes_written += nbytes           # seen first without its figures (a SIGTERM save)
                self.persist_seconds = seconds
            return
        self.committed, self.commits = step, self.commits + 1
        if nbytes is not None:
            self.bytes_written += nbytes
        self.persist_seconds = seconds
        asked = self._asked.get(step)
        self.latency = None if asked is None else max(0.0, self.clock.monotonic() - asked)
        for s in [s for s in self._asked if s <= step]:      # older requests will not be waited for
            del self._asked[s]

    # ---- read --------------------------------------------------------------------------------------

    def values(self) -> Dict[str, float]:
        """The figures as ``{"easyckpt/<name>": number}``; see docs/metrics.md."""
        with self._lock:
            out: Dict[str, float] = {
                "snapshots": self.snapshots, "snapshots_skipped": self.skipped, "snapshot_bytes": self.snapshot_bytes,
                "stall_total_s": self.stall_total, "persists": self.persists, "commits": self.commits,
                "bytes_written": self.bytes_written}
            if self.stalls:
                out["stall_s"] = self.stall_last or 0.0
                out["stall_median_s"] = statistics.median(self.stalls)
            if self.committed is not None:
                out["committed_step"] = self.committed
            if self.latency is not None:
                out["commit_latency_s"] = self.latency
            if self.persist_seconds is not None:
                out["persist_s"] = self.persist_seconds
        cost, step = self.budget.measured()
        cadence = self.budget.cadence()
        out["loss_bound_steps"] = cadence.bound
        out["snapshot_every"] = cadence.every
        if cost is not None and step is not None:
            out["snapshot_cost_s"] = cadence.cost
            out["stall_per_step_s"] = cadence.per_step
            out["overhead"] = cadence.overhead
        return {PREFIX + k: float(v) for k, v in out.items()}

    def finish(self, step: Optional[int]) -> None:
        """The end of training: ``step`` committed by finalize (None: none was); the figures go to the audit log
        (a ``metrics`` event, every rank) and rank 0's console says the summary line."""
        if step is not None:
            with self._lock:
                self._committed(step, None, None)
        values = self.values()
        self.log.record("metrics", rank=self.rank, **{k[len(PREFIX):]: v for k, v in values.items()})
        if self.rank == 0:
            self.summary = summary_line(values)
            console.info(self.summary)


def summary_line(values: Dict[str, float]) -> str:
    """``run summary: newest committed step 30; 30 snapshots (0 skipped), stall 12.10 ms in all, median 0.38 ms;
    1 persist, 120 KiB written``"""
    def get(name: str) -> Optional[float]:
        return values.get(PREFIX + name)

    committed = get("committed_step")
    snaps, skipped, persists = int(get("snapshots") or 0), int(get("snapshots_skipped") or 0), int(get("persists") or 0)
    median = get("stall_median_s")
    stall = f"stall {1e3 * (get('stall_total_s') or 0.0):.2f} ms in all" + (
        f", median {1e3 * median:.2f} ms" if median is not None else "")
    return (f"run summary: newest committed step {'none' if committed is None else int(committed)}; "
            f"{snaps} snapshot{'' if snaps == 1 else 's'} ({skipped} skipped), {stall}; "
            f"{persists} persist{'' if persists == 1 else 's'}, {human(get('bytes_written') or 0)} written")
