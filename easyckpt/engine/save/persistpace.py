"""How often the storage persists run when the user left ``save_storage_interval`` at its default: every
``config.storage_interval`` steps (5, as before this existed), and further apart when the agent's writing costs the training loop
more than its share of the budget (``Config.max_overhead`` x PERSIST_SHARE). An interval the user set, or a
framework's own save points, are kept exactly: a persist asked for is never skipped for the budget.

A persist's cost is not on the step that asks for it. The agent (another process) writes the snapshot while
training goes on, and the loop pays in the steps that run beside the write: the cores, the memory bus, and on a
VM the host serving the disk writes on the vCPUs' time (writing pt10's 14.7 MB every 50 ms cost that loop
x1.46 with no easyckpt code in its process: benchmarks/bench_disk_share.py). So, from the step times the
snapshot budget already takes:

    busy     from each persist's start, its request or the end of the write before it (the agent writes one
             after the other), for the seconds the agent took to write it (its status says them once the step
             commits; the median of those known stands in for one not known yet)
    duty     the share of the time the agent was busy
    cost     duty x (median step while busy / median step while not - 1), a share of the step time

(the steps after a snapshot compared among themselves, the others among themselves: with a snapshot every step,
as where it is cheap, the plain ones are only the budget's probes) and the persists are spaced so that
cost <= share: a write's seconds do not change with the spacing, so the duty, and the cost, fall as the spacing
grows. When nearly no step ran beside no write (the agent persists back to back) the cost cannot be measured: the
spacing grows at each agreement until it can, at least doubling, as far as would leave the agent idle half the
time. More steps between persists only past RAISE times as many; fewer only when the budget allows RELAX times as
many, and never so few that the agent would write more than half the time (a write that costs the loop nothing,
to a slow store, would otherwise swing the spacing between back to back and far apart); never further apart than
MAX_SECONDS of training (a node lost loses at most that from storage; its memory and peers' replicas are not
affected).
The spacing is agreed at the snapshot budget's agreement steps (budget.py), so every rank persists the same steps.
"""
from __future__ import annotations

import bisect
import math
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

PERSIST_SHARE = 0.5        # of max_overhead, for the agent's writing; the snapshots have their own budget
SATURATED = 0.5            # duty at or above which, with no steps beside no write, the spacing grows; at most this
MIN_SAMPLES = 15           # steps of each kind the cost is measured on
MAX_SECONDS = 600.0        # of training between persists at most
RELAX = 2                  # fewer steps between persists only when the budget allows this many times more
RAISE = 1.25               # more only past this many times (a few percent of noise would move them at every look)
KEEP_REQUESTS = 4096       # requests and steps kept until a decision (memory bounded)
KEEP_STEPS = 16384

Kinds = Tuple[List[float], List[float]]     # step seconds: (without a snapshot, after one)


