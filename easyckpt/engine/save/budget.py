"""How often a memory snapshot is taken, so that what it costs the training loop stays within a share of
the step time (``Config.max_overhead``), and the loss bound that results.

What a snapshot costs is measured as the user measures it, on the step time. ``maybe_save`` runs once per
step; the time from one call to the next is one step as the training loop sees it. A step that began with
a snapshot holds all of its cost: collecting the state, flattening it, the copy, the bookkeeping, the
persist request, a background copy's competition for cores and the optimizer's wait for it. So

    cost of a snapshot = (median(steps after a snapshot) - median(plain steps))
                       + (median(steps one later) - median(plain steps))

where a plain step is one two or more steps past the last snapshot. Part of a snapshot's cost lands in the step
after the one that took it (the HF Trainer, tiny GPT-2: 2.8-3.9 ms in the first, 0.2-0.7 ms in the next, the
caches and allocator its pickling disturbed); counted as plain, that step took its share off the cost instead of
adding it, and the cadence chosen on those figures cost the loop about 4 % against a budget of 2 %. Where no step is
two past a snapshot (every step or every other one snapshotted) the steps after none are the plain ones,

and never less than what the cadence cost since the last agreement by a stopwatch's means (``since_agreed``; steps
OUTLIER times the usual one left out): the medians of the HF Trainer's steps after a snapshot said a fifth less than
their means (3.8 against 4.7 ms); nor less than the median time the save calls that snapshotted took: that much the
training thread surely paid (on a loaded machine the difference of the medians fell to half of it, and the cadence
then cost 5 % of the step time against a budget of 2 %).

and the snapshot is taken every ``every`` steps, the smallest multiple of ``save_mem_interval`` for which
cost / (every x step) <= max_overhead. A crash then loses at most ``every - 1`` completed steps.

Every rank must snapshot the same steps (a resume from memory needs one step that every rank holds), so the
phases and ``every`` change only at agreement steps, the same on every rank (multiples of ``spacing``: 16
steps until the cadence is decided, then as many as take about RESTATE_SECONDS, agreed too); there the
ranks gather their figures and the costliest rank's wish wins. Between them each rank decides alone, from
the step number only.

    WARMUP   a snapshot at every opportunity (save_mem_interval), as without a budget, until every rank has
             trained WARMUP_SECONDS: the first steps (allocator, caches, the slots' first touch) cost what
             steady ones do not
    MEASURE  every third step is snapshotted (with save_mem_interval=1; every 4th with 2; every opportunity
             from 3 on): the steps in between are the one after a snapshot and the plain one the cost is
             measured against
    STEADY   every ``every`` steps; when that is every step, one in PROBE_EVERY is skipped so that the plain
             step is still measured (the loss bound is then one step, said so)

The storage persists are paced too, when the user left ``save_storage_interval`` at its default: what the
agent's writing costs the loop is measured on the steps that run beside it, and their spacing is agreed at the
same steps (persistpace.py).

``max_overhead=None``: no budget; a snapshot on every opportunity, exactly as asked, and the steps are still
measured for the accounting where plain ones exist (save_mem_interval > 1).
"""
from __future__ import annotations

import collections
import enum
import math
import statistics
from dataclasses import dataclass
from typing import Deque, Optional, Sequence, Tuple

from easyckpt import console
from easyckpt.engine.save.persistpace import PERSIST_SHARE, PersistPace
from easyckpt.engine.seams import Group
from easyckpt.storage.auditlog import AuditLog

WARMUP_SECONDS = 2.0
PROBE_EVERY = 16
WINDOW = 33               # the most recent steps of each kind the medians are taken over
MIN_SAMPLES = 15         # steps of each kind a cadence is decided on (the medians of fewer swung 20 % under load)
OUTLIER = 4.0            # a step this many times the usual one is left out of the stopwatch's means (a full garbage
#                          collection of the Trainer's heap: 150 ms in a 12 ms step)
INFO_EVERY = 64
RELAX = 2                 # ``every`` is lowered only when the budget allows this many times fewer steps


class Phase(enum.Enum):
    WARMUP = "warmup"
    MEASURE = "measure"
    STEADY = "steady"


# the steps the ranks agree at: every FIRST_SPACING steps until the cadence is decided (measuring starts soon
# after WARMUP_SECONDS), then every power of two of steps nearest RESTATE_SECONDS, within MAX_SPACING (each
# agreement is a collective: about a millisecond); twice as far apart at each agreement up to that while the
# snapshots are taken on every opportunity
FIRST_SPACING = 16
RESTATE_SECONDS = 30.0
MAX_SPACING = 1024


