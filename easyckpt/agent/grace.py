"""The grace deadline after a SIGTERM: when the agent saves on its own, and when it must leave.

Order of events. A trainer that gets SIGTERM tells the agent at once (``term``, with the signal's
wall time), even when its main thread is stuck: ``notice()`` starts the clock. The trainers then agree
on a step and save it (``term_step``: ``agreed()``); its commit serves the notice (``committed()``).
If that has not happened by ``fallback_at`` — the deadline less a reserve for the write (twice the
slowest persist seen, at least a tenth of the grace) — ``due()`` says ``fallback`` once, and the agent
persists the newest snapshot complete on all its ranks itself (recovery.py). The agent's own SIGTERM
(a node shutdown) starts the same clock (``own_sigterm()``) and makes it leave as soon as its work is
done; at the deadline ``due()`` says ``leave``: the agent abandons a commit in flight (its staging dir
goes; nothing half-written is visible) and exits.

No I/O: the caller logs what the methods return. Two clocks are given: ``wall`` for the signal's time
(it comes from another process) and ``clock`` (monotonic) for the deadlines.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from easyckpt.formats.replies import SigtermStatus


@dataclass(frozen=True)
class Due:
    fallback: bool = False     # persist the newest snapshot complete on every local rank now
    leave: bool = False        # the agent's own deadline is reached: abandon what is in flight, exit


class Grace:
    def __init__(self, grace_deadline: float, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic):
        self.grace = grace_deadline
        self.wall, self.clock = wall, clock
        self.term_at: Optional[float] = None    # wall time of the SIGTERM being served
        self.term_step: Optional[int] = None    # the step the trainers agreed to save for it
        self.fallback_at = self.hard_deadline = 0.0
        self.fallback_done = False
        self.leaving = False                    # the agent itself got SIGTERM
        self.slowest_write = 0.0                # seconds of the slowest persist seen

    def wrote(self, seconds: float) -> None:
        self.slowest_write = max(self.slowest_write, seconds)

    def notice(self, at: float, who: str) -> Optional[Dict[str, Any]]:
        """A SIGTERM at wall time ``at``; the fields of the ``sigterm_notice`` event, or None when an
        earlier one is being served already."""
        if self.term_at is not None and self.term_at <= at:
            return None
        self.term_at, self.fallback_done = at, False
        reserve = max(0.1 * self.grace, 2 * self.slowest_write)
        left = at + self.grace - self.wall()
        now = self.clock()
        self.hard_deadline = now + left
        self.fallback_at = now + max(0.0, left - reserve)
        return {"source": who, "deadline_in": round(left, 3), "fallback_in": round(max(0.0, left - reserve), 3)}

    def own_sigterm(self) -> Optional[Dict[str, Any]]:
        """The agent got SIGTERM itself (once is enough); as ``notice``."""
        if self.leaving:
            return None
        self.leaving = True
        return self.notice(self.wall(), "agent")

    def agreed(self, step: int) -> None:
        self.term_step = step

    def due(self) -> Due:
        if self.term_at is None:
            return Due()
        now = self.clock()
        fallback = not self.fallback_done and now >= self.fallback_at
        self.fallback_done = self.fallback_done or fallback
        return Due(fallback, self.leaving and now >= self.hard_deadline)

    def committed(self, step: int) -> Optional[float]:
        """``step`` is committed: if that serves the SIGTERM, the seconds since the signal (and the clock
        stops, unless the agent itself is leaving); else None."""
        if self.term_at is None or self.term_step is None or step < self.term_step:
            return None
        seconds = self.wall() - self.term_at
        if not self.leaving:
            self.term_at, self.term_step = None, None
        return seconds

    def status(self) -> Optional[SigtermStatus]:
        if self.term_at is None:
            return None
        now = self.wall()
        return SigtermStatus(seconds_ago=round(now - self.term_at, 3), agreed_step=self.term_step,
                             deadline_in=round(self.term_at + self.grace - now, 3), fallback_done=self.fallback_done)
