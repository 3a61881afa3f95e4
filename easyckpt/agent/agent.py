"""The node agent: a long-lived process per (job, node) that persists and commits snapshots.

It never runs in a trainer, so storage never stalls training. One event loop (socket messages,
commit deadlines, idle exit) and one worker thread that does the disk work in FIFO order:

  persist job (rank, slot, generation, step):
    mark the slot busy → persist.persist_slot() into the step's staging dir → write the rank's
    marker → release the slot → if coordinator and every rank's marker is there: commit, prune.
  a commit still waiting for other nodes' ranks is retried from the loop until commit_timeout.

The coordinator is the agent that serves global rank 0; it holds the save directory's job lock
(joblock.py). On a failed persist (disk full, read-only file system, a slot overwritten) the step's
staging dir is removed, nothing is pruned, and the error goes to the audit log and to the trainer's
next flush.

SIGTERM and the grace deadline. A trainer that gets SIGTERM tells the agent at once (``term``, with
the signal's time), even when its main thread is stuck. The trainers then agree on a step and save it
(``term_step``); if that step is not committed by ``fallback_at`` (the deadline less a reserve for
the write), the agent persists the newest snapshot complete on all its ranks itself. The agent's own
SIGTERM (a node shutdown) starts the same clock and makes it leave as soon as its work is done; at
the deadline it abandons a commit in flight (its staging dir goes; nothing half-written is visible).
"""
from __future__ import annotations

import hmac
import os
import queue
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from easyckpt import faults
from easyckpt.agent.persist import persist_slot
from easyckpt.config import Config
from easyckpt.formats import jobkey, protocol, shm
from easyckpt.formats.reap import reap_dead_jobs
from easyckpt.storage import retention
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.joblock import JobLock
from easyckpt.storage.savedir import SaveDir

HELLO_WAIT = 10.0   # seconds a new agent waits for its first trainer before it leaves

ABANDONED = "abandoned: its trainers died before every rank's shard of the step was written"


@dataclass
class _Client:
    reader: protocol.LineReader = field(default_factory=protocol.LineReader)
    rank: Optional[int] = None
    said_bye: bool = False
    pid: int = 0
    authed: bool = False          # its first message carried the job's key


@dataclass
class _Job:
    kind: str                      # "persist" | "commit"
    step: int
    rank: int = -1
    slot: int = -1
    generation: int = 0
    reason: str = "interval"
    epoch: int = 0                 # persists asked for before the trainers last died are stale


