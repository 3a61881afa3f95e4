"""How often to send replicas so that they cost training at most a budget of its step time, measured.

Replication shares the node with training: CPU for the copies, memory bandwidth, the network. On a node
whose host CPU idles while the accelerators train, a send costs nothing measurable and every snapshot is
replicated; on a node whose CPUs are busy with training itself, each send slows the steps it overlaps.
The sender cannot ask the trainers how long their steps take, but it sees their snapshots land (a slot's
generation moves on) and knows when it was sending or receiving, so it measures the gaps between snapshots:

  clean gaps   nothing replicated during them: the step time as training has it without replication;
  busy gaps    this node sent a replica, or received a peer's, during them: longer by what that cost.

Every node sends and receives about as much (node i holds i − jump's replicas), so a send is charged with
everything replication took from this node's training: c = Σ (busy gap − median clean gap) / median clean
gap over the recent gaps, divided by the sends among them. Sending every k-th snapshot then slows training
by c / k on average, so the sender sends every k = ⌈c / budget⌉ snapshots (1 when replication costs
nothing; at most MAX_EVERY). Sends so short that a send and a receive together stay within budget of a
step need no measurement (a transfer cannot take more time from training than it lasts): this keeps the
noise of step times from throttling them. Without clean gaps to compare with (sends as long as the steps),
k doubles until there are some.

Clean gaps between busy ones are not quite clean (measured: 6 % slower than a run without replicas, with
caches, memory and the peers' timing all shaken by the transfers next to them), so once sends cost
something the sender also holds them back for QUIET_LEN gaps every QUIET_PERIOD: those gaps are the step
time without replication, and c becomes (mean of the other recent gaps / mean quiet gap − 1) × gaps per
send, each mean over gaps capped at 3× their median (a send's cost is a mean effect; a rare stall is not). A snapshot that is skipped is not lost to anyone: the next send carries the newest.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Deque, List, Optional, Tuple

BUDGET = 0.03       # the share of step time replication may cost on average (the target: 3 %)
MAX_EVERY = 64      # never fewer than one replica per this many snapshots
WINDOW = 48         # snapshot gaps kept
MIN_CLEAN = 3       # clean gaps needed before a send's cost is judged
QUIET_AFTER = 48    # gaps before the first quiet period
QUIET_PERIOD = 160  # gaps from one quiet period to the next
QUIET_LEN = 12      # gaps without a send in each (the first QUIET_DRAIN let a transfer under way end)
QUIET_DRAIN = 2


class Cadence:
    def __init__(self, budget: float = BUDGET, max_every: int = MAX_EVERY):
        self.budget, self.max_every = budget, max_every
        self.every = 1
        self.cost: Optional[float] = None               # the last measured cost of one send, in gaps
        self._gaps: Deque[Tuple[float, float, bool]] = collections.deque(maxlen=WINDOW)  # (start, seconds, busy)
        self._sends: Deque[Tuple[float, float]] = collections.deque(maxlen=WINDOW)       # (end, seconds)
        self._newest: Optional[int] = None
        self._since: Optional[float] = None
        self._busy = False
        self._ended = False              # a send ended in the gap under way: decide when it closes
        self._gaps_since_change = 0
        self._count = 0                  # gaps closed
        self._last_pos: Optional[int] = None
        self._index: Optional[int] = None   # the number of the snapshot that began the gap under way
        self._trivial = True             # sends are too short to cost anything: no quiet periods needed
        self._quiet: Deque[float] = collections.deque(maxlen=3 * (QUIET_LEN - QUIET_DRAIN))
        self._active: Deque[Tuple[float, bool]] = collections.deque(maxlen=96)     # (seconds, a send ended)

    @property
    def quiet(self) -> bool:
        """Hold sends back now: a quiet period, whose gaps are the step time without replication."""
        return not self._trivial and self._position() is not None

    def _position(self) -> Optional[int]:
        """Where the gap under way is in a quiet period (None: not in one)."""
        at = self._count if self._index is None else self._index
        if at < QUIET_AFTER:
            return None
        pos = (at - QUIET_AFTER) % QUIET_PERIOD
        return pos if pos < QUIET_LEN else None

    def look(self, now: float, newest: Optional[int], sending: bool, receiving: bool = False,
             index: Optional[int] = None) -> None:
        """One look at the slots: ``newest`` is the generation of a local rank's newest complete snapshot;
        ``sending`` / ``receiving``: whether a replica is being sent / received at this moment; ``index``:
        that snapshot's number (step // save_mem_interval), the same on every node, so that the nodes' quiet
        periods line up (a peer sending into this node's quiet period would spoil it); None: gaps counted here."""
        self._busy = self._busy or sending or receiving
        if newest is None or newest == self._newest:
            return
        if self._newest is not None and self._since is not None:
            gap, ended = now - self._since, self._ended
            self._gaps.append((self._since, gap, self._busy))
            self._gaps_since_change += 1
            pos = self._position() if not self._trivial else None
            if pos is None:
                self._active.append((gap, ended))
            elif pos >= QUIET_DRAIN and not self._busy:    # not even a peer's replica arriving
                self._quiet.append(gap)
            self._count += 1
            self._ended = False
            if pos is None and self._last_pos is not None:     # a quiet period just ended (numbers may skip)
                self._decide_quiet()
            elif ended:
                self._decide()
            self._last_pos = pos
        self._newest, self._since, self._busy = newest, now, sending or receiving
        self._index = index

    def sent(self, now: float, seconds: float) -> None:
        """A send that took ``seconds`` ended at ``now`` (its gap is judged when it closes)."""
        self._sends.append((now, seconds))
        self._busy = self._ended = True

    def _decide(self) -> None:
        start = self._gaps[0][0]
        sends = [d for t, d in self._sends if t >= start]
        if not sends:
            return
        everything = statistics.median(g for _, g, _ in self._gaps)
        transfer = 2 * statistics.mean(sends)        # a send and a peer's receive of the same size
        self._trivial = transfer < everything and transfer / (everything - transfer) <= self.budget
        if self._trivial:
            self.cost = transfer / (everything - transfer)
            self._set(1)
            return
        if len(self._quiet) >= QUIET_LEN - QUIET_DRAIN:
            return      # measured against quiet periods now (_decide_quiet)
        clean = [g for _, g, b in self._gaps if not b]
        if len(clean) < MIN_CLEAN:
            if self._gaps_since_change >= WINDOW // 3:   # the last change had time to show: make room
                self._set(min(self.max_every, self.every * 2))
            return
        base = statistics.median(clean)
        if base <= 0:
            return
        extra = sum(g - base for _, g, b in self._gaps if b)    # unclipped: noise averages out
        self.cost = max(0.0, extra) / base / len(sends)
        self._set(max(1, min(self.max_every, math.ceil(self.cost / self.budget - 1e-9))))

    def _decide_quiet(self) -> None:
        sends = sum(1 for _, ended in self._active if ended)
        if len(self._quiet) < QUIET_LEN - QUIET_DRAIN or len(self._active) < 16 or not sends:
            return
        base = _mean(self._quiet)
        if base <= 0:
            return
        overhead = _mean([g for g, _ in self._active]) / base - 1
        self.cost = max(0.0, overhead) * len(self._active) / sends
        self._set(max(1, min(self.max_every, math.ceil(self.cost / self.budget - 1e-9))))

    def _set(self, every: int) -> None:
        if every != self.every:
            self.every, self._gaps_since_change = every, 0


def _mean(gaps: "Deque[float] | List[float]") -> float:
    """The mean of ``gaps`` with each capped at 3× their median: a send's cost is a mean effect (a few gaps
    longer, the rest not: a median would not see it), and a rare stall (a storage write, a GC) must not
    count as one."""
    cap = 3 * statistics.median(gaps)
    return statistics.mean(min(g, cap) for g in gaps)
