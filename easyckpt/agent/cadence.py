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
k doubles until there are some. A snapshot that is skipped is not lost to anyone: the next send carries
the newest.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Deque, Optional, Tuple

BUDGET = 0.03       # the share of step time replication may cost on average (the target: 3 %)
MAX_EVERY = 64      # never fewer than one replica per this many snapshots
WINDOW = 48         # snapshot gaps kept
MIN_CLEAN = 3       # clean gaps needed before a send's cost is judged


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

    def look(self, now: float, newest: Optional[int], sending: bool, receiving: bool = False) -> None:
        """One look at the slots: ``newest`` is the generation of a local rank's newest complete snapshot;
        ``sending`` / ``receiving``: whether a replica is being sent / received at this moment."""
        self._busy = self._busy or sending or receiving
        if newest is None or newest == self._newest:
            return
        if self._newest is not None and self._since is not None:
            self._gaps.append((self._since, now - self._since, self._busy))
            self._gaps_since_change += 1
            if self._ended:
                self._ended = False
                self._decide()
        self._newest, self._since, self._busy = newest, now, sending or receiving

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
        if transfer < everything and transfer / (everything - transfer) <= self.budget:
            self.cost = transfer / (everything - transfer)
            self._set(1)
            return
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

    def _set(self, every: int) -> None:
        if every != self.every:
            self.every, self._gaps_since_change = every, 0