class Agent:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.job_id = cfg.job_id
        self.log = AuditLog(cfg.audit_log, "agent")
        self.savedir = SaveDir(cfg.save_dir, cfg.naming, self.job_id)
        self.key = jobkey.read(self.job_id)    # the spawning trainer created it; refused if planted
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(protocol.address(self.job_id))   # raises if an agent of this job is alive
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.clients: Dict[socket.socket, _Client] = {}
        self.world_size: Optional[int] = None
        self.local_ranks: Set[int] = set()
        self.dead_ranks: Set[int] = set()
        self.jobs: "queue.Queue[_Job]" = queue.Queue()
        self.results: "queue.Queue[Tuple[_Job, Optional[str]]]" = queue.Queue()
        self.outstanding = 0
        self.pending_commits: Dict[int, float] = {}     # step -> deadline
        self.newest_committed = -1                      # by this agent: an older step is never committed after it
        self.done: Dict[Tuple[int, int], Optional[str]] = {}   # (rank, step) -> error or None
        self.flush_waiters: List[Tuple[socket.socket, int, int]] = []
        self.queued: Set[Tuple[int, int]] = set()
        self.idle_since: Optional[float] = time.monotonic()
        self.ever_connected = False
        self.coordinator = False
        self.stop = False
        self.views: Dict[str, shm.AgentView] = {}
        self.epoch = 0
        self.death_step: Optional[int] = None
        self.lock = JobLock(cfg.save_dir, self.job_id, cfg.job_name)
        self.last_error: Optional[str] = None
        self.failed: Dict[int, str] = {}        # step -> why it failed (trainers waiting for it ask status)
        self.refused: List[str] = []            # hellos refused (another world size, a second job): said to
                                                # the running trainers through status, so not only in a log
        self.slowest_write = 0.0                # seconds of the slowest persist + commit seen
        self.got_sigterm = False
        self.leaving = False                    # the agent itself got SIGTERM
        self.term_at: Optional[float] = None    # wall time of the SIGTERM being served
        self.term_step: Optional[int] = None    # the step the trainers agreed to save for it
        self.fallback_at = self.hard_deadline = 0.0   # monotonic
        self.fallback_done = False
        threading.Thread(target=self._worker, daemon=True, name="easyckpt-persist").start()

    # ---- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "got_sigterm", True))
        self.log.emit("agent_start", job_id=self.job_id, save_dir=self.cfg.save_dir)
        self._clean_leftovers()
        while not self.stop:
            for key, _ in self.sel.select(timeout=0.05):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.fileobj)
            self._drain_results()
            self._check_commits()
            if self._check_term() or self._should_exit():
                break
            if self.lock.held and not self._busy():
                self.lock.release()     # idle: another job may use the directory now
        self._shutdown()

    def _busy(self) -> bool:
        # connections that never said hello (liveness probes) do not count
        return any(c.rank is not None for c in self.clients.values()) or bool(self.outstanding or self.pending_commits)

    def _should_exit(self) -> bool:
        if self._busy():
            self.idle_since = None
            return False
        if self.leaving:
            return True          # the node is going down: nothing left to write
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
        if not self.ever_connected:   # the trainer that started us says hello within a second or so
            return now - self.idle_since > min(HELLO_WAIT, self.cfg.agent_start_timeout)
        if not self.dead_ranks:
            return True          # every trainer said bye: the job is done
        return now - self.idle_since > self.cfg.agent_idle_timeout

    def _shutdown(self) -> None:
        self.sel.unregister(self.listener)
        self.listener.close()    # first, so no trainer attaches to an agent that is leaving
        for view in self.views.values():
            view.close()
        if not any(c.rank is not None and not c.said_bye for c in self.clients.values()):
            removed = [p for p in shm.segments_of(self.job_id) if shm.unlink_quiet(p)]
            if removed:
                self.log.emit("shm_release", segments=len(removed))
            jobkey.remove(self.job_id)
        self.lock.release()
        self.log.emit("agent_exit", job_id=self.job_id)
        self.log.close()

    def _clean_leftovers(self) -> None:
        self.savedir.remove_staging(self.log)
        reap_dead_jobs(self.log, keep=self.job_id)

    # ---- messages -------------------------------------------------------------------------

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        uid = protocol.peer_uid(conn)
        if uid != os.geteuid():     # promise 9: another user's process never gets a word in
            self.log.emit("refused", message=f"connection from uid {uid} (not this job's user) closed")
            conn.close()
            return
        conn.setblocking(False)
        self.sel.register(conn, selectors.EVENT_READ)
        self.clients[conn] = _Client()

    def _read(self, conn: socket.socket) -> None:
        client = self.clients[conn]
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._disconnect(conn)
            return
        try:
            for line in client.reader.feed(data):
                try:
                    msg = protocol.parse(line)
                    if not client.authed:
                        if not hmac.compare_digest(str(msg.get("key", "")), self.key):
                            raise protocol.BadMessage("the first message must carry the job's key")
                        client.authed = True
                    if msg["op"] in ("persist", "flush", "bye") and client.rank not in (None, msg["rank"]):
                        raise protocol.BadMessage(f"{msg['op']} for rank {msg['rank']} on a connection that "
                                                  f"said hello as rank {client.rank}")
                except protocol.BadMessage as exc:
                    self._refuse_message(conn, client, str(exc))
                    if not client.authed:
                        self._disconnect(conn)
                        return
                    continue
                self._handle(conn, client, msg)
                if conn not in self.clients:
                    return
        except protocol.BadMessage as exc:     # a line too long: nothing sane comes after it
            self._refuse_message(conn, client, str(exc))
            self._disconnect(conn)

    def _refuse_message(self, conn: socket.socket, client: _Client, why: str) -> None:
        self.log.emit("refused", rank=client.rank, message=f"bad message: {why}")
        self._send(conn, {"op": "error", "ok": False, "error": why})

    def _disconnect(self, conn: socket.socket) -> None:
        client = self.clients.pop(conn)
        self.sel.unregister(conn)
        conn.close()
        self.flush_waiters = [w for w in self.flush_waiters if w[0] is not conn]
        if client.rank is None:
            return
        if client.said_bye:
            self.dead_ranks.discard(client.rank)
            self.local_ranks.discard(client.rank)
            return
        self.dead_ranks.add(client.rank)
        self.log.emit("trainer_lost", rank=client.rank)
        if not any(c.rank is not None for c in self.clients.values()):
            self._persist_after_death()

    def _handle(self, conn: socket.socket, client: _Client, msg: Dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "hello":
            rank = msg["rank"]
            refused = self._refuse(rank, msg["pid"], msg["world_size"], client)
            if refused:
                self.ever_connected = True     # an agent started only for this trainer leaves at once
                self._fail_loudly("hello", refused, rank)
                self.refused.append(f"a trainer (rank {rank}, pid {msg['pid']}) was refused: {refused}")
                self._send(conn, {"op": "hello", "ok": False, "error": refused})
                return
            for other_conn, other in list(self.clients.items()):
                if other is not client and other.rank == rank:
                    # a restarted trainer of this rank: the old connection outlived its trainer (held open by
                    # a surviving child process); it must not keep the agent alive or count as this rank
                    self.log.emit("trainer_replaced", rank=rank)
                    other.rank = None
                    self._disconnect(other_conn)
            if not self._trainers():
                self._new_trainers(msg["world_size"])
            client.rank, client.pid = rank, msg["pid"]
            self.world_size = msg["world_size"]
            self.coordinator = self.coordinator or client.rank == 0
            self.ever_connected = True
            self.local_ranks.add(client.rank)
            self.dead_ranks.discard(client.rank)
            self._release_stale(client.rank)
            self._send(conn, {"op": "hello", "ok": True, "agent_pid": os.getpid()})
        elif op in ("persist", "flush", "bye") and client.rank is None:
            self._refuse_message(conn, client, f"{op} before hello")
        elif op == "persist":
            self._enqueue(_Job("persist", msg["step"], msg["rank"], msg["slot"], msg["generation"]))
        elif op == "flush":
            rank, step = msg["rank"], msg["step"]
            if (rank, step) not in self.done:   # e.g. this agent replaced one that died: persist it now
                self._enqueue(_Job("persist", step, rank, msg["slot"], msg["generation"], reason="finalize"))
            self.flush_waiters.append((conn, rank, step))
            self._answer_flushes()
        elif op == "bye":
            client.said_bye = True
            for i in (0, 1):   # the trainer unlinks its slots; our mappings must not keep them alive
                view = self.views.pop(shm.slot_path(self.job_id, client.rank, i), None)
                if view is not None:
                    view.close()
        elif op == "term":
            self._on_term(msg["at"], f"rank {msg['rank']}")
        elif op == "term_step":
            self.term_step = msg["step"]
        elif op == "damaged":
            self._enqueue(_Job("damaged", msg["step"], reason=msg["reason"]))
        elif op == "status":
            self._send(conn, self._status())

    def _fail_loudly(self, what: str, err: str, rank: Optional[int]) -> None:
        """An error no step carries: the audit log, the agent's own log, and the next status."""
        self.last_error = f"{what}: {err}"
        self.log.emit("error", rank=rank, message=err)
        try:
            print(f"easyckpt agent: {what}: {err}", file=sys.stderr, flush=True)
        except OSError:
            pass

    def _trainers(self) -> List[_Client]:
        return [c for c in self.clients.values() if c.rank is not None]

    def _new_trainers(self, world_size: int) -> None:
        """The first hello after every earlier trainer is gone (a restart, or a new run in the same
        directory): what this agent learnt from the earlier trainers must not decide for the new ones.
        Work already queued for the earlier ones (the persist after their death) still completes."""
        if not self.ever_connected:
            return
        self.epoch += 1
        self.newest_committed = -1
        # a restarted run redoes step numbers: an earlier run's failed or finished shards of a step must not
        # answer the new run's flush or commit wait for it
        self.failed.clear()
        self.done.clear()
        self.log.emit("new_trainers", epoch=self.epoch, world_size=world_size,
                      message="earlier trainers are gone; their pending steps no longer decide what commits")

    def _refuse(self, rank: int, pid: int, world_size: int, client: _Client) -> Optional[str]:
        """Why a hello cannot be accepted (promise 8: one job per directory), or None."""
        live = [c for c in self._trainers() if c is not client and shm.pid_alive(c.pid)]
        if live and self.world_size is not None and world_size != self.world_size:
            return (f"rank {rank} (pid {pid}) says world_size={world_size}, but this job's running trainers "
                    f"(ranks {sorted(c.rank for c in live)}) have world_size={self.world_size}: one job per "
                    f"save_dir and job_name; give the other job another save_dir or job_name")
        for other in self.clients.values():
            if other is not client and other.rank == rank and other.pid != pid and shm.pid_alive(other.pid):
                return (f"rank {rank} of this job is already running (pid {other.pid}) with save_dir "
                        f"{self.cfg.save_dir}: two jobs with the same save_dir and job_name; give the second one "
                        f"another save_dir")
        if rank == 0:
            holder = self.lock.acquire()
            if holder is not None:
                return (f"save_dir {self.cfg.save_dir} is in use by {holder}; two jobs must not share a save "
                        f"directory: give this one another save_dir, or stop the other job first")
        return None

    def _status(self) -> Dict[str, Any]:
        now = time.time()
        return {"op": "status", "ok": True, "agent_pid": os.getpid(), "job_id": self.job_id,
                "save_dir": self.cfg.save_dir, "world_size": self.world_size, "coordinator": self.coordinator,
                "connected": sorted(c.rank for c in self.clients.values() if c.rank is not None),
                "dead_ranks": sorted(self.dead_ranks), "pending_commits": sorted(self.pending_commits),
                "outstanding": self.outstanding, "last_error": self.last_error, "leaving": self.leaving,
                "failed_steps": {str(k): v for k, v in sorted(self.failed.items())[-16:]},
                "refused": len(self.refused), "last_refused": self.refused[-4:],
                "sigterm": None if self.term_at is None else {
                    "seconds_ago": round(now - self.term_at, 3), "agreed_step": self.term_step,
                    "deadline_in": round(self.term_at + self.cfg.grace_deadline - now, 3),
                    "fallback_done": self.fallback_done}}

    def _send(self, conn: socket.socket, msg: Dict[str, Any]) -> None:
        try:
            conn.setblocking(True)
            conn.sendall(protocol.encode(msg))
            conn.setblocking(False)
        except OSError:
            pass   # the trainer is gone; its disconnect is handled by the loop

    def _enqueue(self, job: _Job) -> None:
        job.epoch = self.epoch
        if job.kind == "persist":
            if (job.rank, job.step) in self.queued:
                return
            self.queued.add((job.rank, job.step))
        self.outstanding += 1
        self.jobs.put(job)

    def _answer_flushes(self) -> None:
        keep = []
        for conn, rank, step in self.flush_waiters:
            if (rank, step) in self.done:
                err = self.done[(rank, step)]
                self._send(conn, {"op": "flush", "ok": err is None, "step": step, "error": err})
            else:
                keep.append((conn, rank, step))
        self.flush_waiters = keep

    def _release_stale(self, rank: int) -> None:
        """A reservation nobody will serve (left by an agent that died) would pin a slot forever."""
        for i in (0, 1):
            path = shm.slot_path(self.job_id, rank, i)
            if not os.path.exists(path) or any(j == (rank, i) for j in self._queued_slots()):
                continue
            try:
                slot = shm.Slot(path, writable=False)
            except OSError as exc:     # UntrustedFileError included: never touch another user's file
                self.log.emit("error", rank=rank, message=str(exc))
                continue
            gen = slot.state()[1] if slot.mm is not None and slot.size >= shm.HEADER_BYTES else 0
            slot.close()
            if gen:
                self._view(rank, i).set(busy=0, released=gen)

    def _queued_slots(self) -> List[Tuple[int, int]]:
        with self.jobs.mutex:
            return [(j.rank, j.slot) for j in self.jobs.queue if j.kind == "persist"]

    # ---- after trainers died --------------------------------------------------------------

    def _persist_after_death(self) -> None:
        """Every local trainer is gone without saying bye: persist the newest step that is complete on
        all of them (a rank killed mid-copy may be one step behind), unless storage already has it."""
        if not self.dead_ranks:
            return
        per_rank = self._snapshots_of(self.dead_ranks)
        common = set.intersection(*(set(s) for s in per_rank.values())) if per_rank else set()
        step = max(common) if common else None
        self._abandon_other_steps(step)
        if step is not None:
            self._persist_from_slots(step, per_rank, "trainer died")

    def _snapshots_of(self, ranks: Set[int]) -> Dict[int, Dict[int, Tuple[int, int]]]:
        """rank -> {step: (slot, generation)} of its complete snapshots."""
        per_rank: Dict[int, Dict[int, Tuple[int, int]]] = {}
        for rank in ranks:
            per_rank[rank] = {}
            for i in (0, 1):
                try:
                    slot = shm.Slot(shm.slot_path(self.job_id, rank, i), writable=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    self.log.emit("error", rank=rank, message=str(exc))
                    continue
                hdr = slot.read_header()
                if hdr is not None:
                    per_rank[rank][hdr.step] = (i, hdr.generation)
                slot.close()
        return per_rank

    def _persist_from_slots(self, step: int, per_rank: Dict[int, Dict[int, Tuple[int, int]]], reason: str) -> bool:
        """Persist ``step`` of every rank in ``per_rank`` unless storage already has it; True if it had to."""
        done = self.savedir.committed()
        if done and done[0][0] >= step:
            return False
        event = "persist_after_death" if reason == "trainer died" else "deadline_fallback"
        self.log.emit(event, step=step, ranks=sorted(per_rank))
        for rank, steps in per_rank.items():
            slot, gen = steps[step]
            if self.done.get((rank, step), "not done") is None and os.path.isdir(self.savedir.staging_path(step)):
                continue
            self._enqueue(_Job("persist", step, rank, slot, gen, reason=reason))
        return True

    # ---- SIGTERM: the grace deadline ---------------------------------------------------------

    def _on_term(self, at: float, who: str) -> None:
        if self.term_at is not None and self.term_at <= at:
            return
        self.term_at, self.fallback_done = at, False
        grace = self.cfg.grace_deadline
        # leave room for writing the fallback: twice the slowest write seen, at least a tenth of the grace
        reserve = max(0.1 * grace, 2 * self.slowest_write)
        left = at + grace - time.time()
        self.hard_deadline = time.monotonic() + left
        self.fallback_at = time.monotonic() + max(0.0, left - reserve)
        self.log.emit("sigterm_notice", source=who, deadline_in=round(left, 3),
                      fallback_in=round(max(0.0, left - reserve), 3))

    def _check_term(self) -> bool:
        """Serve the grace deadline; True when the agent must leave now."""
        if self.got_sigterm and not self.leaving:
            self.leaving = True
            self._on_term(time.time(), "agent")
        if self.term_at is None:
            return False
        now = time.monotonic()
        if not self.fallback_done and now >= self.fallback_at:
            self.fallback_done = True
            self._deadline_fallback()
        if self.leaving and now >= self.hard_deadline:
            self._abandon_all("the grace deadline after SIGTERM has passed")
            return True
        return False

    def _deadline_fallback(self) -> None:
        """The trainers did not commit the agreed step in time (a long step, a hung collective): persist
        the newest snapshot that is complete on every rank of this node."""
        ranks = set(self.local_ranks)
        per_rank = self._snapshots_of(ranks)
        common = set.intersection(*(set(s) for s in per_rank.values())) if per_rank else set()
        if not common:
            self.log.emit("error", message="grace deadline: no snapshot is complete on every rank of this node; "
                                           "nothing to persist")
            return
        step = max(common)
        if not self._persist_from_slots(step, per_rank, "grace deadline"):
            self.log.emit("deadline_fallback", step=step, message="already committed")

    def _term_served(self, step: int) -> None:
        if self.term_at is not None and self.term_step is not None and step >= self.term_step:
            self.log.emit("sigterm_served", step=step, seconds=round(time.time() - self.term_at, 3))
            if not self.leaving:
                self.term_at, self.term_step = None, None

    def _abandon_all(self, why: str) -> None:
        for path in self.savedir.staging_dirs():
            self.log.emit("abandon", path=path, message=why)
            self.savedir.remove_staging(self.log, only=path)
        self.log.emit("deadline_exit", message=why, outstanding=self.outstanding)

    def _abandon_other_steps(self, keep: Optional[int]) -> None:
        """Every local trainer died: a step some rank had not handed over yet can never be completed by
        them (a restarted job redoes it, and its shards must not be mixed with these). Drop its staging
        and pending commit, and the persists still queued for it, so that nothing waits for it."""
        self.epoch, self.death_step = self.epoch + 1, keep
        self.newest_committed = -1   # restarted trainers may resume from an older step and redo newer ones
        for step in sorted(set(self.pending_commits) - {keep}):
            self.pending_commits.pop(step)
        # the staging dirs go in the persist thread, after whatever it is writing now (queue order)
        self._enqueue(_Job("abandon", -1 if keep is None else keep))

    def _remove_abandoned_staging(self, keep: int) -> None:
        keep_dir = None if keep < 0 else self.savedir.staging_path(keep)
        for path in self.savedir.staging_dirs():
            if path != keep_dir:
                self.log.emit("abandon", path=path, message="its trainers died before every rank's shard of "
                                                            "this step was written; a restarted job redoes it")
                self.savedir.remove_staging(self.log, only=path)

    # ---- worker: the disk work ------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job.kind == "persist" and job.epoch < self.epoch and job.step != self.death_step:
                    err = ABANDONED
                elif job.kind in ("persist", "commit"):
                    err = self._persist(job) if job.kind == "persist" else self._commit(job.step, epoch=job.epoch)
                elif job.kind == "abandon":
                    err = self._remove_abandoned_staging(job.step)
                elif job.kind == "damaged":
                    err = None
                    self.savedir.mark_damaged(job.step, job.reason, self.log)
                elif job.kind == "drop":
                    self.savedir.remove_staging(self.log, step=job.step)
                else:
                    raise ValueError(f"unknown job kind {job.kind!r}")
            except Exception as exc:  # noqa: BLE001 - reported, never fatal to the agent
                err = f"{type(exc).__name__}: {exc}"
            self.results.put((job, err))

    def _view(self, rank: int, slot: int) -> shm.AgentView:
        path = shm.slot_path(self.job_id, rank, slot)
        if path not in self.views:
            self.views[path] = shm.AgentView(path)
        return self.views[path]

    def _persist(self, job: _Job) -> Optional[str]:
        path = shm.slot_path(self.job_id, job.rank, job.slot)
        view = self._view(job.rank, job.slot)
        staging = self.savedir.staging_path(job.step)
        view.set(busy=job.generation)
        try:
            faults.inject("agent.before_persist", job.rank)
            step, files, nbytes, seconds, info = persist_slot(path, job.generation, staging, job.rank,
                                                                 direct_io=self.cfg.direct_io,
                                                                 storage=self.savedir.storage)
            if step != job.step:
                raise RuntimeError(f"slot holds step {step}, expected {job.step}")
            self.savedir.write_marker(job.step, job.rank, files, info)
            faults.inject("agent.after_marker", job.rank)
        finally:
            view.set(busy=0, released=job.generation)
        self.slowest_write = max(self.slowest_write, seconds)
        self.log.emit("persist", step=job.step, rank=job.rank, bytes=nbytes, seconds=round(seconds, 6),
                      gbps=round(nbytes / max(seconds, 1e-9) / 1e9, 3), reason=job.reason)
        if self.coordinator:
            return self._commit(job.step, quiet=True, epoch=job.epoch)
        return None

    def _commit(self, step: int, quiet: bool = False, epoch: int = 0) -> Optional[str]:
        current = epoch == self.epoch     # a commit for trainers that are gone decides nothing for new ones
        if current and step < self.newest_committed:   # see _supersede: its last shard came after a newer commit
            self.results.put((_Job("wait_commit", step, epoch=epoch), None))
            return None
        markers = self.savedir.read_markers(step)
        if self.world_size is None or len(markers) < self.world_size:
            if quiet:
                self.results.put((_Job("wait_commit", step, epoch=epoch), None))
                return None
            return "not ready"
        t0 = time.perf_counter()
        final, nbytes = self.savedir.commit(step, self.world_size, self.log)
        if current:
            self.newest_committed = max(self.newest_committed, step)
        self.log.emit("commit", step=step, path=final, bytes=nbytes, seconds=round(time.perf_counter() - t0, 6))
        self.results.put((_Job("committed", step, epoch=epoch), None))
        self.savedir.prune(retention.KeepLast(self.cfg.max_ckpt_num, retention.protected(final)), self.log)
        return None

    # ---- results, flushes, commit deadlines (event loop) ---------------------------------------

    def _drain_results(self) -> None:
        while True:
            try:
                job, err = self.results.get_nowait()
            except queue.Empty:
                break
            if job.kind == "wait_commit":
                if job.epoch < self.epoch and job.step != self.death_step:
                    continue          # its trainers died meanwhile: abandoned, nobody will complete it
                if job.epoch == self.epoch and job.step < self.newest_committed:
                    self._supersede(job.step)
                    continue
                self.pending_commits.setdefault(job.step, time.monotonic() + self.cfg.commit_timeout)
                continue
            if job.kind == "committed":
                self.pending_commits.pop(job.step, None)
                self.failed.pop(job.step, None)
                if job.epoch == self.epoch:
                    for older in sorted(s for s in self.pending_commits if s < job.step):
                        self._supersede(older)
                self._term_served(job.step)
                continue
            self.outstanding -= 1
            if job.kind == "commit":
                if err == "not ready":
                    continue
                self.pending_commits.pop(job.step, None)
            if job.kind == "persist":
                self.queued.discard((job.rank, job.step))
                self.done[(job.rank, job.step)] = err
            if err is not None and err != ABANDONED:
                self._fail(job.step, err, job.rank)
        self._answer_flushes()

    def _supersede(self, step: int) -> None:
        """A newer step is committed while ``step`` still waits for some rank's shard. That rank skipped
        the snapshot (both its slots were busy persisting), so the shard will never come; committing
        it later would also move the tracker backwards. Drop it instead of waiting for commit_timeout
        (which kept the agent, and the shared memory, alive for that long)."""
        self.pending_commits.pop(step, None)
        staging = self.savedir.staging_path(step)
        if not os.path.isdir(staging):
            return       # committed meanwhile (a commit job queued twice): nothing to drop
        missing = sorted(set(range(self.world_size or 0)) - set(self.savedir.read_markers(step)))
        self.log.emit("abandon", step=step, message=f"superseded by the commit of step {self.newest_committed} "
                                                    f"before ranks {missing} handed over their shards of it")
        self._enqueue(_Job("drop", step))

    def _check_commits(self) -> None:
        now = time.monotonic()
        for step, deadline in list(self.pending_commits.items()):
            markers = self.savedir.read_markers(step)
            if self.world_size is not None and len(markers) >= self.world_size:
                if not any(j == step for j in self._queued_commits()):
                    self._enqueue(_Job("commit", step))
                    self.pending_commits[step] = deadline
            elif now > deadline:
                missing = sorted(set(range(self.world_size or 0)) - set(markers))
                self.pending_commits.pop(step)
                self._fail(step, f"commit timed out after {self.cfg.commit_timeout}s waiting for the "
                                 f"shards of ranks {missing}", None)

    def _queued_commits(self) -> List[int]:
        with self.jobs.mutex:
            return [j.step for j in self.jobs.queue if j.kind == "commit"]

    def _fail(self, step: int, err: str, rank: Optional[int]) -> None:
        self.last_error = f"step {step}: {err}"
        self.log.emit("error", step=step, rank=rank, message=err)
        try:
            print(f"easyckpt agent: step {step}: {err}", file=sys.stderr, flush=True)
        except OSError:
            pass     # the agent's log may sit on the very disk that is full
        self.pending_commits.pop(step, None)
        self.failed[step] = f"rank {rank}: {err}" if rank is not None else err
        # the staging dir goes with every rank's shard in it: no rank's shard of this step counts as done
        # any more, so a later persist of the step (after the trainers' death, a finalize) writes them all
        for key, done in list(self.done.items()):
            if key[1] == step and done is None:
                self.done[key] = f"step {step} failed: {self.failed[step]}"
        self._answer_flushes()
        self.savedir.remove_staging(self.log, step=step)
