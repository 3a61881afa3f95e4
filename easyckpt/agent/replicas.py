"""Peer replicas: this node's newest snapshot also lives in the memory of other nodes, and a node that lost
its memory (a replacement for a lost host) gets its ranks' state back from them.

Placement. Nodes are numbered as torchrun numbers them (node_rank); node i's replicas go to nodes
i + jump, i + 2·jump, ... (mod the node count), replication_factor − 1 of them: with a jump of the
number of nodes per rack, every copy lives in another rack. ``holders(i)`` is the same rule read the other
way, so every agent knows where any rank's state lives without asking anyone.

Who knows what. The trainers tell their agent the table (node, node count, ranks per node, every
agent's TCP endpoint, the job's replica secret) after exchanging it through the job's c10d store
(engine/link/peers.py); the agent opens its TCP listener when asked for its endpoint. Nothing is sent before
the table is known.

Sending (one thread, ``_sender``). Every POLL seconds it looks at this node's slots: when a step is
complete on every local rank, is newer than what a holder has, and replica_interval snapshots after the
last one sent there, each rank's slot is pinned (the trainer does not overwrite it meanwhile) and
streamed to each holder at replica_bandwidth bytes/s at most, pausing while a local snapshot is being
copied. The trainers do nothing for it. The receiving side is peerserve.py.

Restoring (``fetch``, on a trainer's request, in a thread of its own). The holders of the rank's node are
asked for the step; the first that has it streams it into the rank's own slot on this node (checksum
and seqlock checked, peerwire.py), where the trainer's loader then reads it like any snapshot.
"""
from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from easyckpt.agent import slots
from easyckpt.agent.cadence import Cadence
from easyckpt.agent.mailbox import Mailbox
from easyckpt.agent.peerserve import PeerServer, receive_slot, send_slot
from easyckpt.agent.warmslots import Warm
from easyckpt.agent.warnings import Warnings
from easyckpt.config import Config
from easyckpt.errors import (
    BadSlotMeta,
    PeerError,
    PeerNotReady,
    SlotNotComplete,
    UntrustedFileError,
)
from easyckpt.formats.replies import (
    ReplicaHeld,
    ReplicaSent,
    ReplicaStatus,
    Reply,
)
from easyckpt.ipc import peerwire, priority, shm, slotread
from easyckpt.ipc.peerwire import Conn
from easyckpt.storage.auditlog import AuditLog

POLL = 0.01         # how often the sender looks at the slots' headers (a few bytes each) for a new snapshot
RETRY = 1.0         # seconds before a send that failed (a peer not up yet, gone, full) is tried again
STARVED_AFTER = 30.0   # seconds of failed sends to a holder before rank 0's console says replication starves


@dataclass(frozen=True)
class Table:
    """Where everything is: this node, the node count, ranks per node, every agent's endpoint."""

    node: int
    nnodes: int
    ranks_per_node: int
    secret: str = field(repr=False)
    endpoints: Dict[int, Tuple[str, int]]
    factor: int
    jump: int

    def targets(self, node: int) -> List[int]:
        """The nodes that hold node ``node``'s replicas, in order."""
        out: List[int] = []
        for k in range(1, self.factor):
            other = (node + k * self.jump) % self.nnodes
            if other != node and other not in out:
                out.append(other)
        return out

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


