"""How often to send replicas so that they cost training at most a budget of its step time, measured.

Replication shares the node with training: CPU for the copies, memory bandwidth, the network. On a node
whose host CPU idles while the accelerators train, a send costs nothing measurable and every snapshot is
replicated; on a node whose CPUs are busy with training itself, each send slows the steps it overlaps.
The sender cannot ask the trainers how long their steps take, but it sees their snapshots land (a slot's
generation moves on) and knows when it was sending, so it measures the gaps between snapshots:

  clean gaps        no send ran during them: the step time as training has it without replication;
  overlapped gaps   a send ran during them: longer by whatever the send cost.

The cost of one send, in snapshot gaps, is what its overlapped gaps took beyond the median clean gap,
divided by that median (the median over the recent sends), and never more than the send lasted: a send
cannot take more time from training than it runs, which keeps the noise of step times from throttling sends
of a few milliseconds. Sending every k-th snapshot slows training by c / k on average, so the sender sends
every k = ⌈c / budget⌉ snapshots (1 when sends cost nothing; at most MAX_EVERY). Without clean gaps to
compare with (every gap overlapped: sends as long as the steps), k doubles until there are some. A snapshot
that is skipped is not lost to anyone: the next send carries the newest.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Deque, List, Optional, Tuple

BUDGET = 0.03       # the share of step time replication may cost on average (the target: 3 %)
MAX_EVERY = 64      # never fewer than one replica per this many snapshots
WINDOW = 32         # snapshot gaps kept
SENDS = 8           # sends kept (their cost is the median of these)
MIN_CLEAN = 3       # clean gaps needed before a send's cost is judged


class Cadence:
    def __init__(self, budget: float = BUDGET, max_every: int = MAX_EVERY):
        self.budget, self.max_every = budget, max_every
        self.every = 1
        self.cost: Optional[float] = None               # the last measured cost of one send, in gaps
        self._gaps: Deque[Tuple[float, bool]] = collections.deque(maxlen=WINDOW)   # (seconds, overlapped)
        self._sends: Deque[Tuple[List[float], float]] = collections.deque(maxlen=SENDS)   # (its gaps, seconds)
        self._newest: Optional[int] = None
        self._since: Optional[float] = None
        self._overlapped = False
        self._open: Optional[List[float]] = None        # the gaps of the send under way (or just ended)
        self._seconds = 0.0
        self._ended = False
        self._gaps_since_change = 0

    def look(self, now: float, newest: Optional[int], sending: bool, receiving: bool = False) -> None:
        """One look at the slots: ``newest`` is the generation of a local rank's newest complete snapshot,
        ``sending`` whether a send is under way at this moment, ``receiving`` whether a peer's replica is
        being received (that gap is not clean either: the peers send right after the same steps)."""
        if sending and self._open is None:
            self._open, self._seconds, self._ended = [], 0.0, False
        self._overlapped = self._overlapped or sending or receiving
        if newest is None or newest == self._newest:
            return
        if self._newest is not None and self._since is not None:
            gap = now - self._since
            self._gaps.append((gap, self._overlapped))
            self._gaps_since_change += 1
            if self._open is not None and self._overlapped:
                self._open.append(gap)
            if self._open is not None and self._ended:     # the gap in which the send ended is over
                self._sends.append((self._open, self._seconds))
                self._open = None
                self._decide()
        self._newest, self._since, self._overlapped = newest, now, sending or receiving

    def sent(self, seconds: float) -> None:
        """A send that took ``seconds`` is over (sends of one snapshot to several holders add up)."""
        if self._open is None:
            self._open, self._seconds = [], 0.0
        self._seconds += seconds
        self._ended = True

    def _decide(self) -> None:
        seconds = statistics.mean(d for _, d in self._sends)
        everything = statistics.median(g for g, _ in self._gaps)
        if seconds < everything and seconds / (everything - seconds) <= self.budget:
            # a send cannot cost more than it lasts, and the step without it is at least a gap minus a send:
            # sends this short are within budget whatever the gaps say (no clean gaps needed to know it)
            self.cost = seconds / (everything - seconds)
            self._set(1)
            return
        clean = [g for g, o in self._gaps if not o]
        if len(clean) < MIN_CLEAN:
            if self._gaps_since_change >= WINDOW // 2:   # the last change had time to show: make room
                self._set(min(self.max_every, self.every * 2))
            return
        base = statistics.median(clean)
        if base <= 0:
            return
        self.cost = statistics.median(max(0.0, min(sum(gaps) - base * len(gaps), d)) for gaps, d in self._sends) / base
        self._set(max(1, min(self.max_every, math.ceil(self.cost / self.budget - 1e-9))))

    def _set(self, every: int) -> None:
        if every != self.every:
            self.every, self._gaps_since_change = every, 0
