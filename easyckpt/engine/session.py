"""The trainer-side engine of one process: the three verbs every adapter maps onto.

    Engine(cfg)                      validate settings, attach to (or start) the node agent
    Engine(cfg, group=, link=, clock=)  the same over given seams (seams.py): the ranks' collectives,
                                     the agent link, the clock; Engine(cfg) builds the production ones
    engine.maybe_save(step, collect) every iteration; snapshots on save_mem_interval, asks the
                                     agent to persist on save_storage_interval; never waits for storage
    engine.load(needed)              newest complete state (memory or storage), agreed by all ranks
    engine.finalize()                the newest state is committed when it returns; slots released

SIGTERM (preempt.py): ``maybe_save`` is the safe point. Once every rank agreed on a step, that step is
snapshotted (even off-interval), persisted and committed before ``maybe_save`` returns; then the process
exits with status 0 if ``exit_after_ondemand_checkpoint`` is set, else training goes on.

Adapters reach it through checkpointer.py (Checkpointer, the public object, and the FrameworkState
protocol they implement); they hold no file I/O, no threads, and no knowledge of slots or agents.
"""
from __future__ import annotations

import secrets
from typing import Any, Dict, List, Optional, Sequence

from easyckpt import console
from easyckpt.config import Config, storage_interval, storage_unset, validate
from easyckpt.engine.link import metrics, peers, runlog
from easyckpt.engine.link.agentview import AgentView
from easyckpt.engine.link.client import AgentClient
from easyckpt.engine.link.dist import TorchGroup
from easyckpt.engine.link.preempt import Preemption
from easyckpt.engine.load import resumeline
from easyckpt.engine.load.newest import Layout, load_newest
from easyckpt.engine.load.reads import Needed
from easyckpt.engine.load.sources import Loaded, Ranks
from easyckpt.engine.save.budget import SnapshotBudget, agree_ranks, record_last
from easyckpt.engine.save.persistpace import PersistPace
from easyckpt.engine.save.saver import Collect, Info, Saver
from easyckpt.engine.save.snapshot import SnapshotResult, Snapshotter
from easyckpt.engine.seams import AgentLink, Clock, Group, SystemClock
from easyckpt.errors import AgentError, EasyCkptError, NoValidCheckpoint
from easyckpt.formats import protocol
from easyckpt.formats.replies import FlushReply, StatusReply
from easyckpt.ipc.reap import reap_dead_jobs
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.savedir import SaveDir