class Replicas:
    def __init__(self, cfg: Config, log: AuditLog):
        self.cfg, self.job_id, self.log = cfg, cfg.job_id, log
        self.table: Optional[Table] = None
        self.server: Optional[PeerServer] = None
        # Threads: the agent's loop (status, unsent, kick, set_table), the sender (_send_loop) and the fetch
        # pool (remote_steps, fetch) all touch what follows; ``lock`` guards every field that more than one
        # of them reads or writes (sent, _retry_at, _force), and readers take copies under it (``warnings`` has
        # a lock of its own).
        self.lock = threading.Lock()
        self.sent: Dict[int, Dict[str, Any]] = {}      # holder node -> the last step it got: step, bytes, seconds
        self.warnings = Warnings(log)
        self._wake = threading.Event()
        self._force = False
        self._seen: Tuple[Any, ...] = ()      # the slots' (rank, slot, (state, generation, step)) when last looked at
        self._per_rank: slots.PerRank = {}      # their complete snapshots, read when ``_seen`` changed
        self._held_back = False                 # the last send waited for a trainer's slot to be released
        self._retry_at: Dict[int, float] = {}   # holder node -> when to try again after a failed send
        self._failing: Dict[int, Tuple[float, str]] = {}   # holder node -> since when its sends fail, the last why
        self._sending = False
        self.cadence = Cadence()
        self.warm = Warm()            # this node's slots, kept mapped between sends
        self._every_said = 1
        self._closed = False
        self._sender: Optional[threading.Thread] = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="easyckpt-fetch")
        self._done: Mailbox[Tuple[Any, Reply]] = Mailbox()

    # ---- the loop's calls ---------------------------------------------------------------------

    def listen(self, addr: str) -> int:
        """Open the TCP listener on ``addr`` (once); its port."""
        if self.server is None:
            self.server = PeerServer(self.job_id, addr, self.log, self._error)
        return self.server.port

    def set_table(self, table: Table) -> None:
        with self.lock:
            old = self.table
            self.table = table
            for node in list(self.sent):      # a holder at a new address is a new node: it holds nothing yet
                if old is None or old.endpoints.get(node) != table.endpoints.get(node):
                    del self.sent[node]
            self._seen, self._retry_at, self._failing = (), {}, {}
        if self.server is not None:
            self.server.table = table
            self.server.peer_addrs = frozenset(a for a, _ in table.endpoints.values())
            self.server.secret = table.secret
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True, name="easyckpt-replicate")
            self._sender.start()
        self._wake.set()

    def kick(self) -> None:
        """Replicate the newest snapshot now, whatever replica_interval says (the node is being drained);
        nothing when replicas are off (no sender runs to serve it)."""
        if self._sender is None:
            return
        with self.lock:     # set and taken under the lock: a kick between the sender's read and reset stays
            self._force = True
        self._wake.set()

    def busy(self) -> bool:
        """A send is under way or asked for (kick): an agent leaving after SIGTERM waits for it."""
        with self.lock:
            return self._force or self._sending

    def unsent(self) -> bool:
        """Whether this node's newest complete snapshot has still to reach a holder that takes it (a holder
        whose last send failed does not count: a node being drained waits for what can arrive)."""
        t = self.table
        if t is None:
            return False
        ranks = sorted({seg.rank for seg in shm.list_segments(self.job_id) if not seg.replica})
        step = slots.newest_common(slots.complete_snapshots(self.job_id, ranks, self.log)) if ranks else None
        if step is None:
            return False
        with self.lock:
            sent, failing = dict(self.sent), set(self._retry_at)
        return any(sent.get(n, {}).get("step", -1) < step for n in t.targets(t.node)
                   if n in t.endpoints and n not in failing)

    def call(self, conn: Any, fn: Callable[[], Reply], failed: Callable[[str], Reply]) -> None:
        """Run ``fn`` (a list or fetch: network I/O) off the loop; its reply comes back through ``replies``
        (``failed(why)`` when it raised)."""
        def run() -> None:
            try:
                reply = fn()
            except Exception as exc:  # noqa: BLE001 - any failure is the trainer's answer, never the agent's end
                reply = failed(f"{type(exc).__name__}: {exc}")
            self._done.put((conn, reply))
        self._pool.submit(run)

    def wake_fd(self) -> int:
        return self._done.wake_fd()

    def replies(self) -> List[Tuple[Any, Reply]]:
        return self._done.take()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self.warm.close()
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False)

    def status(self) -> ReplicaStatus:
        t = self.table
        with self.lock:
            sent, errors, failing = dict(self.sent), self.warnings.recent(), dict(self._failing)
        now = time.monotonic()
        # said on rank 0's console (engine/link/reports.py): sends that fail for long are a node without a copy
        starved = {n: f"no replica has reached node {n} for {now - since:.0f} s (the last try: {why}); this node's "
                      f"newest snapshots have no copy on another node, so a lost node would resume from storage"
                   for n, (since, why) in sorted(failing.items()) if now - since >= STARVED_AFTER}
        holds = []
        for seg in shm.list_segments(self.job_id):
            if seg.replica:
                try:
                    done = slotread.read_complete(seg.path)
                except UntrustedFileError as exc:   # planted (a FIFO, another user's file): named, never waited on
                    self._error(str(exc))
                    continue
                except OSError:
                    continue
                if done is not None:
                    holds.append(ReplicaHeld(rank=seg.rank, step=done.step, bytes=done.header.data_capacity,
                                             from_node=t.node_of(seg.rank) if t else None))
        return ReplicaStatus(
            node=t.node if t else None, nnodes=t.nnodes if t else None, factor=self.cfg.replication_factor,
            listening=f"{self.server.addr}:{self.server.port}" if self.server else None,
            targets={n: "%s:%d" % t.endpoints[n] for n in t.targets(t.node) if n in t.endpoints} if t else {},
            sent={n: ReplicaSent(**v) for n, v in sorted(sent.items())}, holds=holds, every=max(self.cfg.replica_interval, self.cadence.every),
            errors=errors, starved=starved)

    # ---- restoring (the trainers' requests, in the pool) ------------------------------------------

    def remote_steps(self, rank: int) -> Dict[str, Any]:
        """The steps of ``rank`` that the holders of its node keep: {ok, steps: [[step, world_size, node]]}."""
        def ask(conn: Conn) -> Dict[str, Any]:
            conn.send_line({"op": "list", "rank": rank})
            return conn.read_line()
        steps: List[List[int]] = []
        problems: List[str] = []
        for holder, reply in self._ask_holders(rank, ask, problems):
            for item in reply.get("steps", []) if reply.get("ok") is True else []:
                if isinstance(item, list) and len(item) == 2 and all(peerwire._is_int(v, 1 << 62) for v in item):
                    steps.append([item[0], item[1], holder])
        return {"ok": True, "steps": steps, "problems": problems}

    def fetch(self, rank: int, step: int) -> Dict[str, Any]:
        """Pull ``rank``'s snapshot of ``step`` from a holder into the rank's own slot on this node."""
        def pull(conn: Conn) -> Tuple[int, int]:
            conn.send_line({"op": "get", "rank": rank, "step": step})
            head = conn.read_line()
            if head.get("ok") is not True:
                raise PeerError(str(head.get("error"))[:500])
            return receive_slot(conn, [shm.slot_path(self.job_id, rank, i) for i in (0, 1)], rank, step, head)
        t0 = time.perf_counter()
        problems: List[str] = []
        for holder, (index, nbytes) in self._ask_holders(rank, pull, problems):
            seconds = time.perf_counter() - t0
            self.log.emit("replica_restore", rank=rank, step=step, node=holder, bytes=nbytes,
                          seconds=round(seconds, 6))
            return {"ok": True, "slot": index, "bytes": nbytes, "seconds": round(seconds, 6), "node": holder}
        return {"ok": False, "error": f"no holder of rank {rank}'s replicas gave step {step}: "
                                      + ("; ".join(problems) or "none is known")}

    def _ask_holders(self, rank: int, talk: Callable[[Conn], Any], problems: List[str]) -> Iterator[Tuple[int, Any]]:
        """(holder node, what ``talk`` got from it) for each holder of ``rank``'s node that answered, in
        placement order; why each other one did not goes to ``problems``."""
        t = self._need_table()
        for holder in t.targets(t.node_of(rank)):
            if holder == t.node:
                continue
            try:
                conn = self._connect(t, holder)
                try:
                    result = talk(conn)
                finally:
                    conn.close()
            except (OSError, PeerError, ValueError) as exc:
                problems.append(f"node {holder}: {exc}")
                continue
            yield holder, result

    def _need_table(self) -> Table:
        if self.table is None:
            raise PeerError("the replica table is not known yet (no trainer sent it)")
        return self.table

    def _connect(self, t: Table, node: int) -> Conn:
        if node not in t.endpoints:
            raise PeerError(f"node {node}'s agent has no known address")
        sock = socket.create_connection(t.endpoints[node], timeout=peerwire.IO_TIMEOUT)
        peerwire.low_priority(sock)
        conn = Conn(sock)
        try:
            peerwire.client_auth(conn, t.secret, t.node)
        except BaseException:
            conn.close()
            raise
        return conn

    # ---- sending ------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        priority.bulk_thread()
        while not self._closed:
            self._wake.wait(POLL)
            self._wake.clear()
            self._sending = True
            try:
                self.warm.drop_gone()     # a trainer's unlinked slot: let its memory go
                self._replicate()
            except Exception as exc:  # noqa: BLE001 - replication is best effort; training never depends on it
                self._error(f"replicating failed: {type(exc).__name__}: {exc}")
            finally:
                self._sending = False

    def _replicate(self) -> None:
        with self.lock:
            force, self._force = self._force, False
            retry_at = dict(self._retry_at)
        t = self.table
        if t is None:
            return
        targets = [n for n in t.targets(t.node) if n in t.endpoints]
        ranks = sorted({seg.rank for seg in shm.list_segments(self.job_id) if not seg.replica})
        if not targets or not ranks:
            return
        seen = self._look(ranks, sending=False)
        now = time.monotonic()
        due = [n for n in targets if now >= retry_at.get(n, 0.0)]
        if seen != self._seen:     # a slot changed: read the snapshots' metadata again (only then)
            self._seen, self._per_rank = seen, slots.complete_snapshots(self.job_id, ranks, self.log)
        elif not force and not self._held_back and not any(n in retry_at for n in due):
            return      # no slot changed since the last look, no failed send to retry: nothing to do
        per_rank = self._per_rank
        step = slots.newest_common(per_rank)
        if step is None:
            return
        # held back while it would take the trainer's last free slot; looked at again every poll, since a
        # released persist changes no header
        self._held_back = any(slots.trainers_last_free(self.job_id, r, per_rank[r][step][0]) for r in ranks)
        if self._held_back:
            return
        if self.cadence.quiet and not force:
            return      # a quiet period: the cadence measures the steps without replication
        # every replica_interval-th snapshot at most, and less often when sends measurably slow training
        every = max(self.cfg.replica_interval, self.cadence.every) * self.cfg.save_mem_interval
        for node in due:
            with self.lock:
                last = self.sent.get(node, {}).get("step")
            if last is not None and (step <= last or (step - last < every and not force)):
                continue
            t0, nbytes = time.perf_counter(), 0
            try:
                for rank in ranks:
                    slot, generation = per_rank[rank][step]
                    conn = self._connect(t, node)
                    try:
                        nbytes += send_slot(conn, self.job_id, rank, slot, generation, self._pacer(ranks), self.warm)
                    finally:
                        conn.close()
            except (OSError, PeerError, SlotNotComplete, BadSlotMeta) as exc:
                self._not_sent(node, step, exc)
                continue
            seconds = round(time.perf_counter() - t0, 6)
            with self.lock:
                self._retry_at.pop(node, None)
                self._failing.pop(node, None)
                self.sent[node] = {"step": step, "bytes": nbytes, "seconds": seconds, "ranks": ranks}
            self.log.emit("replica_sent", step=step, node=node, ranks=ranks, bytes=nbytes, seconds=seconds)
            self.cadence.sent(time.monotonic(), seconds)

    def _not_sent(self, node: int, step: int, exc: Exception) -> None:
        with self.lock:
            self._retry_at[node] = time.monotonic() + RETRY
        if isinstance(exc, PeerNotReady):    # every job's start: not worth a console line
            self.log.record("replica_wait", step=step, node=node, message=str(exc))
            return
        with self.lock:     # since the first failure after the last success: how long it starves (status)
            self._failing[node] = (self._failing.get(node, (time.monotonic(), ""))[0], str(exc)[:200])
        self._error(f"replica of step {step} to node {node} not sent: {exc}")

    def _look(self, ranks: List[int], sending: bool) -> Tuple[Tuple[int, int, Tuple[int, int, int]], ...]:
        """(rank, slot, (state, generation, step)) of every local slot; the lowest rank's newest complete
        snapshot goes to the cadence (its gaps are the step time it measures; its number, the same on every
        node, lines the quiet periods up across nodes)."""
        seen = tuple((r, i, shm.peek(shm.slot_path(self.job_id, r, i))) for r in ranks for i in (0, 1))
        done = [(gen, step) for r, _, (state, gen, step) in seen if r == ranks[0] and state == shm.COMPLETE]
        receiving = self.server is not None and self.server.receiving > 0
        gen, step = max(done) if done else (None, 0)
        self.cadence.look(time.monotonic(), gen, sending, receiving, index=step // self.cfg.save_mem_interval)
        if self.cadence.every != self._every_said:
            self._every_said = every = self.cadence.every
            cost = self.cadence.cost
            self.log.record("replica_cadence", every=every, cost=None if cost is None else round(cost, 4),
                            message=f"replicating every {every} snapshot(s): one send costs "
                                    f"{'?' if cost is None else f'{cost:.2f}'} snapshot gaps of training time")
        return seen

    def _pacer(self, ranks: List[int]) -> peerwire.Pacer:
        return peerwire.Pacer(self.cfg.replica_bandwidth,
                              lambda: any(st == shm.WRITING for _, _, (st, _, _) in self._look(ranks, sending=True)))

    @property
    def errors(self) -> List[str]:
        """The newest warnings said (easyckpt status shows them)."""
        return self.warnings.recent()

    def _error(self, message: str) -> None:
        self.warnings.say(message)      # once a minute at most: a peer that stays away must not flood the log

