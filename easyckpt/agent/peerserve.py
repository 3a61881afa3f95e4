"""The agent's side of the peer wire (ipc/peerwire.py): serving other nodes' agents, and moving one
slot's bytes in either direction.

Serving (``PeerServer``, a listener thread and one short-lived thread per connection): after the
handshake, a ``put`` stores a replica of another node's rank in this node's replica slots
(shm.replica_path), a ``list`` says which steps of a rank it holds, a ``get`` streams one back.

A replica slot is double-buffered like a trainer's: a put is written into the one of the rank's two
replica slots that does not hold its newest complete replica, under the same seqlock (state WRITING and a
new generation first, the header last), so a put that breaks off never costs the last complete copy.
Room is reserved (shm.Slot.create_or_grow) before the first byte: a node without room says so, naming the size
and the setting that lowers it, and keeps what it holds.
"""
from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Tuple

from easyckpt.agent import slots
from easyckpt.agent.peerrefusals import PeerRefusals
from easyckpt.agent.warmslots import Warm
from easyckpt.errors import (
    BadMessage,
    BadSlotMeta,
    PeerError,
    PeerNotReady,
    ShmCapacityError,
    SlotNotComplete,
)
from easyckpt.ipc import peerwire, priority, shm, slotread
from easyckpt.ipc.peerwire import Conn
from easyckpt.storage.auditlog import AuditLog
from easyckpt.units import human

# Capacity (docs/reliability.md promise 14): connections still in their handshake (peerwire.HANDSHAKE_TIMEOUT
# at most) are capped per pool, strangers' also per address, and the addresses of the job's table have a pool
# of their own, so that strangers elsewhere never touch it. An address proves nothing, though: any local user
# of a job's node connects from that node's address. So a full pool never turns the newcomer away: the OLDEST
# handshake of the address (or pool) is cut off to make room. A job's node answers the server's nonce at once
# and is done in a millisecond or two; only a connection slow to prove itself grows old, so slow strangers,
# however many, cannot keep a node of the job out (before: 8 slow handshakes from node 0's address refused
# every connection of node 0's agent). To cut off a node's handshake, a stranger must instead open the whole
# pool's worth of connections within that handshake's milliseconds, more than this accept loop takes in.
# Authenticated connections have their own cap, against a runaway only.
MAX_CONNECTIONS = 64      # authenticated peers' connections served at once (one rank at a time per holder)
MAX_HANDSHAKING = 32      # unauthenticated, from addresses outside the job's table
MAX_HANDSHAKING_PEERS = 32  # unauthenticated, from the job's own nodes' addresses (any number from one)
MAX_PER_ADDRESS = 8       # unauthenticated, from any one address outside the job's table
FLUSH_EVERY = 5.0         # seconds: the accept loop wakes this often to say a finished period's refusal counts


@dataclass(eq=False)
class _Handshake:
    """A connection that has not proven yet that it belongs to the job."""

    sock: socket.socket
    addr: str
    pool: str
    evicted: bool = False     # cut off to make room: counted once, when it was cut