class Engine:
    def __init__(self, cfg: Config, *, group: Optional[Group] = None, link: Optional[AgentLink] = None,
                 clock: Optional[Clock] = None):
        """``group``, ``link``, ``clock``: the seams (seams.py); by default torch.distributed, a socket client
        that starts the node's agent when none runs (after reaping dead jobs' memory), the system clock."""
        self.cfg = validate(cfg)
        self.group: Group = group if group is not None else TorchGroup()
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.rank, self.world_size, self.local_rank = self.group.rank, self.group.world_size, self.group.local_rank
        console.install(self.rank, to_stdout=cfg.naming.framework == "megatron")   # as print_rank_0
        self.log = AuditLog(cfg.audit_log, f"rank{self.rank}")
        self.savedir = SaveDir.of(cfg)   # read only: the agent writes there
        if link is None:
            reap_dead_jobs(self.log, keep=cfg.job_id)
        self.snapshotter = Snapshotter(cfg.job_id, self.rank, self.world_size,
                                       peers.replica_copies(cfg, self.world_size, self.rank))
        self.client: AgentLink = link if link is not None else AgentClient(
            cfg, self.rank, self.local_rank, self.world_size, self.log)
        self.remote: Optional[peers.Remote] = None      # this rank's replicas on peer nodes
        self._introduced = False
        self.last_step: Optional[int] = None
        self.view = AgentView(cfg, self.rank, self.world_size, self.client, self.savedir, self.log, self.clock)
        self.closed = False
        self._collect: Optional[Collect] = None
        self._info: Info = None
        # recorded in every manifest's info (rank 0's wins): the run's token names it, and the commit numbers
        # the run by it (SaveDir.run_seq in storage/savedir.py); retention and the loader order this job's steps by
        # (run number, step), so a new run's commits are never older than a previous run's higher step numbers.
        # The start stamp is for people (and orders only steps committed before runs were numbered): ranks'
        # clocks disagree, and one a day ahead must not make a later run's commits the older ones.
        self.run_started = round(self.clock.time(), 6)
        self.run_id = secrets.token_hex(8)
        self.run_info: Dict[str, Any] = {"run": self.run_started, "run_id": self.run_id}   # in every snapshot's info
        self.progress = runlog.LastStep(self.rank)
        self.storage_every = storage_interval(cfg)
        # the persists' spacing is the budget's only where the user left it at its default (persistpace.py)
        pace = (PersistPace(cfg.save_mem_interval, self.storage_every, cfg.max_overhead,
                            lambda: self.view.reports.persist_seconds)
                if storage_unset(cfg) and cfg.max_overhead is not None else None)
        if pace is not None:
            self.view.on_requested.append(lambda step: pace.requested(step, self.clock.monotonic()))
        self.budget = SnapshotBudget(cfg.save_mem_interval, cfg.max_overhead, pace=pace)   # within max_overhead
        self.saver = Saver(cfg, self.rank, self.snapshotter, self.log, self.clock, self.view, self.budget,
                           introduce=self._introduce, run=self.run_info)
        self.metrics = metrics.RunMetrics(self.rank, self.log, self.view, self.budget, self.clock)
        self.preempt: Optional[Preemption] = None
        if cfg.autocheckpoint_on_sigterm:
            link_ = self.client
            self.preempt = Preemption(
                cfg.job_id, self.rank, self.world_size, cfg.grace_deadline, self.log,
                tell_agent=lambda at: link_.side(protocol.Term(self.rank, at)),
                dead_ranks=lambda: getattr(link_.status(2.0), "dead_ranks", []))
            self.preempt.install()

    # ---- save ----------------------------------------------------------------------------

    def maybe_save(self, step: int, collect: Collect, info: Info = None,
                   persist: Optional[bool] = None, optimizer: Any = None) -> Optional[SnapshotResult]:
        """``persist``: None = on save_storage_interval; False for adapters whose framework decides
        when to persist (they call persist_now at its save points). ``optimizer``: the one whose step
        changes the parameters next; with the overlap on (``snapshot_overlap``) the tensors it owns are copied while the
        next forward/backward runs, and its step waits for that copy. Returns the snapshot when it was
        taken synchronously (None when skipped, or still being copied: see ``settle``)."""
        budget = self.budget
        budget.tick(step, self.clock.monotonic())
        if self.safe_point(step, collect, info):
            return self.saver.last
        self.view.poll(self.saver.last_persisted_step)
        if budget.agreement_due(step):
            agree_ranks(budget, self.group, self.log, self.rank, step)
        if step % self.cfg.save_mem_interval:
            return None
        # the persists this call decides are snapshots too (the loss bound); a framework's own are not known
        every = budget.pace.every if budget.pace is not None else self.storage_every
        budget.persist_every = every if persist is None else None
        if persist is None:
            persist = step % every == 0
            self.saver.skips.storage = every          # what a skip's warning names
        # the budget may space out snapshots that only go to memory; a persist is never skipped for it
        if not persist and not budget.due(step):
            return None
        budget.took()
        began = self.clock.monotonic()
        result = self.saver.in_loop(step, collect, persist, info, optimizer)
        budget.took_for(self.clock.monotonic() - began)
        return result

    def _introduce(self) -> None:
        """Introduce the nodes' agents to each other (peers.py), once, at the first load or snapshot: both
        are reached by every rank together."""
        if not self._introduced:
            self._introduced = True
            self.remote = peers.introduce(self.cfg, self.client, self.rank, self.world_size, self.local_rank,
                                          self.log)

    @property
    def last(self) -> Optional[SnapshotResult]:
        """This rank's newest snapshot taken (saver.py)."""
        return self.saver.last

    def settle(self) -> None:
        """Finish the background snapshot copy, if one runs (saver.py): before anything else that snapshots,
        loads or finalizes."""
        self.saver.settle()

    def safe_point(self, step: int, collect: Collect, info: Info = None) -> bool:
        """Every iteration, on every rank (maybe_save calls it; adapters whose framework already saved this
        step call it alone). True when this step was the one agreed on after SIGTERM and is now committed."""
        self.last_step, self._collect, self._info = step, collect, info
        self.progress.mark(step)
        pre = self.preempt
        if pre is None:
            return False
        pre.at = step
        if pre.pending and pre.target(step) == step:
            self._save_on_demand(step, collect, info)
            return True
        return False

    def _save_on_demand(self, step: int, collect: Collect, info: Info) -> None:
        """The step all ranks agreed on after SIGTERM: snapshot, persist, wait for the commit; then exit
        (``exit_after_ondemand_checkpoint``) or return to training."""
        pre = self.preempt
        assert pre is not None
        t0 = self.clock.time()
        since = pre.signalled_at
        console.info(f"SIGTERM: saving step {step}" + (f" on all {self.world_size} ranks" if self.world_size > 1 else ""))
        self.view.reports.announce(step)
        try:
            self.client.send(protocol.TermStep(self.rank, step))
            self.persist_now(step, collect, max(1.0, pre.deadline_left()), info)
            self.wait_committed(step, max(1.0, pre.deadline_left()))
        except EasyCkptError as exc:
            pre.done()
            self.log.emit("error", step=step, rank=self.rank, message=f"SIGTERM checkpoint failed: {exc}")
            if self.cfg.exit_after_ondemand_checkpoint:
                raise      # exiting as if it had been saved would lose progress silently
            # a failed save does not stop training the user wanted to go on (docs/reliability.md promise 2)
            return
        now = self.clock.time()
        self.log.emit("sigterm_save", step=step, rank=self.rank, seconds=round(now - t0, 6),
                      since_signal=None if since is None else round(now - since, 6),
                      exit=self.cfg.exit_after_ondemand_checkpoint)
        pre.done()
        self.view.say_committed(step)    # its "committed" line first, then the one that says what happens now
        console.info(f"SIGTERM: step {step} committed {now - t0:.2f} s after this rank reached it; "
                     + ("exiting" if self.cfg.exit_after_ondemand_checkpoint else "training goes on"))
        if self.rank == 0:
            runlog.record("sigterm_save", step=step, exit=self.cfg.exit_after_ondemand_checkpoint)
        if self.cfg.exit_after_ondemand_checkpoint:
            self.finalize(persist=False)
            raise SystemExit(0)

    def status(self) -> Optional[StatusReply]:
        """The agent's status (None when none answers), said on the console where new (agentview.py)."""
        return self.view.status()

    def failed_steps(self) -> Dict[int, str]:
        """Steps the agent could not persist or commit, with why (from its status)."""
        return self.view.failed_steps()

    def persist_now(self, step: int, collect: Collect, timeout: Optional[float] = None, info: Info = None,
                    fresh: bool = False) -> SnapshotResult:
        """Make sure ``step`` is snapshotted and handed to the agent for persisting; waits only for a free
        slot (when both are reserved), never for storage. ``fresh``: snapshot again even if ``step``
        already is (the state changed without the step changing, e.g. evaluation results)."""
        self.last_step, self._collect, self._info = step, collect, info
        saver = self.saver
        saver.settle()
        mine = fresh or saver.last is None or saver.last.step != step
        # an adapter's collect may run collectives (ZeRO-3 gathers parameters for the checkpoint): every
        # rank collects when any rank must snapshot, and only once, or the others hang in the collective
        try:
            anyone = self.group.any_rank(mine)
        except Exception as exc:  # noqa: BLE001 - a rank is gone: no collective can run; the commit wait names it
            self.log.emit("warning", step=step, rank=self.rank,
                          message=f"ranks could not agree whether step {step} needs a new snapshot ({exc}); "
                                  f"going on with this rank's own answer")
            anyone = mine
        if not mine:
            assert saver.last is not None     # mine is False only when the last snapshot is of this step
            if anyone:
                collect()
            if saver.last_persisted_step != step:
                saver.request_persist(saver.last)
            return saver.last
        shards = collect()
        self.budget.took()      # this step's time holds a snapshot (budget.py)
        deadline = self.clock.monotonic() + (self.cfg.commit_timeout if timeout is None else timeout)
        while True:
            result = saver.snapshot(step, lambda: shards, persist=True, quiet=True, info=info)
            if result is not None:
                return result
            if not self.client.alive():
                self.client.reattach(f"no slot was released to save step {step}")
            if self.clock.monotonic() > deadline:
                raise AgentError(f"rank {self.rank}: no snapshot slot was released in time to save step {step}")
            self.clock.sleep(0.01)

    # ---- load ----------------------------------------------------------------------------

    def prepare(self, data_bytes: int) -> None:
        """Get both snapshot slots ready for about ``data_bytes`` of state while training starts (after
        the load), so that the first snapshot costs what a steady one does."""
        skipped = self.snapshotter.prepare(data_bytes)
        # logged: the audit shows the estimate next to the first snapshot's bytes
        self.log.emit("prepare", rank=self.rank, bytes=data_bytes, **({"skipped": skipped} if skipped else {}))

    def load(self, needed: Needed, layout: Optional[Layout] = None,
             otherwise: Optional[str] = None) -> Optional[Loaded]:
        """The newest complete state this rank can restore, or None. ``otherwise``: where the framework itself
        resumes from when there is none (FrameworkState.otherwise), said instead of "from the beginning"."""
        self.settle()
        self._introduce()
        # the ranks take rank 0's run token: every snapshot of this run then names one run, so a reshard from
        # memory never joins shards of two runs of the same step (reshardplan.py)
        self.run_info["run_id"] = self.run_id = self.group.all_gather(self.run_id)[0]
        fresh: List[int] = []
        try:
            ranks = Ranks(self.cfg, self.rank, self.world_size, self.log, self.group.all_gather, self.group.exchange)
            loaded = load_newest(ranks, needed, remote=self.remote, layout=layout,
                                 on_rejected=lambda step, why: self.client.side(
                                     protocol.Damaged(step, why[:protocol.MAX_TEXT])))
        except NoValidCheckpoint as exc:
            # every rank raised the same (the verdicts were gathered): all stop, or all start fresh
            self.log.record("error", message=str(exc))     # the console shows it once, as the raised error
            if self.cfg.on_no_valid_checkpoint != "start_fresh":
                raise
            loaded, fresh = None, [v.step for v in exc.verdicts]
            self._quarantine(exc.verdicts)
        if loaded is not None and loaded.source == "peer":
            self.snapshotter.rescan()    # the pulled slot carries the agent's generation count
        if loaded is not None:
            moved = {"moved": loaded.moved, "saved_world_size": loaded.manifest.world_size} \
                if loaded.source == "resharded" and loaded.manifest is not None else {}
            self.log.emit("load", step=loaded.step, rank=self.rank, source=loaded.source, path=loaded.path,
                          bytes=loaded.nbytes, seconds=round(loaded.seconds, 6), **moved)
            self.last_step = loaded.step
            self.progress.mark(loaded.step)
        if loaded is None:    # a loaded step is said once the adapter restored it, timed with it (resumeline.py)
            console.info(resumeline.nothing_words(self.cfg.save_dir, fresh, otherwise))
        if self.rank == 0:
            runlog.record("resume", step=loaded.step if loaded else 0, source=loaded.source if loaded else "none",
                          seconds=round(loaded.seconds, 6) if loaded else 0.0)
        return loaded

    def _quarantine(self, rejected: Sequence[Any]) -> None:
        """A fresh start over steps no rank could restore: rank 0 has the agent set each aside, kept whole,
        before the first commit of this run (its queue runs these before any persist), so that no new commit
        reuses their names or prunes them."""
        if self.rank != 0:
            return
        for verdict in rejected:
            console.warning(f"start_fresh: setting aside {verdict.words()}")
            # on this rank's own connection: the agent queues it before any persist this rank asks for later,
            # and a step commits only with rank 0's shard
            self.client.send(protocol.Quarantine(verdict.step, f"{verdict.kind.value}: {verdict.reason}"[:500]))

    # ---- finalize ------------------------------------------------------------------------

    def finalize(self, timeout: Optional[float] = None, persist: bool = True) -> Optional[int]:
        """Persist and commit the newest state, wait for the commit, release the slots. Returns the step.
        ``persist=False``: only release (the framework was told not to save)."""
        if self.closed:          # e.g. after the SIGTERM exit, an atexit finalize of the adapter
            return self.last.step if self.last is not None else None
        self.closed = True
        self.settle()
        self.saver.watch.close()
        record_last(self.budget, self.log, self.rank, self.last_step)
        timeout = self.cfg.commit_timeout if timeout is None else timeout
        step = None
        if persist and self.last_step is not None and self._collect is not None:
            step = self.persist_now(self.last_step, self._collect, timeout, self._info).step
        if step is not None:
            assert self.last is not None     # persist_now took or kept it
            reply = self.client.request(protocol.Flush(self.rank, step, self.last.slot, self.last.generation),
                                        FlushReply, timeout)
            if not reply.ok:
                raise AgentError(f"rank {self.rank}: persisting step {step} failed: {reply.error}")
            self.wait_committed(step, timeout)
            self.view.say_committed(step)
        # an earlier step that failed after the last storage interval's status is said now, not never; and
        # the commit finalize waited for, and the newest a burst of commit lines kept quiet (reports.py)
        self.status()
        self.view.reports.flush()
        if self.preempt is not None:
            self.preempt.uninstall()
        # with a local tier the agent removes the slots as it leaves, after its last look has copied a due
        # snapshot its niced thread had not taken yet (agent/localtier.py); removed here, that step was lost
        agent_removes = self.cfg.save_local_interval is not None and self.client.alive()
        if agent_removes:      # every slot file made before the bye: one made after the agent left would stay
            self.snapshotter.wait_prepared(both=False)
        self.client.send(protocol.Bye(self.rank))
        self.client.close()
        self.snapshotter.close(unlink=not agent_removes)
        self.metrics.finish(step)      # rank 0's summary line, and the audit log's ``metrics`` event
        self.log.close()
        return step

    def wait_committed(self, step: int, timeout: Optional[float] = None) -> None:
        """Block until ``step`` (already handed to the agent) is committed, or raise after ``timeout``."""
        def agent_died() -> None:
            self.client.reattach(f"it died before step {step} was committed")
            if self.last is not None and self.last.step == step:
                self.saver.request_persist(self.last)
        self.view.wait_committed(step, self.cfg.commit_timeout if timeout is None else timeout, agent_died)