class PersistPace:
    """One rank's view of what the storage persists cost its loop, and the spacing agreed; see the module
    docstring. ``floor``: the spacing they start at, a multiple of ``save_mem_interval`` (only memory snapshots
    can be persisted). ``written``: the seconds the agent took to write recent persisted steps, by step
    (AgentView's reports; read, never asked)."""

    def __init__(self, save_mem_interval: int, floor: int, budget: float, written: Callable[[], Dict[int, float]]):
        self.mem, self.floor = save_mem_interval, floor
        self.share = budget * PERSIST_SHARE
        self.every = self.floor
        # the spacing is not found yet, or the last agreement changed it: the snapshot budget's agreements come
        # twice as far apart each time (budget.py), not RESTATE_SECONDS apart at once
        self.unsettled = True
        self._found = False
        self._written = written
        self._asked: List[Tuple[int, float]] = []   # (step, when its persist was requested), recent ones
        # (when it ended, seconds, whether a snapshot began it) of the steps since the samples began
        self._steps: List[Tuple[float, float, bool]] = []
        self._since: Optional[float] = None         # when the samples began

    def requested(self, step: int, now: float) -> None:
        self._asked.append((step, now))
        del self._asked[:-KEEP_REQUESTS]

    def step(self, end: float, seconds: float, snapshot: bool) -> None:
        """A step ended at ``end`` after ``seconds``; ``snapshot``: it began with one."""
        if len(self._steps) >= KEEP_STEPS:
            self._restart()
        if self._since is None:
            self._since = end - seconds
        self._steps.append((end, seconds, snapshot))

    def _restart(self) -> None:
        """Measure afresh; the two newest requests stay (their writes may still be running)."""
        self._steps, self._since = [], None
        del self._asked[:-2]

    # ---- agreement steps -----------------------------------------------------------------------

    def want(self, now: float) -> int:
        """The spacing this rank's figures ask for: measured, or negative where only guessed (the agent
        persisting back to back); 0 when they cannot say yet."""
        measured = self.measured(now)
        if measured is None:
            return 0
        duty, write, busy, free = measured
        every_busy, every_free = busy[0] + busy[1], free[0] + free[1]
        kinds = [k for k in (0, 1) if len(busy[k]) >= MIN_SAMPLES and len(free[k]) >= MIN_SAMPLES]
        if kinds:
            # how much longer a step beside a write takes, each kind against its own, weighted by their numbers
            slower = sum(len(busy[k]) * (statistics.median(busy[k]) / statistics.median(free[k]) - 1)
                         for k in kinds) / sum(len(busy[k]) for k in kinds)
            share = duty * max(0.0, slower)
        elif len(every_free) < MIN_SAMPLES:
            if duty < SATURATED or len(every_busy) < MIN_SAMPLES:
                return 0
            # far enough apart that the agent would be idle half the time, at least twice as far
            step = statistics.median(every_busy)
            return -self._fit(max(2 * self.every, math.ceil(write / (SATURATED * step))), step)
        elif duty < self.share:
            # too few steps ran beside a write to measure them (short writes): even slowing those by a whole step,
            # more than any measured (x1.46 at pt10 on 2 vCPUs), the writes cost less than their share
            share = duty
        else:
            return 0
        step = statistics.median(every_free)
        # never so close that the agent would be busy more than half the time: persisting back to back it keeps
        # up no better, while the snapshots whose slots it holds are skipped (and a look then measures nothing)
        least = math.ceil(write / (SATURATED * step))
        return self._fit(max(least, math.ceil(self.every * share / self.share - 1e-9)), step)

    def agree(self, wants: Sequence[int]) -> bool:
        """Apply every rank's wish (the largest wins); True when the spacing changed. Every rank decides alike
        from the same wishes, ``unsettled`` too: it sets when the ranks agree next (budget.py)."""
        want = max((abs(w) for w in wants), default=0)
        changed = bool(want) and (want >= self.every * RAISE or want * RELAX <= self.every)
        # found once a look measured the cost (not the guess for a saturated agent, not "cannot say yet")
        self._found = self._found or any(w > 0 for w in wants)
        if changed:
            self.every = want
        if want:                         # decided on these samples: the next decision measures afresh
            self._restart()
        self.unsettled = changed or not self._found
        return changed

    def measured(self, now: float) -> Optional[Tuple[float, float, Kinds, Kinds]]:
        """(duty, a write's typical seconds, the steps beside a write, the steps beside none) since the samples
        began, each as (steps without a snapshot, steps after one); None before any write's seconds are known."""
        since = self._since
        known = self._written()
        # a duty needs the samples to span whole spacings: at least two persists asked since they began
        if since is None or now <= since or not known or sum(at >= since for _, at in self._asked) < 2:
            return None
        typical = statistics.median(known.values())
        spans = _serial([(at, known.get(step, typical)) for step, at in self._asked])
        busy_time = sum(max(0.0, min(b, now) - max(a, since)) for a, b in spans)
        starts = [a for a, _ in spans]
        busy: Kinds = ([], [])
        free: Kinds = ([], [])
        for end, seconds, snapshot in self._steps:
            mid = end - seconds / 2
            i = bisect.bisect_right(starts, mid) - 1
            (busy if i >= 0 and mid < spans[i][1] else free)[snapshot].append(seconds)
        return busy_time / (now - since), typical, busy, free

    def _fit(self, steps: int, step: Optional[float] = None) -> int:
        """``steps`` as a spacing: a multiple of the floor (so of save_mem_interval; persisted steps stay 5, 10,
        ... 1760, 3520), at most MAX_SECONDS of training (when the step time is known)."""
        every = self.floor * max(1, math.ceil(steps / self.floor))
        if step:
            every = min(every, self.floor * max(1, int(MAX_SECONDS / step / self.floor)))
        return every


def _serial(writes: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The agent's busy spans from (requested at, write seconds): it writes one persist after the other, so a
    request that finds it busy starts when the previous write ends; touching spans are joined."""
    out: List[Tuple[float, float]] = []
    for at, seconds in sorted(writes):
        if out and at <= out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + seconds)
        else:
            out.append((at, at + seconds))
    return out
