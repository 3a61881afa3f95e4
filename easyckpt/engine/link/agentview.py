"""What one rank knows of the agent's progress: its status (asked boundedly), the console lines it brings
(reports.py), and the wait for a commit. The engine's save path asks; this holds the bookkeeping.

How a trainer learns that step S is committed: the save directory says so (SaveDir.is_committed: the
manifest of S under S's final name); that is the one fact waited on. The agent's status brings why a
step will never commit (failed_steps, so the wait ends at once) and the figures of the console line."""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Set, Tuple

from easyckpt import console
from easyckpt.config import Config
from easyckpt.engine.link.reports import StatusReports
from easyckpt.engine.seams import AgentLink, Clock
from easyckpt.errors import AgentError
from easyckpt.formats.replies import StatusReply
from easyckpt.ipc import shm
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.savedir import SaveDir

STATUS_WAIT = 0.5       # seconds the training thread waits for the agent's status reply
STATUS_BACKOFF = 10.0   # seconds it then asks no more when the agent is alive but did not answer
STATUS_EVERY = 0.25     # seconds between the status questions asked while a commit is awaited
COMMIT_POLL = 0.005     # seconds between looks at the save directory while a commit is awaited


class AgentView:
    def __init__(self, cfg: Config, rank: int, world_size: int, link: AgentLink, savedir: SaveDir,
                 log: AuditLog, clock: Clock):
        self.cfg, self.rank, self.world_size, self.link = cfg, rank, world_size, link
        self.savedir, self.log, self.clock = savedir, log, clock
        self.reports = StatusReports(rank, cfg.naming, log, clock.monotonic)
        self._next_status = 0.0        # rank 0 asks the agent for new commits now and then
        self._quiet_until, self._silent, self._silent_said = 0.0, 0, False   # an agent that stopped answering
        # a status question asked on a thread of its own (thread, its number, the box its answer lands in)
        self._asking: Optional[Tuple[threading.Thread, int, List[Optional[StatusReply]]]] = None
        self._asks, self._synced = 0, 0     # questions asked; the last asked before a status() of this thread
        # told of each persist handed to the agent and each status reply (engine/link/metrics.py: the run's figures)
        self.on_requested: List[Callable[[int], None]] = []
        self.on_status: List[Callable[[StatusReply], None]] = []

    def requested(self, step: int) -> None:
        """``step`` was handed to the agent for persisting."""
        self.reports.requested(step)
        for fn in self.on_requested:
            fn(step)

    def persist_seconds(self) -> Dict[int, float]:
        """Seconds the agent took to persist and commit its recent steps, by step, as of a status asked now."""
        self.status()
        return self.reports.persist_seconds

    def status(self) -> Optional[StatusReply]:
        """The agent's status (None when none answers); what is new in it is said on the console. Bounded for
        the training thread (docs/reliability.md promise 13): an agent that is alive but silent (stopped,
        hung) is asked at most STATUS_WAIT once every STATUS_BACKOFF seconds, and the console says so once."""
        if self.clock.monotonic() < self._quiet_until:
            return None
        self._synced = self._asks      # an answer to a question asked before this one is older: dropped
        got = self.link.status(STATUS_WAIT)
        self._received(got)
        return got

    def _received(self, got: Optional[StatusReply]) -> None:
        pid = self.link.agent_pid
        if got is None and pid is not None and shm.pid_alive(pid):
            self._quiet_until = self.clock.monotonic() + STATUS_BACKOFF
            self._silent += 1
            stopped = shm.pid_stopped(pid)
            why = (f"rank {self.rank}: the easyckpt agent (pid {pid}) did not answer within {STATUS_WAIT:g} s"
                   f"{' (it is stopped: SIGSTOP or a debugger)' if stopped else ''}; training goes on: snapshots "
                   f"whose slots it holds are skipped and persists wait until it answers again")
            self.log.record("warning", rank=self.rank, message=why)
            if (stopped or self._silent > 1) and not self._silent_said:
                self._silent_said = True
                console.warning(why)
        elif got is not None:
            if self._silent_said:
                console.info(f"rank {self.rank}: the easyckpt agent answers again")
            self._silent, self._silent_said = 0, False
            self.reports.take(got)
            for fn in self.on_status:
                fn(got)
        self._next_status = self.clock.monotonic() + STATUS_EVERY

    def _ask_in_background(self) -> None:
        """Ask for the status on a thread of its own; the training thread takes the answer in at a later
        poll (_take_answer). The round trip waits for the agent's loop, which may be committing a step (fsyncs):
        3.6 ms a question on 2 cores, asked at each persist of a loop that persists ten times a second, was 3 %
        of its 20 ms step (benchmarks/bench_overhead.py pt10). One question at a time, bounded by STATUS_WAIT."""
        if self._asking is not None or self.clock.monotonic() < self._quiet_until:
            return
        self._asks += 1
        box: List[Optional[StatusReply]] = []
        thread = threading.Thread(target=lambda: box.append(self.link.status(STATUS_WAIT)), daemon=True,
                                  name="easyckpt-status")
        self._asking = (thread, self._asks, box)
        self._next_status = self.clock.monotonic() + STATUS_EVERY
        thread.start()

    def _take_answer(self) -> None:
        """The background question's answer, once it is in: handled as status() handles its own."""
        asking = self._asking
        if asking is None or asking[0].is_alive():
            return
        self._asking = None
        thread, ask, box = asking
        thread.join()
        if ask > self._synced and box:
            self._received(box[0])

    def failed_steps(self) -> Dict[int, str]:
        """Steps the agent could not persist or commit, with why (from its status)."""
        status = self.status()
        return dict(status.failed_steps) if status is not None else {}

    def say_committed(self, step: int, wait: float = 1.0) -> None:
        """After the commit of ``step`` was seen in the save dir: its console line. The agent records it
        once its prune is done too, a moment later; rank 0 asks again until then, for ``wait`` s at most."""
        deadline = self.clock.monotonic() + wait
        while self.reports.waiting(step) and self.clock.monotonic() < deadline:
            self.status()
            if self.reports.waiting(step):
                self.clock.sleep(0.02)
        self.reports.flush()

    def after_request(self) -> None:
        """After a persist was handed to the agent: ask for its news (a commit, a step it failed, a notice),
        without waiting for the answer."""
        self._take_answer()
        self._ask_in_background()

    def poll(self, newest_requested: Optional[int]) -> None:
        """Take in the answer to a question asked earlier; ask again every STATUS_EVERY at most, and only while a
        commit is awaited: training pays nothing else for the "committed" line, and never waits for it."""
        self._take_answer()
        if (newest_requested is not None and self.reports.waiting(newest_requested)
                and self.clock.monotonic() >= self._next_status):
            self._ask_in_background()

    def wait_committed(self, step: int, timeout: float, agent_died: Callable[[], None]) -> None:
        """Block until ``step`` (already handed to the agent) is committed, or raise after ``timeout``; a
        step the agent failed raises at once (docs/reliability.md promise 10). ``agent_died``: called when
        the agent is gone, to start another and hand it the step again."""
        deadline = self.clock.monotonic() + timeout
        # the ranks whose shard was there, as last seen while waiting: the coordinator's agent gives up at
        # about the same moment and removes the staging directory, which would hide who was missing
        seen: Optional[Set[int]] = None
        next_check = self.clock.monotonic() + STATUS_EVERY
        while True:
            if self.savedir.is_committed(step):
                return
            if self.clock.monotonic() > next_check:
                next_check = self.clock.monotonic() + STATUS_EVERY
                status = self.status()
                failed = dict(status.failed_steps) if status is not None else {}
                if step in failed:
                    raise AgentError(f"rank {self.rank}: step {step} was not committed: {failed[step]}")
                gone = dict(status.deleted_steps) if status is not None else {}
                if step in gone:     # committed, then deleted before this rank saw it: it will never appear
                    raise AgentError(f"rank {self.rank}: step {step} was committed, then deleted: {gone[step]}")
                if not self.link.alive():
                    agent_died()
            now = self.savedir.ready_ranks(step)
            if now is not None and (seen is None or len(now) >= len(seen)):   # markers only go with the dir
                seen = now
            if self.clock.monotonic() > deadline:
                raise AgentError(f"rank {self.rank}: step {step} was not committed within {timeout:g}s: "
                                 f"{self._missing_shards(step, seen)}")
            self.clock.sleep(COMMIT_POLL)    # the trainer only waits here (finalize, SIGTERM save)

    def _missing_shards(self, step: int, seen: Optional[Set[int]]) -> str:
        if seen is None:
            return "its staging directory never appeared or is gone (the persist failed; see the audit log)"
        missing = sorted(set(range(self.world_size)) - seen)
        return (f"no shard from rank(s) {missing} (dead, or stuck before saving step {step})" if missing
                else "every shard is there; the coordinator's agent did not commit (see its log)")