# one rank's figures at an agreement step: (warmed up, the ``every`` it wants or 0 when it cannot say yet,
# cost of a snapshot in seconds, plain step in seconds, the persists' spacing it wants or 0); plain values, for
# the ranks' all_gather
Vote = Tuple[bool, int, float, float, int]


@dataclass(frozen=True)
class Cadence:
    """What the budget decided, for the console, the audit log and the snapshot's info (easyckpt status)."""

    every: int             # steps between snapshots
    cost: float            # seconds one snapshot costs the training loop (measured; 0 when not yet)
    step: float            # seconds of a step without one (measured; 0 when not yet)
    budget: Optional[float]
    probing: bool          # one snapshot in PROBE_EVERY is skipped to keep measuring
    rate: float = 0.0      # snapshots per step since the last agreement, persists included (0: not counted yet)
    persist_every: Optional[int] = None    # steps between storage persists, each also a snapshot (None: not known)
    persist_paced: bool = False            # that spacing is the budget's (save_storage_interval left at its default)

    @property
    def bound(self) -> int:
        """Completed steps a crash loses at most (a persisted step is a snapshot too)."""
        gap = min(self.every, self.persist_every or self.every)
        return gap if self.probing else gap - 1

    @property
    def overhead(self) -> float:
        """Share of step time the snapshots cost, on average per step."""
        return self.per_step / self.step if self.step > 0 else 0.0

    @property
    def per_step(self) -> float:
        """Seconds the snapshots cost each step, on average: what a stopwatch adds to the step time."""
        rate = self.rate or ((PROBE_EVERY - 1) / PROBE_EVERY if self.probing else 1.0) / self.every
        return self.cost * rate

    def to_info(self) -> dict:
        return {"every": self.every, "cost": round(self.cost, 6), "step_seconds": round(self.step, 6),
                "per_step": round(self.per_step, 6), "overhead": round(self.overhead, 5), "bound": self.bound,
                "budget": self.budget, "persist_every": self.persist_every, "persist_paced": self.persist_paced}

    def words(self) -> str:
        """The console's line: what a snapshot costs and what a crash can lose."""
        steps = "every step" if self.every == 1 else f"every {self.every} steps"
        lose = f"{self.bound} step" + ("" if self.bound == 1 else "s")
        cost = (f"each costs {self.cost * 1e3:.2f} ms of a {self.step * 1e3:.2f} ms step "
                f"({self.overhead:.1%} of step time; max_overhead={self.budget:g})" if self.budget is not None
                else f"each costs {self.cost * 1e3:.2f} ms of a {self.step * 1e3:.2f} ms step")
        probe = f" (one in {PROBE_EVERY} is skipped to keep measuring)" if self.probing else ""
        store = (f"save_storage_interval left at its default: {self.persist_every} now" if self.persist_paced
                 else f"save_storage_interval={self.persist_every}")
        if self.persist_every and self.every % self.persist_every == 0 and self.every > 1:
            steps, probe = (f"every {self.persist_every} steps", f" (the storage persists alone, {store})")
        paced = (f"; storage persists every {self.persist_every} steps, spaced so that the agent's writing costs "
                 f"at most {self.budget * PERSIST_SHARE:.1%} of step time ({store})"
                 if self.persist_paced and self.budget is not None else "")
        return f"snapshots {steps}{probe}: {cost}; a crash loses at most {lose}{paced}"


