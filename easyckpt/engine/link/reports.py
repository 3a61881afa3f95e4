"""What the agent's status tells rank 0's console: each commit, each step that cannot be committed, each
trainer the agent refused; every one said once, when the trainer first sees it in a status reply.

Status replies arrive checked (formats/replies.py: a reply with a field of the wrong shape counts as no
reply), so nothing here re-validates them.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Deque, Dict, List, Optional, Set, Tuple

from easyckpt import console
from easyckpt.formats.layout import Naming
from easyckpt.formats.replies import StatusReply
from easyckpt.storage.auditlog import AuditLog
from easyckpt.units import human


# commit lines said within BURST_SECONDS at most; the rest of such a burst (a loop of 10 ms steps persisting every 5
# steps said some 30 in its first seconds, before the persists were paced) is counted in the next line said
BURST, BURST_SECONDS = 5, 10.0


class StatusReports:
    def __init__(self, rank: int, naming: Naming, log: AuditLog, now: Callable[[], float] = time.monotonic):
        self.rank, self.naming, self.log, self.now = rank, naming, log, now
        self._said_at: Deque[float] = collections.deque(maxlen=BURST)    # when the last commit lines were said
        self._held: Optional[Tuple[int, int, float]] = None     # the newest commit not said (a burst's)
        self._quiet = 0                                         # commits not said since the last line
        self.failures: Set[int] = set()
        self.refusals = 0
        self.notices = 0
        self.said_commit = -1          # the newest step whose commit was said
        self.started_at = -1           # commits of steps before this run's first request are not ours
        self.newest = -1               # the newest step handed to the agent
        self.announced = -1            # the newest step a console line said was being saved (SIGTERM)
        self.starved: Set[int] = set()   # holder nodes this node's replicas do not reach, as said
        self.persist_seconds: Dict[int, float] = {}   # recent commits' persist times by step, on every rank

    def requested(self, step: int) -> None:
        if self.started_at < 0:
            self.started_at = step
        self.newest = max(self.newest, step)

    def announce(self, step: int) -> None:
        """A console line has just said that ``step`` is being saved (SIGTERM: saving step 9)."""
        self.announced = max(self.announced, step)

    def waiting(self, newest_requested: int) -> bool:
        """A commit not yet said may be on its way (rank 0 asks the agent about it now and then); a step the
        agent failed will not commit, so nothing is awaited for it."""
        return self.rank == 0 and newest_requested > self.said_commit and newest_requested not in self.failures

    def take(self, status: StatusReply) -> None:
        self._commits(status)
        self._failures(dict(status.failed_steps))
        self._refusals(status)
        self._notices(status)
        self._starved(status)

    def _commits(self, status: StatusReply) -> None:
        for step, _, seconds in status.commits:      # the cost a back-pressure summary names (skips.py)
            self.persist_seconds[step] = seconds
        for step in sorted(self.persist_seconds)[:-16]:
            del self.persist_seconds[step]
        if self.rank != 0 or self.started_at < 0:
            return
        for step, nbytes, seconds in sorted(status.commits):
            if step > self.said_commit and step >= self.started_at:
                self.said_commit = step
                now = self.now()
                if len(self._said_at) == BURST and now - self._said_at[0] < BURST_SECONDS:
                    self._held, self._quiet = (step, nbytes, seconds), self._quiet + 1
                else:
                    self._say(step, nbytes, seconds, now)

    def flush(self) -> None:
        """The newest commit a burst kept quiet, said now (a wait for a commit ends: the last one is said)."""
        if self._held is not None:
            self._say(*self._held, self.now())

    def _say(self, step: int, nbytes: int, seconds: float, now: float) -> None:
        held = self._held is not None and self._held[0] == step
        more = self._quiet - held
        self._held, self._quiet = None, 0
        self._said_at.append(now)
        # only after "SIGTERM: saving step 9" could a bare "iter_0000005 committed" be read as step 9's;
        # a commit learned while later steps are in flight is the normal asynchronous case, said bare
        late = f"; an earlier step, not the step {self.announced} being saved" if step < self.announced else ""
        quiet = f"; {more} more committed since the last line, listed in the audit log" if more else ""
        console.info(f"{self.naming.dir_name(step)} committed ({human(nbytes)}, written in {seconds:.2f} s{late}"
                     f"{quiet})")

    def _failures(self, failed: Dict[int, str]) -> None:
        """A step that cannot be committed is said on the console once (rank 0), while training goes on
        and later steps still commit (docs/reliability.md promise 2)."""
        for step in sorted(set(failed) - self.failures):
            self.failures.add(step)
            if self.rank == 0:
                self.log.emit("error", step=step, rank=self.rank,
                              message=f"step {step} was not committed: {failed[step]}; training goes on "
                                      f"and later steps are still saved")

    def _refusals(self, status: StatusReply) -> None:
        """A trainer the agent refused (another world size or job on this save_dir) is said on rank 0's
        console too, not only to the refused process."""
        self.refusals = self._say_new(status.refused, status.last_refused, self.refusals)

    def _notices(self, status: StatusReply) -> None:
        """What the agent found that the job must hear (its save dir replaced under it): rank 0's console, once."""
        self.notices = self._say_new(status.notices, status.last_notices, self.notices)

    def _say_new(self, count: int, last: List[str], said: int) -> int:
        """The agent's last few lines of a kind it has said ``count`` of in all: those beyond the ``said`` first
        go to rank 0's console as errors. Returns the new count said."""
        if count <= said:
            return said
        for text in last[-(count - said):]:
            if self.rank == 0:
                self.log.emit("error", rank=self.rank, message=f"easyckpt agent: {text}")
        return count

    def _starved(self, status: StatusReply) -> None:
        """Replication that stopped reaching a holder (a peer gone, or its port held by strangers) is said on
        rank 0's console once, and again when it works again: replicas are only worth what they hold."""
        replicas = status.replicas
        if self.rank != 0 or replicas.node is None:     # no replica table: nothing is being sent
            return
        for node in sorted(set(replicas.starved) - self.starved):
            self.log.emit("warning", rank=self.rank, message=f"easyckpt agent: {replicas.starved[node]}")
        for node in sorted(self.starved - set(replicas.starved)):
            console.info(f"replicas reach node {node} again")
        self.starved = set(replicas.starved)