class PeerServer:
    def __init__(self, job_id: str, addr: str, log: AuditLog, error: Callable[[str], None]):
        self.job_id, self.addr, self.log, self.error = job_id, addr, log, error
        self.secret: Optional[str] = None
        self.table: Any = None                   # replicas.Table once the trainers introduced the nodes
        self.peer_addrs: FrozenSet[str] = frozenset()  # its endpoints' addresses: the reserved handshake pool
        self._handshakes: List[_Handshake] = []     # in accept order: the first of a pool is its oldest
        self.refusals = PeerRefusals(error)          # strangers' refusals: by kind, bounded lines a minute
        self.sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, 0))
        self.sock.listen(16)
        self.sock.settimeout(FLUSH_EVERY)
        self.port: int = self.sock.getsockname()[1]
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self.receiving = 0           # puts under way: the sender's cadence counts those gaps as not clean
        self.warm = Warm()           # the replica slots this node holds
        threading.Thread(target=self._accept_loop, daemon=True, name="easyckpt-peers").start()

    def close(self) -> None:
        self._closed = True
        self.warm.close()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self.sock.accept()
            except socket.timeout:
                self.refusals.flush()
                continue
            except OSError:
                return
            addr = str(peer[0])
            entry = _Handshake(sock, addr, "peer" if addr in self.peer_addrs else "other")
            with self._lock:
                victim = self._make_room(entry)
                self._handshakes.append(entry)
            if victim is not None:
                # never closed here (its thread may be in recv on it, and a closed fd number is reused):
                # shut down, which ends that recv at once; its thread closes it
                try:
                    victim.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self.refusals("cut off in handshake", f"replica connection from {victim.addr} cut off: too many "
                              f"connections still in their handshake (the oldest makes room for the newest)")
            threading.Thread(target=self._serve, args=(entry,), daemon=True, name="easyckpt-peer").start()

    def _make_room(self, entry: _Handshake) -> Optional[_Handshake]:
        """Under ``_lock``: the oldest handshake that must go for ``entry`` to fit (its address's, else its
        pool's), marked and no longer counted; None when it fits."""
        same = [h for h in self._handshakes if h.addr == entry.addr]
        if entry.pool == "peer" or len(same) < MAX_PER_ADDRESS:
            same = [h for h in self._handshakes if h.pool == entry.pool]
            if len(same) < (MAX_HANDSHAKING_PEERS if entry.pool == "peer" else MAX_HANDSHAKING):
                return None
        victim = same[0]
        victim.evicted = True
        self._handshakes.remove(victim)
        return victim

    def _handshake_over(self, entry: _Handshake) -> None:
        with self._lock:
            if not entry.evicted:
                self._handshakes.remove(entry)

    def _serve(self, entry: _Handshake) -> None:
        priority.bulk_thread()
        peerwire.low_priority(entry.sock)
        conn = Conn(entry.sock)
        node = None
        authed = False
        try:
            try:
                node = peerwire.serve_auth(conn, self.secret)
            finally:
                self._handshake_over(entry)
            if not self._slots.acquire(blocking=False):
                raise PeerError(f"{MAX_CONNECTIONS} authenticated replica connections are open already")
            authed = True
            req = peerwire.request(conn.read_line())
            if req["op"] == "put":
                self._put(conn, node, req)
            elif req["op"] == "list":
                conn.send_line({"ok": True, "steps": [[d.step, d.header.world_size]
                                                      for d in self._held(req["rank"]) if d is not None]})
            else:
                self._get(conn, req)
        except (PeerError, BadMessage, OSError, SlotNotComplete, BadSlotMeta, ShmCapacityError) as exc:
            if isinstance(exc, PeerNotReady) or entry.evicted:    # a job starting (the sender retries); counted
                pass
            elif node is None:      # anyone at all: counted by kind, never a line each (peerrefusals.py)
                kind = exc.kind if isinstance(exc, PeerError) else type(exc).__name__
                self.refusals(kind, f"replica connection from {entry.addr} refused: {exc}")
            else:                   # a node of the job, authenticated
                self.error(f"replica request from node {node} refused: {exc}")
            try:
                conn.send_line({"ok": False, "error": str(exc)[:2000]})
            except OSError:
                pass
        finally:
            conn.close()
            if authed:
                self._slots.release()

    def _paths(self, rank: int) -> List[str]:
        return [shm.replica_path(self.job_id, rank, i) for i in (0, 1)]

    def _held(self, rank: int) -> List[Optional[slotread.CompleteSlot]]:
        return [slotread.read_complete(p) for p in self._paths(rank)]

    def _put(self, conn: Conn, node: int, req: Dict[str, int]) -> None:
        rank, step = req["rank"], req["step"]
        t = self.table
        # a node puts only its own ranks' replicas, of the job's world size, on a node that holds its replicas
        if t is not None and (t.node_of(rank) != node or req["world_size"] != t.nnodes * t.ranks_per_node
                              or t.node not in t.targets(node)):
            raise PeerError(f"node {node} may not put rank {rank} (world_size {req['world_size']}) here: rank {rank} "
                            f"runs on node {t.node_of(rank)}, node {node}'s replicas go to nodes {t.targets(node)}")
        if any(d is not None and d.step == step and d.header.world_size == req["world_size"]
               for d in self._held(rank)):
            conn.send_line({"ok": True, "want": False})
            return
        with self._lock:
            self.receiving += 1
        try:
            index, nbytes = receive_slot(conn, self._paths(rank), rank, step, req, ask=True, warm=self.warm)
        except ShmCapacityError as exc:
            raise ShmCapacityError(f"cannot hold node {node}'s replica of rank {rank} ({human(req['data_len'])}): "
                                   f"{exc}; set replication_factor=1 to keep no replicas") from None
        finally:
            with self._lock:
                self.receiving -= 1
        conn.send_line({"ok": True})
        self.log.emit("replica_received", rank=rank, step=step, node=node, slot=index, bytes=nbytes)

    def _get(self, conn: Conn, req: Dict[str, int]) -> None:
        rank, step = req["rank"], req["step"]
        for path, done in zip(self._paths(rank), self._held(rank)):
            if done is not None and done.step == step:
                with self.warm.use(path, writable=False) as slot:
                    done = slotread.check(slot, expect_step=step)
                    _send(conn, slot, done, peerwire.Pacer(0), head=True)   # recovery: training is not running
                return
        raise PeerError(f"this node holds no replica of rank {rank} at step {step}")


