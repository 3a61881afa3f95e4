"""The node agent: a long-lived process per (job, node) that persists and commits snapshots.

It never runs in a trainer, so storage never stalls training. It is a few objects, each with one job,
wired here; the loop thread owns all their state, and the persist worker thread shares none of it:

  server.py       the socket: who may talk, typed messages in, replies out
  coordinator.py  which ranks' shards of which step are durable, when a step commits, flush answers
  persister.py    the worker thread: persist, commit, prune, remove staging — one job at a time
  grace.py        the SIGTERM clock: when to save on the trainers' behalf, when to leave
  recovery.py     what to persist after the trainers died or at the grace deadline
  slots.py        the agent's reads and writes of the shm slots; jobdir.py its calls into storage
  replicas.py     peer replicas: this node's snapshots sent to other nodes' agents, theirs kept here
                  (peerserve.py), a lost node's state pulled back — threads of their own, never the loop
  localtier.py    the local tier: snapshots copied to this node's disk — a thread of its own

One turn of the loop: wait for a message or a worker result (at most 50 ms) → each message goes to
its handler below, which tells the coordinator → each result goes to the coordinator → the
coordinator's tick (pending commits, commit_timeout) → execute the coordinator's decisions (submit
jobs, answer flushes, log) → the grace clock (fallback, leave) → exit when idle → release the job
lock when idle. For the life of one persist, see coordinator.py and persister.py.

The coordinator is the agent that serves global rank 0; it holds the save directory's job lock. On
a failed persist or commit (disk full, read-only file system, a slot overwritten) the step's staging
dir is removed, nothing is pruned, and the error goes to the audit log, the agent's stderr and the
trainers (their next flush and status).
"""
from __future__ import annotations

import collections
import os
import signal
import socket
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from easyckpt import console
from easyckpt.agent import slots
from easyckpt.agent.coordinator import (
    Action,
    Answer,
    Cancel,
    Committed,
    Coordinator,
    Error,
    Log,
    RemoveStaging,
    Submit,
)
from easyckpt.agent.dirwatch import DirWatch
from easyckpt.agent.grace import Grace
from easyckpt.agent.jobdir import JobDir
from easyckpt.agent.jobs import CommitJob, Job, PersistJob, Result
from easyckpt.agent.localtier import LocalTier
from easyckpt.agent.nodelogs import NodeLogs
from easyckpt.agent.persister import Persister, Worker, disk_work
from easyckpt.agent.recovery import Recovery
from easyckpt.agent.replicas import Replicas, Table
from easyckpt.agent.server import Client, Server, Transport
from easyckpt.config import Config
from easyckpt.errors import LeaseLost
from easyckpt.formats import protocol
from easyckpt.formats.replies import (
    FlushReply,
    HelloReply,
    ListenReply,
    PeersReply,
    ReplicaFetchReply,
    ReplicaListReply,
    StatusReply,
    reply_from_wire,
)
from easyckpt.ipc import jobkey, reap, shm
from easyckpt.storage.auditlog import AuditLog

HELLO_WAIT = 10.0   # seconds a new agent waits for its first trainer before it leaves
POLL = 0.05         # the loop's longest sleep: commit deadlines and the grace clock are this precise