class SnapshotBudget:
    """The cadence of one rank's memory snapshots; see the module docstring."""

    def __init__(self, floor: int, budget: Optional[float], persist_every: Optional[int] = None,
                 pace: Optional[PersistPace] = None):
        """``persist_every``: the steps between the storage persists ``maybe_save`` takes by itself (each is
        also a snapshot, never skipped); None when the framework decides them. ``pace``: their spacing when the
        budget decides it (save_storage_interval left at its default)."""
        self.floor, self.budget, self.persist_every, self.pace = floor, budget, persist_every, pace
        self.phase = Phase.WARMUP if budget is not None else Phase.STEADY
        self.every = floor
        self.first: Optional[int] = None           # the first step this process saved at
        self.rate = 0.0                            # snapshots per step over the last agreement's window
        self._started = 0.0
        self._last: Optional[float] = None         # when the previous step's save began
        self._ticked: Optional[int] = None         # the step of that save
        self._agreed_at: Optional[int] = None      # the step of the last agreement (once per step, however
        #                                            many saves it has)
        self._after_snapshot = False               # whether the previous step took a snapshot
        self._gap = 2                              # steps since the one that held the last snapshot (0), at most 2
        self.plain: Deque[float] = collections.deque(maxlen=WINDOW)    # every step after none
        self.snap: Deque[float] = collections.deque(maxlen=WINDOW)
        self.next: Deque[float] = collections.deque(maxlen=WINDOW)     # the steps one after a snapshot's
        self.clean: Deque[float] = collections.deque(maxlen=WINDOW)    # two or more after it
        self.paid: Deque[float] = collections.deque(maxlen=WINDOW)     # the save calls that snapshotted
        self._now = 0.0
        self._steps = self._taken = 0              # since the last agreement: the rate of snapshots
        self._outlier = math.inf                   # steps longer than this are left out of those means
        self._sums = [0.0, 0, 0.0, 0, 0.0, 0, 0.0, 0]  # since the last agreement, seconds and count of the steps
        #                                            after a snapshot, after none, one later, two or more later:
        #                                            the stopwatch's means
        self._said: Optional[int] = None           # the ``every`` rank 0's console last said
        self._said_persist: Optional[int] = None   # and the persists' spacing
        self._info: Optional[dict] = None
        self.spacing = FIRST_SPACING               # steps between agreements (agreed: the same on every rank)

    # ---- every step ----------------------------------------------------------------------------

    def tick(self, step: int, now: float) -> None:
        """A save began at ``step``: the step that just ended is one sample of its kind. A second call at the same
        step is no step (the HF Trainer's save hook runs again at an epoch's end): nothing is measured."""
        if step == self._ticked:
            return
        self._ticked = step
        if self.first is None:
            self.first, self._started = step, now
        elif self._last is not None and now > self._last:
            took = now - self._last
            if self._after_snapshot:
                self._gap = 0
                kinds: Tuple[int, ...] = (0,)
                self.snap.append(took)
            else:
                self._gap = min(2, self._gap + 1)
                kinds = (1, 2) if self._gap == 1 else (1, 3)
                self.plain.append(took)
                (self.next if self._gap == 1 else self.clean).append(took)
            if self.pace is not None:
                self.pace.step(now, took, self._after_snapshot)
            if took <= self._outlier:
                for k in kinds:
                    self._sums[2 * k] += took
                    self._sums[2 * k + 1] += 1
        self._last, self._after_snapshot, self._now = now, False, now
        self._steps += 1

    def took(self) -> None:
        """This step took a snapshot (or tried to: a skip for full slots costs most of one)."""
        self._after_snapshot = True
        self._taken += 1

    def took_for(self, seconds: float) -> None:
        """The save call of the snapshot ``took`` announced ended, ``seconds`` after it began."""
        self.paid.append(seconds)

    def due(self, step: int) -> bool:
        """Whether ``step`` is snapshotted (storage persists and SIGTERM saves never ask: always taken)."""
        if step % self.floor:
            return False
        if self.budget is None or self.phase is Phase.WARMUP:
            return True
        if self.phase is Phase.MEASURE:     # a step after each snapshot's next one, plain (the module docstring)
            return step % (self.floor * math.ceil(3 / self.floor)) == 0
        if step % self.every:
            return False
        return not (self.every == 1 and step % PROBE_EVERY == PROBE_EVERY - 1)

    # ---- agreement steps -----------------------------------------------------------------------

    def agreement_due(self, step: int) -> bool:
        """Whether the ranks gather their figures at ``step``: a multiple of the current phase's spacing (the
        phase is agreed, so the same steps on every rank, whichever step each process started at)."""
        if self.budget is None or self.first is None or step == self.first or step == self._agreed_at:
            return False
        return step % self.spacing == 0

    def vote(self) -> Vote:
        warm = self._now - self._started >= WARMUP_SECONDS
        cost, step = self.measured()
        want = self._wanted(cost, step) if (self.phase is not Phase.WARMUP and cost is not None
                                            and step is not None) else 0
        persist = self.pace.want(self._now) if self.pace is not None and self.phase is not Phase.WARMUP else 0
        return warm, want, cost or 0.0, step or 0.0, persist

    def agree(self, votes: Sequence[Vote]) -> Tuple[Optional[Cadence], bool]:
        """Apply every rank's figures: (the cadence from now on, whether rank 0's console says it); no cadence
        while warming up or measuring. Said once when the budget spaces snapshots out (every > save_mem_interval),
        and again only when that spacing changes by RELAX times or more."""
        rate = self._taken / self._steps if self._steps else 0.0
        self._agreed_at = self._ticked
        self._restart_stopwatch()
        self._info = None
        persist_before = self.persist_every
        if self.pace is not None:
            if self.phase is not Phase.WARMUP:
                self.pace.agree([int(v[4]) if len(v) > 4 else 0 for v in votes])
            if self.persist_every is not None:      # None: the framework decides the persists (maybe_save)
                self.persist_every = self.pace.every
        if self.phase is Phase.WARMUP:
            if all(v[0] for v in votes):
                self.phase = Phase.MEASURE
                for window in (self.plain, self.snap, self.next, self.clean, self.paid):
                    window.clear()
            return None, False
        wants = [v[1] for v in votes]
        if not all(wants):
            return None, False
        want = max(wants)
        first = self.phase is Phase.MEASURE
        self.phase = Phase.STEADY
        # more steps between snapshots at once (the budget is kept); fewer only when it is much cheaper
        changed = first or want > self.every or want * RELAX <= self.every
        if changed:
            self.every = want
        # the rate measured since the last agreement is that of this cadence, unless it or the persists' spacing
        # just changed (the persists are snapshots too: a line said "3.4% of step time" at 1.8 % once they moved
        # from every 20 steps to every 240, the window's rate still counting them every 20)
        self.rate = 0.0 if changed or self.persist_every != persist_before else rate
        costliest = max(votes, key=lambda v: v[2] / v[3] if v[3] else 0.0)
        slowest = max(v[3] for v in votes)
        if slowest > 0:
            near = 2 ** round(math.log2(max(1.0, RESTATE_SECONDS / slowest)))
            target = min(MAX_SPACING, max(FIRST_SPACING, near))
            # a snapshot on every opportunity costs the most if the figures lied (measured while the machine was
            # disturbed, it kept a snapshot every step at x1.6 for RESTATE_SECONDS): then the spacing doubles
            # towards the target, and the cadence is looked at again within a few hundred steps. Once spaced
            # out, not sooner: each look may raise ``every`` at once, and noise near a boundary would ratchet it
            # so too while the persists' spacing is being found (each look doubles it at most)
            unsettled = self.every == self.floor or (self.pace is not None and self.pace.unsettled)
            self.spacing = min(target, 2 * self.spacing) if unsettled else target
        said = self._said
        say = changed and ((said is None and self.every > self.floor) or
                           (said is not None and (self.every >= RELAX * said or RELAX * self.every <= said)))
        if say:
            self._said = self.every
        # the persists' spacing is said when the budget first takes it RELAX times past its floor, then again
        # when it changes that much (it may have changed while the snapshots' cadence was still being measured)
        pace = self.pace
        if pace is not None and ((pace.floor if self._said_persist is None else self._said_persist) * RELAX
                                 <= pace.every or pace.every * RELAX <= (self._said_persist or 0)):
            say, self._said_persist = True, pace.every
        return self._cadence(costliest[2], costliest[3]), say

    def _restart_stopwatch(self) -> None:
        """since_agreed's sums begin again, leaving out the steps far longer than the usual ones now."""
        self._steps = self._taken = 0
        self._sums = [0.0, 0, 0.0, 0, 0.0, 0, 0.0, 0]
        usual = [statistics.median(w) for w in (self.snap, self.plain) if len(w) >= MIN_SAMPLES]
        self._outlier = OUTLIER * max(usual) if usual else math.inf

    # ---- figures -------------------------------------------------------------------------------

    def measured(self) -> Tuple[Optional[float], Optional[float]]:
        """(seconds one snapshot costs, seconds of a plain step), None where too few steps were seen."""
        step = statistics.median(self.plain) if len(self.plain) >= MIN_SAMPLES else None
        if step is None or len(self.snap) < MIN_SAMPLES:
            return None, step
        paid = statistics.median(self.paid) if len(self.paid) >= MIN_SAMPLES else 0.0
        # what the cadence cost since the last agreement, by the means a stopwatch adds up, when that says more:
        # the medians of the HF Trainer's steps after a snapshot said a fifth less than their means, and the cadence
        # chosen on them cost 2.4 % of step time against max_overhead=0.02 by the job's own stopwatch
        since = self.since_agreed()
        if since is not None:
            paid = max(paid, since.cost)
        cost = statistics.median(self.snap) - step
        # (snapshots every step or every other one leave no plain step: the windows would hold stale ones)
        spaced = self.phase is Phase.MEASURE or self.every >= 3
        if spaced and len(self.next) >= MIN_SAMPLES and len(self.clean) >= MIN_SAMPLES:
            step = statistics.median(self.clean)
            cost = statistics.median(self.snap) - step + statistics.median(self.next) - step
        return max(0.0, cost, paid), step

    def cadence(self) -> Cadence:
        cost, step = self.measured()
        return self._cadence(cost or 0.0, step or 0.0)

    def since_agreed(self) -> Optional[Cadence]:
        """What the snapshots cost since the cadence was last agreed, as a stopwatch sees it: the mean step after
        a snapshot against the mean step after none, over every step of the steady cadence, at the rate they
        were taken. (An agreement's figures are medians of the recent steps, the first measured while every
        other step took a snapshot, which may cost more than further apart.) None: no budget, not steady yet,
        or too few steps of either kind."""
        snap, snaps, plain, plains, nxt, nexts, clean, cleans = self._sums
        if self.budget is None or self.phase is not Phase.STEADY or not self._steps:
            return None
        if snaps < MIN_SAMPLES or plains < MIN_SAMPLES:
            return None
        cost, step = max(0.0, snap / snaps - plain / plains), plain / plains
        # what each step past a snapshot paid more than a plain one
        if nexts >= MIN_SAMPLES and cleans >= MIN_SAMPLES:
            step = clean / cleans
            cost = max(0.0, snap / snaps - step + (nxt / nexts - step) * nexts / snaps)
        probing = self.every == 1
        return Cadence(self.every, cost, step, self.budget, probing, self._taken / self._steps, self.persist_every,
                       self.paced)

    def info(self) -> dict:
        """cadence().to_info(), recomputed every INFO_EVERY steps only (each snapshot records it; the medians
        cost more than a tiny snapshot's copy)."""
        if self._info is None or self._steps % INFO_EVERY == 0:
            self._info = self.cadence().to_info()
        return self._info

    @property
    def paced(self) -> bool:
        """Whether the persists' spacing is the budget's (persistpace.py), not the user's or the framework's."""
        return self.pace is not None and self.persist_every is not None

    def _cadence(self, cost: float, step: float) -> Cadence:
        probing = self.budget is not None and self.phase is Phase.STEADY and self.every == 1
        return Cadence(self.every, cost, step, self.budget, probing, self.rate, self.persist_every,
                       self.paced)

    def _wanted(self, cost: float, step: float) -> int:
        assert self.budget is not None
        if step <= 0:
            return self.floor
        steps = max(1, math.ceil(cost / (self.budget * step) - 1e-9))
        every = self.floor * math.ceil(steps / self.floor)
        # at least as far apart as the persists: a snapshot for memory alone between two of them would cost
        # and bound nothing, so the snapshots are the persists alone
        if self.persist_every and every >= self.persist_every:
            every = self.persist_every * math.ceil(every / self.persist_every)
        return every



def agree_ranks(budget: SnapshotBudget, group: Group, log: AuditLog, rank: int, step: int) -> None:
    """An agreement step: every rank's figures gathered, one cadence for all; recorded in the audit log (the
    ``budget`` event), said on rank 0's console when it changed a lot."""
    try:
        votes = group.all_gather(budget.vote())
    except Exception as exc:  # noqa: BLE001 - a rank is gone: keep the cadence; the next collective says why
        log.emit("warning", rank=rank, message=f"no agreement on the snapshot cadence ({exc})")
        return
    told, say = budget.agree([tuple(v) for v in votes])
    if told is not None:
        log.record("budget", step=step, rank=rank, **told.to_info())
        if say:
            console.info(told.words())


def record_last(budget: SnapshotBudget, log: AuditLog, rank: int, step: Optional[int]) -> None:
    """At the job's end: what the snapshots cost since the cadence was last agreed (SnapshotBudget.since_agreed),
    in the audit log: a ``budget`` event with ``last``."""
    told = budget.since_agreed()
    if told is not None and step is not None:
        log.record("budget", step=step, rank=rank, last=True, **told.to_info())