def send_slot(conn: Conn, job_id: str, rank: int, index: int, generation: int, pacer: peerwire.Pacer,
              warm: Warm) -> int:
    """Put one of this node's slots to the peer at ``conn`` (pinned meanwhile); the bytes sent (0 when
    the peer already holds that step)."""
    with slots.reserved(job_id, rank, index, generation, release=False) as path, \
            warm.use(path, writable=False) as slot:
        done = slotread.check(slot, expect_generation=generation)
        return _send(conn, slot, done, pacer, head=False)


def _send(conn: Conn, slot: shm.Slot, done: slotread.CompleteSlot, pacer: peerwire.Pacer, head: bool) -> int:
    hdr = done.header
    assert slot.mm is not None
    fields = {"rank": hdr.rank, "world_size": hdr.world_size, "step": hdr.step, "data_len": hdr.data_capacity,
              "meta_len": hdr.meta_len}
    if head:     # the answer to a get
        conn.send_line({"ok": True, **fields})
    else:        # a put: does the peer want it?
        conn.send_line({"op": "put", **fields})
        reply = conn.read_line()
        if reply.get("ok") is not True:
            raise PeerError(str(reply.get("error"))[:2000])
        if reply.get("want") is not True:
            return 0
    with memoryview(slot.mm) as view:
        data = view[shm.HEADER_BYTES:shm.HEADER_BYTES + hdr.data_capacity]
        meta = view[hdr.meta_offset:hdr.meta_offset + hdr.meta_len]
        try:
            peerwire.send_bytes(conn, [data, meta], pacer, lambda: slot.state() == (shm.COMPLETE, done.generation))
        finally:
            data.release()
            meta.release()
    if not head:
        reply = conn.read_line()
        if reply.get("ok") is not True:
            raise PeerError(str(reply.get("error"))[:2000])
    return hdr.data_capacity + hdr.meta_len


def receive_slot(conn: Conn, paths: List[str], rank: int, step: int, head: Mapping[str, object],
                 ask: bool = False, warm: Optional[Warm] = None) -> Tuple[int, int]:
    """Receive a slot's bytes described by ``head`` into whichever of ``paths`` (a rank's two slots) does not
    hold its newest complete snapshot, and publish it there once checked; (that slot's index, bytes).
    ``ask``: this is a put, whose sender waits for a yes before the bytes. ``warm``: keep the slot mapped
    for the next one (a holder's replica slots; a pull into a trainer's slot is made once)."""
    fields = {k: head.get(k) for k in ("rank", "world_size", "step", "data_len", "meta_len")}
    req = peerwire.request({"op": "put", **fields})
    if req["rank"] != rank or req["step"] != step:
        raise PeerError(f"asked for rank {rank} step {step}, got rank {req['rank']} step {req['step']}")
    data_len, meta_len = req["data_len"], req["meta_len"]
    held = [slotread.read_complete(p) for p in paths]
    held_steps = [-1 if h is None else h.step for h in held]
    index = min((0, 1), key=lambda i: held_steps[i])
    generation = max(slots.generation_of(p) for p in paths) + 1
    shm.Slot.create_or_grow(paths[index], shm.slot_size(data_len, meta_len), touch=False).close()
    with _mapped(paths[index], warm) as slot:
        assert slot.mm is not None
        slot.begin_write(generation)
        if ask:
            conn.send_line({"ok": True, "want": True})
        meta = bytearray(meta_len)
        with memoryview(slot.mm) as view:
            data = view[shm.HEADER_BYTES:shm.HEADER_BYTES + data_len]
            try:
                peerwire.receive_bytes(conn, [data, memoryview(meta)])
            finally:
                data.release()
        hdr = shm.Header(state=shm.COMPLETE, step=step, generation=generation, meta_len=meta_len,
                         meta_capacity=slot.size - shm.HEADER_BYTES - data_len, data_capacity=data_len,
                         persist=False, meta_crc=0, pid=0, rank=rank, world_size=req["world_size"])
        slot.publish(hdr, bytes(meta))
        try:
            slotread.check(slot, expect_step=step, expect_generation=generation)
        except (SlotNotComplete, BadSlotMeta):
            slot.begin_write(generation + 1)      # a copy no reader may take: unpublished again
            raise
    return index, data_len + meta_len


@contextlib.contextmanager
def _mapped(path: str, warm: Optional[Warm]) -> Iterator[shm.Slot]:
    """A slot mapped writable for one receive: held from ``warm`` (kept mapped after), or mapped for it alone."""
    if warm is not None:
        with warm.use(path, writable=True) as slot:
            yield slot
        return
    slot = shm.Slot(path, writable=True, populate=True)
    try:
        yield slot
    finally:
        slot.close()
