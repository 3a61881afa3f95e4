"""The trainer-side engine of one process: the three verbs every adapter maps onto.

    Engine(cfg)                      validate settings, attach to (or start) the node agent
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

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from easyckpt import console
from easyckpt.config import Config, validate
from easyckpt.errors import AgentError, EasyCkptError, NoValidCheckpoint, TornSnapshot
from easyckpt.formats import shm
from easyckpt.formats.reap import reap_dead_jobs
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.savedir import SaveDir
from easyckpt.trainer import peers, runlog
from easyckpt.trainer.client import AgentClient, one_shot
from easyckpt.trainer.dist import any_rank, placement
from easyckpt.trainer.load import Loaded, Needed, load_newest
from easyckpt.trainer.overlap import OptimizerWatch, auto_overlap
from easyckpt.trainer.preempt import Preemption
from easyckpt.trainer.reports import StatusReports, failed_steps
from easyckpt.trainer.snapshot import (
    PendingSnapshot,
    ShardSpec,
    SnapshotResult,
    Snapshotter,
)
from easyckpt.units import human

Collect = Callable[[], Sequence[ShardSpec]]
STATUS_WAIT = 0.5       # seconds the training thread waits for the agent's status reply
STATUS_BACKOFF = 10.0   # seconds it then asks no more when the agent is alive but did not answer
# what the adapter wants recorded in the manifest's "info" (e.g. {"protect": [best step]})
Info = Optional[Dict[str, Any]]


class Engine:
    def __init__(self, cfg: Config):
        self.cfg = validate(cfg)
        where = placement()
        self.rank, self.world_size, self.local_rank = where.rank, where.world_size, where.local_rank
        console.install(self.rank, to_stdout=cfg.naming.framework == "megatron")   # as print_rank_0
        self.log = AuditLog(cfg.audit_log, f"rank{self.rank}")
        self.savedir = SaveDir.of(cfg)   # read only: the agent writes there
        reap_dead_jobs(self.log, keep=cfg.job_id)
        self.snapshotter = Snapshotter(cfg.job_id, self.rank, self.world_size,
                                       peers.replica_copies(cfg, self.world_size, self.rank))
        self.client = AgentClient(cfg, self.rank, self.local_rank, self.world_size, self.log)
        self.remote: Optional[peers.Remote] = None      # this rank's replicas on peer nodes
        self._introduced = False
        self.last: Optional[SnapshotResult] = None
        self.last_persisted_step: Optional[int] = None
        self.last_step: Optional[int] = None
        self.last_complete_step: Optional[int] = None   # newest snapshot a crash would resume from
        self.reports = StatusReports(self.rank, cfg.naming, self.log)
        self._next_status = 0.0        # rank 0 asks the agent for new commits now and then
        self._quiet_until, self._silent, self._silent_said = 0.0, 0, False   # an agent that stopped answering
        self.closed = False
        self._collect: Optional[Collect] = None
        self._info: Info = None
        # recorded in every manifest's info (rank 0's wins): retention and the loader order this job's steps
        # by (run, step), so a new run's commits are never older than a previous run's higher step numbers
        self.run_started = round(time.time(), 6)
        self.progress = runlog.Progress(self.rank)
        # overlap (overlap.py): a snapshot whose optimizer-owned tensors are still being copied
        self.pending: Optional[PendingSnapshot] = None
        self._pending_persist = False
        self.watch = OptimizerWatch(self.before_optimizer_step)
        self._overlap_on: Optional[bool] = None
        self.preempt: Optional[Preemption] = None
        if cfg.autocheckpoint_on_sigterm:
            job = cfg.job_id
            self.preempt = Preemption(
                job, self.rank, self.world_size, cfg.grace_deadline, self.log,
                tell_agent=lambda at: one_shot(job, {"op": "term", "rank": self.rank, "at": at}),
                dead_ranks=lambda: (one_shot(job, {"op": "status"}) or {}).get("dead_ranks", []))
            self.preempt.install()

    # ---- save ----------------------------------------------------------------------------

    def maybe_save(self, step: int, collect: Collect, info: Info = None,
                   persist: Optional[bool] = None, optimizer: Any = None) -> Optional[SnapshotResult]:
        """``persist``: None = on save_storage_interval; False for adapters whose framework decides
        when to persist (they call persist_now at its save points). ``optimizer``: the one whose step
        changes the parameters next; with the overlap on (``snapshot_overlap``) the tensors it owns are copied while the
        next forward/backward runs, and its step waits for that copy. Returns the snapshot when it was
        taken synchronously (None when skipped, or still being copied: see ``settle``)."""
        if self.safe_point(step, collect, info):
            return self.last
        self._poll_commits()
        if step % self.cfg.save_mem_interval:
            return None
        if persist is None:
            persist = step % self.cfg.save_storage_interval == 0
        if optimizer is not None and self._overlap(optimizer):
            self.watch.add(optimizer)
        return self._snapshot(step, collect, persist=persist, info=info, overlap=bool(self.watch))

    def _overlap(self, optimizer: Any) -> bool:
        if self._overlap_on is None:
            if self.cfg.snapshot_overlap is None:
                ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                self._overlap_on, why = auto_overlap(optimizer, ranks)
            else:
                self._overlap_on, why = self.cfg.snapshot_overlap, "snapshot_overlap set"
            self.log.emit("overlap", rank=self.rank, on=self._overlap_on, message=why)
        return self._overlap_on

    def _introduce(self) -> None:
        """Introduce the nodes' agents to each other (peers.py), once, at the first load or snapshot: both
        are reached by every rank together."""
        if not self._introduced:
            self._introduced = True
            self.remote = peers.introduce(self.cfg, self.client, self.rank, self.world_size, self.local_rank,
                                          self.log)

    def _snapshot(self, step: int, collect: Collect, persist: bool, quiet: bool = False,
                  info: Info = None, overlap: bool = False) -> Optional[SnapshotResult]:
        self.settle()
        self._introduce()
        defer = self.watch.deferrable() if overlap else None
        shards = collect()
        info = {**(info or {}), "run": self.run_started}
        result = self.snapshotter.snapshot(step, shards, persist, info, defer)
        if result is None and self.snapshotter.skipped is None and not self.client.alive():
            # both slots reserved by an agent that died: a new agent releases them (docs/reliability.md promise 10)
            self.client.reattach("both snapshot slots stay reserved by it")
            result = self.snapshotter.snapshot(step, shards, persist, info, defer)
        if isinstance(result, PendingSnapshot):
            self.pending, self._pending_persist = result, persist
            return None
        if result is None and quiet:
            return None
        if result is None:
            behind = step - (self.last_complete_step if self.last_complete_step is not None else 0)
            pid = self.client.agent_pid
            why = self.snapshotter.skipped or (
                f"the easyckpt agent (pid {pid}) is stopped and holds both snapshot slots" if pid and shm.pid_stopped(pid)
                else f"both snapshot slots are still being persisted (storage is slower than "
                     f"save_storage_interval={self.cfg.save_storage_interval})")
            # on the console only when the loss bound does not hold (docs/reliability.md promise 10): a skip
            # that leaves the newest snapshot within save_mem_interval (the same step snapshotted again at the
            # end) risks nothing
            over = behind > self.cfg.save_mem_interval
            bound = f", more than save_mem_interval={self.cfg.save_mem_interval}" if over else ""
            (self.log.emit if over else self.log.record)(
                "skip", step=step, rank=self.rank, behind=behind,
                message=f"rank {self.rank}: snapshot of step {step} skipped: {why}; a crash now would lose {behind} "
                        f"iterations on this rank{bound}")
            return None
        self._snapshot_done(result, persist)
        return result

    def _snapshot_done(self, result: SnapshotResult, persist: bool, copy_seconds: Optional[float] = None) -> None:
        self.last = result
        self.last_complete_step = result.step
        self.log.emit("snapshot", step=result.step, rank=self.rank, slot=result.slot, bytes=result.nbytes,
                      seconds=round(result.seconds, 6),
                      **({} if copy_seconds is None else {"background_seconds": round(copy_seconds, 6)}))
        if persist:
            self._request_persist(result)

    def settle(self) -> None:
        """Finish the background snapshot copy, if one runs: called by the watched optimizers' step
        pre-hook (the copy must end before the parameters change), and before anything else that
        snapshots, loads or finalizes. A failed copy is logged; training goes on (docs/reliability.md promise 2)."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        try:
            result = pending.wait()
        except TornSnapshot as exc:   # the loop changes what the overlap copies: copy synchronously from now on
            self._overlap_on = False
            self.watch.close()
            self.log.emit("warning", step=pending.result.step, rank=self.rank, message=str(exc))
            return
        except Exception as exc:   # noqa: BLE001 - the copy ran in another thread; report, keep training
            self.log.emit("error", step=pending.result.step, rank=self.rank,
                          message=f"background snapshot copy failed: {exc!r}")
            return
        self._snapshot_done(result, self._pending_persist, pending.copy_seconds)

    def before_optimizer_step(self) -> None:
        pending = self.pending
        if pending is None:
            return
        if not pending.order_on_device() or pending.done():
            self.settle()

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
        t0 = time.time()
        since = pre.signalled_at
        console.info(f"SIGTERM: saving step {step}" + (f" on all {self.world_size} ranks" if self.world_size > 1 else ""))
        try:
            self.client.send({"op": "term_step", "rank": self.rank, "step": step})
            self.persist_now(step, collect, max(1.0, pre.deadline_left()), info)
            self.wait_committed(step, max(1.0, pre.deadline_left()))
        except EasyCkptError as exc:
            pre.done()
            self.log.emit("error", step=step, rank=self.rank, message=f"SIGTERM checkpoint failed: {exc}")
            if self.cfg.exit_after_ondemand_checkpoint:
                raise      # exiting as if it had been saved would lose progress silently
            # a failed save does not stop training the user wanted to go on (docs/reliability.md promise 2)
            return
        self.log.emit("sigterm_save", step=step, rank=self.rank, seconds=round(time.time() - t0, 6),
                      since_signal=None if since is None else round(time.time() - since, 6),
                      exit=self.cfg.exit_after_ondemand_checkpoint)
        pre.done()
        self._say_committed(step)    # its "committed" line first, then the one that says what happens now
        console.info(f"SIGTERM: step {step} committed {time.time() - t0:.2f} s after this rank reached it; "
                     + ("exiting" if self.cfg.exit_after_ondemand_checkpoint else "training goes on"))
        if self.rank == 0:
            runlog.record("sigterm_save", step=step, exit=self.cfg.exit_after_ondemand_checkpoint)
        if self.cfg.exit_after_ondemand_checkpoint:
            self.finalize(persist=False)
            raise SystemExit(0)

    def _request_persist(self, result: SnapshotResult) -> None:
        try:
            self.client.send({"op": "persist", "rank": self.rank, "slot": result.slot,
                              "generation": result.generation, "step": result.step})
            self.last_persisted_step = result.step
            self.reports.requested(result.step)
        except AgentError as exc:   # never take training down for a failed persist (docs/reliability.md promise 2)
            self.log.emit("error", step=result.step, rank=self.rank, message=str(exc))
        self.status()

    def status(self) -> Dict[str, Any]:
        """The agent's status ({} when none answers); what is new in it is said on the console. Bounded for
        the training thread (docs/reliability.md promise 13): an agent that is alive but silent (stopped,
        hung) is asked at most STATUS_WAIT once every STATUS_BACKOFF seconds, and the console says so once."""
        now = time.monotonic()
        if now < self._quiet_until:
            return {}
        got = one_shot(self.cfg.job_id, {"op": "status"}, timeout=STATUS_WAIT)
        pid = self.client.agent_pid
        if got is None and pid is not None and shm.pid_alive(pid):
            self._quiet_until = time.monotonic() + STATUS_BACKOFF
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
        status = got or {}
        self.reports.take(status)
        self._next_status = time.monotonic() + 0.25
        return status

    def failed_steps(self) -> Dict[int, str]:
        """Steps the agent could not persist or commit, with why (from its status)."""
        return failed_steps(self.status())

    def _say_committed(self, step: int, wait: float = 1.0) -> None:
        """After the commit of ``step`` was seen in the save dir: its console line. The agent records it
        once its prune is done too, a moment later; rank 0 asks again until then, for ``wait`` s at most."""
        deadline = time.monotonic() + wait
        while self.reports.waiting(step) and time.monotonic() < deadline:
            self.status()
            if self.reports.waiting(step):
                time.sleep(0.02)

    def _poll_commits(self) -> None:
        # one socket round trip every 0.25 s at most, and only while a commit is awaited: training pays nothing
        # else for the "committed" line
        if (self.last_persisted_step is not None and self.reports.waiting(self.last_persisted_step)
                and time.monotonic() >= self._next_status):
            self.status()

    def persist_now(self, step: int, collect: Collect, timeout: Optional[float] = None, info: Info = None,
                    fresh: bool = False) -> SnapshotResult:
        """Make sure ``step`` is snapshotted and handed to the agent for persisting; waits only for a free
        slot (when both are reserved), never for storage. ``fresh``: snapshot again even if ``step``
        already is (the state changed without the step changing, e.g. evaluation results)."""
        self.last_step, self._collect, self._info = step, collect, info
        self.settle()
        mine = fresh or self.last is None or self.last.step != step
        # an adapter's collect may run collectives (ZeRO-3 gathers parameters for the checkpoint): every
        # rank collects when any rank must snapshot, and only once, or the others hang in the collective
        try:
            anyone = any_rank(mine, self.world_size)
        except Exception as exc:  # noqa: BLE001 - a rank is gone: no collective can run; the commit wait names it
            self.log.emit("warning", step=step, rank=self.rank,
                          message=f"ranks could not agree whether step {step} needs a new snapshot ({exc}); "
                                  f"going on with this rank's own answer")
            anyone = mine
        if not mine:
            if anyone:
                collect()
            if self.last_persisted_step != step:
                self._request_persist(self.last)
            return self.last
        shards = collect()
        deadline = time.monotonic() + (self.cfg.commit_timeout if timeout is None else timeout)
        while True:
            result = self._snapshot(step, lambda: shards, persist=True, quiet=True, info=info)
            if result is not None:
                return result
            if not self.client.alive():
                self.client.reattach(f"no slot was released to save step {step}")
            if time.monotonic() > deadline:
                raise AgentError(f"rank {self.rank}: no snapshot slot was released in time to save step {step}")
            time.sleep(0.01)

    # ---- load ----------------------------------------------------------------------------

    def prepare(self, data_bytes: int) -> None:
        """Get both snapshot slots ready for about ``data_bytes`` of state while training starts (after
        the load), so that the first snapshot costs what a steady one does."""
        skipped = self.snapshotter.prepare(data_bytes)
        # logged: the audit shows the estimate next to the first snapshot's bytes
        self.log.emit("prepare", rank=self.rank, bytes=data_bytes, **({"skipped": skipped} if skipped else {}))

    def load(self, needed: Needed, layout: Optional[str] = None) -> Optional[Loaded]:
        self.settle()
        self._introduce()
        fresh: List[int] = []
        try:
            loaded = load_newest(self.cfg, self.rank, self.world_size, needed, self.log,
                                 on_rejected=lambda step, why: one_shot(self.cfg.job_id, {
                                     "op": "damaged", "step": step, "reason": why}), remote=self.remote,
                                 layout=layout)
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
            self.log.emit("load", step=loaded.step, rank=self.rank, source=loaded.source, path=loaded.path,
                          bytes=loaded.nbytes, seconds=round(loaded.seconds, 6))
            self.last_step = loaded.step
            self.progress.mark(loaded.step)
        console.info(_resumed(loaded, self.cfg.save_dir, self.world_size, fresh))
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
            self.client.send({"op": "quarantine", "step": verdict.step,
                              "reason": f"{verdict.kind.value}: {verdict.reason}"[:500]})

    # ---- finalize ------------------------------------------------------------------------

    def finalize(self, timeout: Optional[float] = None, persist: bool = True) -> Optional[int]:
        """Persist and commit the newest state, wait for the commit, release the slots. Returns the step.
        ``persist=False``: only release (the framework was told not to save)."""
        if self.closed:          # e.g. after the SIGTERM exit, an atexit finalize of the adapter
            return self.last.step if self.last is not None else None
        self.closed = True
        self.settle()
        self.watch.close()
        timeout = self.cfg.commit_timeout if timeout is None else timeout
        step = None
        if persist and self.last_step is not None and self._collect is not None:
            step = self.persist_now(self.last_step, self._collect, timeout, self._info).step
        if step is not None:
            reply = self.client.request({"op": "flush", "rank": self.rank, "step": step,
                                         "slot": self.last.slot, "generation": self.last.generation}, timeout)
            if not reply.get("ok"):
                raise AgentError(f"rank {self.rank}: persisting step {step} failed: {reply.get('error')}")
            self.wait_committed(step, timeout)
            self._say_committed(step)
        # an earlier step that failed after the last storage interval's status is said now, not never; and
        # the commit finalize waited for
        self.status()
        if self.preempt is not None:
            self.preempt.uninstall()
        self.client.send({"op": "bye", "rank": self.rank})
        self.client.close()
        self.snapshotter.close(unlink=True)
        self.log.close()
        return step

    def wait_committed(self, step: int, timeout: Optional[float] = None) -> None:
        """Block until ``step`` (already handed to the agent) is committed, or raise after ``timeout``."""
        timeout = self.cfg.commit_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # the ranks whose shard was there, as last seen while waiting: the coordinator's agent gives up at
        # about the same moment and removes the staging directory, which would hide who was missing
        seen: Optional[set] = None
        next_check = time.monotonic() + 0.25
        while True:
            if self.savedir.is_committed(step):
                return
            if time.monotonic() > next_check:     # fail at once, not at the deadline (docs/reliability.md promise 10)
                next_check = time.monotonic() + 0.25
                failed = self.failed_steps()
                if step in failed:
                    raise AgentError(f"rank {self.rank}: step {step} was not committed: {failed[step]}")
                if not self.client.alive():
                    self.client.reattach(f"it died before step {step} was committed")
                    if self.last is not None and self.last.step == step:
                        self._request_persist(self.last)
            now = self.savedir.ready_ranks(step)
            if now is not None and (seen is None or len(now) >= len(seen)):   # markers only go with the dir
                seen = now
            if time.monotonic() > deadline:
                raise AgentError(f"rank {self.rank}: step {step} was not committed within {timeout:g}s: "
                                 f"{self._missing_shards(step, seen)}")
            time.sleep(0.005)    # the trainer only waits here (finalize, SIGTERM save): notice the commit soon

    def _missing_shards(self, step: int, seen: Optional[set]) -> str:
        if seen is None:
            return "its staging directory never appeared or is gone (the persist failed; see the audit log)"
        missing = sorted(set(range(self.world_size)) - seen)
        return (f"no shard from rank(s) {missing} (dead, or stuck before saving step {step})" if missing
                else "every shard is there; the coordinator's agent did not commit (see its log)")


def _resumed(loaded: Optional[Loaded], save_dir: str, world_size: int, fresh: Sequence[int] = ()) -> str:
    if loaded is None and fresh:
        return (f"none of this job's {len(fresh)} committed step(s) in {save_dir} ({', '.join(map(str, fresh))}) can "
                f"be restored here: training starts from the beginning, as on_no_valid_checkpoint='start_fresh' "
                f"allows; they are set aside as quarantined-<name>-<stamp>, kept whole (`easyckpt ls` lists them)")
    if loaded is None:
        return f"no checkpoint of this job in {save_dir}: training starts from the beginning"
    where = {"memory": "memory (the snapshot that outlived the last run)",
             "peer": "a peer node's memory (the replica of this node's snapshot)",
             "storage": f"storage ({loaded.path}, verified)"}.get(loaded.source, f"{loaded.path} ({loaded.source})")
    size = human(loaded.nbytes) + (" on rank 0" if world_size > 1 else "")
    if loaded.from_peers and loaded.source != "peer":
        where += f"; rank(s) {list(loaded.from_peers)} from a peer node's memory (the replicas of their lost node)"
    return f"resumed step {loaded.step} from {where}: {size} in {loaded.seconds:.2f} s"