class Agent:
    def __init__(self, cfg: Config, server: Optional[Transport] = None,
                 persister: Optional[Callable[[Callable[[Job], Result]], Worker]] = None):
        """``server``: where messages come from (server.Server on the job's socket by default; an in-process
        one in easyckpt/_testing/); ``persister``: what runs the disk work (the Persister thread by default)."""
        self.cfg = cfg
        self.job_id = cfg.job_id
        self.log = AuditLog(cfg.audit_log, "agent")
        self.server: Transport = server if server is not None else Server(
            self.job_id, jobkey.read(self.job_id), self.log)    # the key: refused if planted
        self.server.handler = self
        self.jobdir = JobDir(cfg, self.log)
        self.lock = self.jobdir.lock()
        self.coordinator = Coordinator(cfg.commit_timeout, time.monotonic, self.jobdir.shards)
        self.grace = Grace(cfg.grace_deadline)
        self.recovery = Recovery(self.job_id, self.jobdir, self.coordinator, self.log)
        self.persister: Worker = (persister or Persister)(disk_work(self.job_id, self.jobdir, self.log, cfg.direct_io))
        self.server.watch(self.persister.wake_fd())
        self.replicas = Replicas(cfg, self.log)
        self.server.watch(self.replicas.wake_fd())
        self.tier = LocalTier(cfg, self.log)      # its own thread, when save_local_interval is set
        self.local_ranks: Set[int] = set()
        self.dead_ranks: Set[int] = set()
        self.ever_connected = False
        self.idle_since: Optional[float] = time.monotonic()
        self.refused: List[str] = []            # hellos refused (another world size, a second job): said to
                                                # the running trainers through status, so not only in a log
        self.got_sigterm = False
        self.notices: List[str] = []            # what rank 0's console must hear, through status (dirwatch.py)
        self.logs = NodeLogs(cfg, self.log)
        self.dirwatch = DirWatch([cfg.node_dir] if cfg.in_store else [cfg.save_dir, cfg.node_dir])
        self.stopped: Optional[str] = None      # why this agent persists no more (its save dir is another job's)
        # for the trainers' console ("checkpoint-15 committed (1.2 GiB, 0.4 s ...)"), through status
        self.asked: Dict[int, float] = {}       # step -> when a trainer first asked to persist it
        self.commits: Deque[Tuple[int, int, float]] = collections.deque(maxlen=8)   # step, bytes, seconds
        # step -> why retention deleted it after its commit, through status: a trainer still waiting for that
        # commit stops at once, naming why, instead of at commit_timeout. Forgotten when the step is asked for
        # again (a new persist of the name, new trainers): then it is a new commit that is awaited.
        self.deleted: Dict[int, str] = {}
        self._handlers: Dict[type, Callable[[socket.socket, Client, Any], None]] = {
            protocol.Hello: self._hello, protocol.Persist: self._persist, protocol.Flush: self._flush,
            protocol.Bye: self._bye, protocol.Term: self._term, protocol.TermStep: self._term_step,
            protocol.Damaged: self._damaged, protocol.Quarantine: self._quarantine, protocol.Status: self._status, protocol.Listen: self._listen,
            protocol.Peers: self._peers, protocol.ReplicaList: self._replica_list,
            protocol.ReplicaFetch: self._replica_fetch}

    # ---- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "got_sigterm", True))
        self.start()
        while True:
            self.server.poll(POLL)
            if self.turn():
                break
            self.logs.tick()
        self.shutdown()

    def start(self) -> None:
        self.log.emit("agent_start", job_id=self.job_id, save_dir=self.cfg.save_dir)
        self.jobdir.clean_leftovers()

    def turn(self) -> bool:
        """One turn of the loop after the server delivered what came (the module docstring's order); True
        when the agent must leave now."""
        for conn, reply in self.replicas.replies():
            self.server.send(conn, reply)
        for result in self.persister.results():
            if isinstance(result.job, PersistJob) and result.error is None:
                self.grace.wrote(result.seconds)
                self.jobdir.marker_written(result.job.step)
            if isinstance(result.job, CommitJob) and result.error is None:
                step = result.job.step
                asked = self.asked.pop(step, None)
                self.commits.append((step, result.nbytes,
                                     0.0 if asked is None else round(time.monotonic() - asked, 3)))
                for older in [s for s in self.asked if s < step]:
                    del self.asked[older]     # superseded or failed: never committed now
                self.deleted.pop(step, None)
                for gone in result.pruned:
                    self.deleted[gone] = (f"retention deleted it after the commit of step {step} "
                                          f"(max_ckpt_num={self.cfg.max_ckpt_num} keeps this job's newest "
                                          f"commits, by run, then step; see the audit log's delete events)")
                for old in sorted(self.deleted)[:-16]:
                    del self.deleted[old]
            self.coordinator.on_result(result)
        self.coordinator.tick()
        self._execute()
        self.persister.acted()      # the commits those results complete are queued: the worker may go on
        for path in self.dirwatch.replaced():
            self._dir_replaced(path)
        if self._serve_grace() or self._should_exit():
            return True
        if self.lock.held:
            self._lock_call(self.lock.refresh if self._busy() else self.lock.release)
        return False

    def _dir_replaced(self, path: str) -> None:
        """A directory of the job was replaced under it (dirwatch.py): the logs are opened there again, and the
        lock taken there again if this agent held it; if another job holds it now, this agent stops persisting
        (two jobs must never write one save dir) and training goes on with memory snapshots. Said on rank 0's
        console."""
        text = (f"the directory {path} was replaced under the running job (removed and made again, or another one "
                f"moved or mounted there)")
        try:
            self.logs.reopen()
            text += ": the audit log and the agent's log are opened there again"
        except OSError as exc:
            self.stopped = f"its logs cannot be opened there again ({exc})"
        if self.lock.held and self.stopped is None:
            self.lock.release()
            holder = self.lock.acquire()
            if holder is None:
                text += "; the job's lock is taken there again"
            else:
                self.stopped = f"{holder} holds its lock now"
        if self.stopped is not None:
            text += (f"; {self.stopped}, so this job persists no more steps there (training goes on with memory "
                     f"snapshots; relaunch the job with a save_dir of its own)")
        self.log.emit("error", path=path, message=text)
        self.notices.append(text)

    def _lock_call(self, call: Callable[[], None]) -> None:
        """Renew or release the job lock. On an object store that does not answer, the lease stays as it is
        (it ends by itself LEASE_S after its last renewal); the outage is logged once (jobdir.py). A lease another
        job took over meanwhile is said in the logs and the trainers' next status, and this job commits no more
        (jobdir.py) unless its rank 0 takes the lease again."""
        try:
            call()
        except OSError as exc:
            self.jobdir.outage("renewing or releasing the job's lease", exc)
        except LeaseLost as exc:
            self.coordinator.refused("the job's lease", str(exc), None)
            self._execute()

    def _busy(self) -> bool:
        # connections that never said hello (liveness probes) do not count
        return (bool(self.server.trainers()) or self.coordinator.busy() or self.replicas.busy()
                or self.tier.busy())

    def _should_exit(self) -> bool:
        if self._busy():
            self.idle_since = None
            return False
        if self.grace.leaving:   # the node is going down: nothing left to write, once its newest snapshot
            return not self.replicas.unsent()     # is on its holders (the grace deadline bounds the wait)
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
        if not self.ever_connected:   # the trainer that started us says hello within a second or so
            return now - self.idle_since > min(HELLO_WAIT, self.cfg.agent_start_timeout)
        if not self.dead_ranks:
            return True          # every trainer said bye: the job is done
        if now - self.idle_since <= self.cfg.agent_idle_timeout:
            return False
        co = self.coordinator
        self.log.record("idle_exit", ranks=sorted(self.dead_ranks), failed_steps=sorted(co.failed),
                        message=f"the trainers of ranks {sorted(self.dead_ranks)} are gone and none came back within "
                                f"agent_idle_timeout={self.cfg.agent_idle_timeout:g}s; nothing is left to persist"
                                + (f" (last error: {co.last_error})" if co.last_error else ""))
        return True

    def _serve_grace(self) -> bool:
        """Serve the grace deadline; True when the agent must leave now."""
        if self.got_sigterm:
            if not self.grace.leaving:
                self.replicas.kick()     # the node is being drained: its newest snapshot to a peer now
            self._notice(self.grace.own_sigterm())
        due = self.grace.due()
        if due.fallback:
            self.recovery.at_deadline(self.local_ranks)
            self._execute()
        if due.leave:
            why = "the grace deadline after SIGTERM has passed"
            if self.coordinator.commits:
                # staging dirs are the job's, shared by every node: only the coordinator, which commits or
                # fails them, may remove one; another node's agent leaving at its own deadline would take
                # the other nodes' shards (a fallback step being committed) with it
                self.jobdir.drop_all_but(None, why)
            self.log.emit("deadline_exit", message=why, outstanding=self.coordinator.outstanding)
        return due.leave

    def _notice(self, fields: Optional[Dict[str, Any]]) -> None:
        if fields is not None:
            self.log.emit("sigterm_notice", **fields)

    def shutdown(self) -> None:
        self.server.close()
        self.replicas.close()
        all_left = not any(c.rank is not None and not c.said_bye for c in self.server.clients.values())
        # before the slots it copies from go; the last due snapshot copied unless the node is going down
        self.tier.close(finish=all_left and not self.grace.leaving)
        if all_left:
            reap.release_finished_job(self.job_id, self.log)
        self._lock_call(self.lock.release)
        self.log.emit("agent_exit", job_id=self.job_id)
        self.log.close()

    # ---- the coordinator's decisions ----------------------------------------------------------

    def _execute(self) -> None:
        for action in self.coordinator.take():
            self._do(action)

    def _do(self, action: Action) -> None:
        if isinstance(action, Submit):
            self.persister.submit(action.job)
        elif isinstance(action, Cancel):
            keep, epoch = action.keep, action.epoch
            self.coordinator.cancelled(self.persister.cancel(lambda j: j.epoch < epoch and j.step != keep))
        elif isinstance(action, Answer):
            self.server.send(action.to, FlushReply(action.error is None, action.step, action.error))
        elif isinstance(action, Log):
            self.log.emit(action.event, **action.fields)
        elif isinstance(action, Error):
            where = {} if action.step is None else {"step": action.step}
            self.log.record("error", **where, rank=action.rank, message=action.error)
            console.error(f"{action.what}: {action.error}")
        elif isinstance(action, RemoveStaging):
            self.jobdir.drop(action.step)
        elif isinstance(action, Committed):
            seconds = self.grace.committed(action.step)
            if seconds is not None:
                self.log.emit("sigterm_served", step=action.step, seconds=round(seconds, 3))

    # ---- messages (server.Handler) -------------------------------------------------------------

    def on_message(self, conn: socket.socket, client: Client, msg: protocol.Message) -> None:
        self._handlers[type(msg)](conn, client, msg)
        self._execute()

    def on_disconnect(self, conn: socket.socket, client: Client) -> None:
        self.coordinator.forget(conn)
        if client.rank is None:
            return
        if client.said_bye:
            self.dead_ranks.discard(client.rank)
            self.local_ranks.discard(client.rank)
            return
        self.dead_ranks.add(client.rank)
        self.log.emit("trainer_lost", rank=client.rank)
        if not self.server.trainers():
            self.recovery.after_death(self.dead_ranks)
            self._execute()

    def _hello(self, conn: socket.socket, client: Client, msg: protocol.Hello) -> None:
        refused = self._refusal(msg, client)
        if refused:
            self.ever_connected = True     # an agent started only for this trainer leaves at once
            self.coordinator.refused("hello", refused, msg.rank)
            self.refused.append(f"a trainer (rank {msg.rank}, pid {msg.pid}) was refused: {refused}")
            self.server.send(conn, HelloReply(False, error=refused))
            return
        for other_conn, other in list(self.server.clients.items()):
            if other is not client and other.rank == msg.rank:
                # a restarted trainer of this rank: the old connection outlived its trainer (held open by
                # a surviving child process); it must not keep the agent alive or count as this rank
                self.log.emit("trainer_replaced", rank=msg.rank)
                other.rank = None
                self.server.disconnect(other_conn)
        if not self.server.trainers() and self.ever_connected:
            self.deleted.clear()
            # the earlier trainers that died do not come back as such: the new ones decide when the job is done, so
            # a restart on fewer ranks that finishes lets the agent leave (and free the earlier ranks' slots) at once
            self.dead_ranks.clear()
            self.coordinator.new_trainers(msg.world_size)
            self._execute()    # cancel the earlier trainers' queued persists before any of the new ones'
        client.rank, client.pid = msg.rank, msg.pid
        self.coordinator.hello(msg.rank, msg.world_size)
        self.ever_connected = True
        self.local_ranks.add(msg.rank)
        self.dead_ranks.discard(msg.rank)
        busy = {j.slot for j in self.persister.queued_persists() if j.rank == msg.rank}
        slots.release_stale(self.job_id, msg.rank, busy, self.log)
        self.server.send(conn, HelloReply(True, agent_pid=os.getpid()))

    def _refusal(self, msg: protocol.Hello, client: Client) -> Optional[str]:
        """Why a hello cannot be accepted (docs/reliability.md promise 8: one job per directory), or None."""
        rank, pid, world_size = msg.rank, msg.pid, msg.world_size
        live = [c for c in self.server.trainers() if c is not client and shm.pid_alive(c.pid)]
        known = self.coordinator.world_size
        if live and known is not None and world_size != known:
            return (f"rank {rank} (pid {pid}) says world_size={world_size}, but this job's running trainers "
                    f"(ranks {sorted(c.rank for c in live if c.rank is not None)}) have world_size={known}: "
                    f"one job per save_dir and job_name; give the other job another save_dir or job_name")
        for other in self.server.clients.values():
            if other is not client and other.rank == rank and other.pid != pid and shm.pid_alive(other.pid):
                return (f"rank {rank} of this job is already running (pid {other.pid}) with save_dir "
                        f"{self.cfg.save_dir}: two jobs with the same save_dir and job_name; give the second one "
                        f"another save_dir")
        if rank == 0:
            try:
                holder = self.lock.acquire()
            except OSError as exc:      # the store does not answer: the job goes on without the lease
                self.jobdir.outage("taking the job's lease", exc)
                holder = None
            if holder is not None:
                return (f"save_dir {self.cfg.save_dir} is in use by {holder}; two jobs must not share a save "
                        f"directory: give this one another save_dir, or stop the other job first")
        return None

    def _persist(self, conn: socket.socket, client: Client, msg: protocol.Persist) -> None:
        if self.stopped is not None:
            self.coordinator.refuse(msg.rank, msg.step, f"not persisted: {self.stopped}")
            return
        self.asked.setdefault(msg.step, time.monotonic())
        self.deleted.pop(msg.step, None)
        self.coordinator.persist(msg.rank, msg.slot, msg.generation, msg.step)

    def _flush(self, conn: socket.socket, client: Client, msg: protocol.Flush) -> None:
        if self.stopped is not None:      # answered at once with why (the flush finds the step done, failed)
            self.coordinator.refuse(msg.rank, msg.step, f"not persisted: {self.stopped}")
        self.asked.setdefault(msg.step, time.monotonic())
        self.coordinator.flush(conn, msg.rank, msg.step, msg.slot, msg.generation)

    def _bye(self, conn: socket.socket, client: Client, msg: protocol.Bye) -> None:
        client.said_bye = True     # its slots go with it (the agent keeps no mapping of them)

    def _term(self, conn: socket.socket, client: Client, msg: protocol.Term) -> None:
        self._notice(self.grace.notice(msg.at, f"rank {msg.rank}"))

    def _term_step(self, conn: socket.socket, client: Client, msg: protocol.TermStep) -> None:
        self.grace.agreed(msg.step)

    def _damaged(self, conn: socket.socket, client: Client, msg: protocol.Damaged) -> None:
        self.coordinator.damaged(msg.step, msg.reason)

    def _quarantine(self, conn: socket.socket, client: Client, msg: protocol.Quarantine) -> None:
        self.coordinator.quarantine(msg.step, msg.reason)

    def _status(self, conn: socket.socket, client: Client, msg: protocol.Status) -> None:
        co = self.coordinator
        self.server.send(conn, StatusReply(
            ok=True, agent_pid=os.getpid(), job_id=self.job_id, save_dir=self.cfg.save_dir,
            world_size=co.world_size, coordinator=co.commits,
            connected=sorted(c.rank for c in self.server.trainers() if c.rank is not None),
            dead_ranks=sorted(self.dead_ranks), pending_commits=sorted(co.pending), outstanding=co.outstanding,
            last_error=co.last_error, leaving=self.grace.leaving, failed_steps=dict(sorted(co.failed.items())[-16:]),
            deleted_steps=dict(self.deleted),
            refused=len(self.refused), last_refused=self.refused[-4:], sigterm=self.grace.status(),
            notices=len(self.notices), last_notices=self.notices[-4:],
            commits=list(self.commits), replicas=self.replicas.status()))

    def _listen(self, conn: socket.socket, client: Client, msg: protocol.Listen) -> None:
        try:
            port = self.replicas.listen(msg.addr)
        except OSError as exc:
            self.server.send(conn, ListenReply(False, error=f"cannot listen on {msg.addr}: {exc}"))
            return
        self.server.send(conn, ListenReply(True, port=port))

    def _peers(self, conn: socket.socket, client: Client, msg: protocol.Peers) -> None:
        cfg = self.cfg
        self.replicas.set_table(Table(msg.node, msg.nnodes, msg.ranks_per_node, msg.secret, msg.table(),
                                      cfg.replication_factor, cfg.replication_jump))
        self.server.send(conn, PeersReply(True))

    def _replica_list(self, conn: socket.socket, client: Client, msg: protocol.ReplicaList) -> None:
        replicas = self.replicas
        replicas.call(conn, lambda: reply_from_wire({"op": "replica_list", **replicas.remote_steps(msg.rank)}),
                      lambda why: ReplicaListReply(False, error=why))

    def _replica_fetch(self, conn: socket.socket, client: Client, msg: protocol.ReplicaFetch) -> None:
        replicas = self.replicas
        replicas.call(conn, lambda: reply_from_wire({"op": "replica_fetch", **replicas.fetch(msg.rank, msg.step)}),
                      lambda why: ReplicaFetchReply(False, error=why))
