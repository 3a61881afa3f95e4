"""Refused connections on the peer port, counted by kind (docs/reliability.md promise 13).

Anyone who reaches the port can connect, so a stranger decides how many refusals there are and what bytes
each carries. A refusal is therefore said by its kind ("not JSON", "slow handshake", "wrong secret", ...,
never the sender's bytes beyond peerwire.QUOTE escaped characters): the first of each kind in a PERIOD is
said whole, the rest are counted, and one summary line per PERIOD gives the counts. However many
connections come, the log gets at most (kinds + 1) lines a minute.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional

PERIOD = 60.0


class PeerRefusals:
    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.clock = say, clock
        self._lock = threading.Lock()     # the accept thread and every connection's thread refuse
        self._since = clock()
        self._said: Dict[str, int] = {}   # kind -> refusals of this period (the first one was said whole)
        self.total = 0

    def __call__(self, kind: str, message: str) -> None:
        summary = self._roll()
        with self._lock:
            self.total += 1
            first = kind not in self._said
            self._said[kind] = self._said.get(kind, 0) + 1
        if summary:
            self.say(summary)
        if first:
            self.say(message)

    def flush(self) -> None:
        """Say the summary of a period that is over (called now and then: a flood that stopped is still told)."""
        summary = self._roll()
        if summary:
            self.say(summary)

    def _roll(self) -> Optional[str]:
        now = self.clock()
        with self._lock:
            if now - self._since < PERIOD:
                return None
            counts, seconds = self._said, now - self._since
            self._said, self._since = {}, now
        more = sum(counts.values()) - len(counts)       # the first of each kind was said already
        if not more:
            return None
        return (f"refused {sum(counts.values())} replica connection(s) in the last {seconds:.0f} s: "
                + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())))
