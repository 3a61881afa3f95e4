"""Agent ↔ agent wire (peer replicas, agent/replicas.py): TCP between nodes, JSON lines and raw slot bytes.

Who may talk. Anyone who can reach the port may connect, so both ends prove they know the job's replica
secret before anything else (mutual challenge-response, HMAC-SHA256 over both nonces): the server sends
its nonce, the client answers with its own nonce and a MAC, the server answers with a MAC of its own.
The secret is made by global rank 0 for each start of the job and reaches every rank over the job's own
process group (a collective among its ranks), or is derived from a file the operator gives every node
(EASYCKPT_REPLICA_SECRET_FILE); each rank hands it to its node's agent on the agent's authenticated local
socket (engine/link/peers.py). It never sits in the c10d store, which answers anyone who reaches its port.
The handshake as a whole must end within HANDSHAKE_TIMEOUT: a connection that trickles bytes never holds
a slot of the server for longer (agent/peerserve.py keeps its own capacity for authenticated peers).

After that, one request per connection, a JSON line; every field is checked here (``request``):

  put   {op, rank, world_size, step, data_len, meta_len}  → {ok, want}; if want: the bytes, then → {ok, error}
  list  {op, rank}                                         → {ok, steps: [[step, world_size], ...]}
  get   {op, rank, step}                                   → {ok, world_size, step, data_len, meta_len} + the bytes

"The bytes" are a slot's data region, then its metadata, then a trailer: the checksum of both (the
manifest's algorithm, xxh3-64) and one byte that says whether the sender's slot was still the same snapshot
after the last byte (the seqlock, slotread.ensure_unchanged). The receiver publishes only an intact,
unchanged copy; its metadata then passes slotread's checks like any slot's before anyone reads a tensor from it.

Bytes go straight between a slot's mapping and the socket (sendall / recv_into), with the checksum computed
on the same pieces. The mappings are populated when made and kept between transfers (peerserve.Warm): a
fresh mapping of a multi-GB slot faults one 4 KiB page at a time, which made a transfer three times slower
than the copy itself.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
from typing import Any, Callable, Dict, List, Optional, TypeGuard

from easyckpt.errors import BadMessage, PeerError, PeerNotReady
from easyckpt.formats.manifest import Hasher

MAX_LINE = 1 << 16
MAX_DATA = 1 << 46            # 64 TiB: far above any rank's state, far below an overflow
MAX_META = 1 << 28
MAX_WORLD = 1 << 20
CHUNK = 4 << 20               # bytes per send between pauses and rate checks
TRAILER = struct.Struct("<QB")   # checksum (the Hasher's digest as a number), intact
IO_TIMEOUT = 30.0             # no read or write on a peer connection waits longer than this
HANDSHAKE_TIMEOUT = 5.0       # from accept to authenticated, in all, however slowly the bytes come
QUOTE = 16                    # bytes of a sender's line a refusal quotes, escaped


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(secret.encode(), "\0".join(parts).encode(), hashlib.sha256).hexdigest()


class Conn:
    """One peer connection: lines in and out, exact byte counts, every read under IO_TIMEOUT."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.settimeout(IO_TIMEOUT)
        self.buf = b""
        self.deadline: Optional[float] = None    # time.monotonic(): no read goes past it (the handshake's)

    def _arm(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"the handshake took longer than {HANDSHAKE_TIMEOUT:g} s", "slow handshake")
            self.sock.settimeout(min(IO_TIMEOUT, left))

    def send_line(self, obj: Dict[str, Any]) -> None:
        self.sock.sendall((json.dumps(obj) + "\n").encode())

    def read_line(self) -> Dict[str, Any]:
        while b"\n" not in self.buf:
            self._arm()
            data = self.sock.recv(65536)
            if not data:
                raise PeerError("the peer closed the connection", "closed early")
            self.buf += data
            if len(self.buf) > MAX_LINE and b"\n" not in self.buf:
                raise PeerError(f"a line longer than {MAX_LINE} bytes", "line too long")
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise PeerError(f"not JSON: {quote(line)}", "not JSON") from None
        if not isinstance(obj, dict):
            raise PeerError("a line is a JSON object", "not a JSON object")
        return obj

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly (what is buffered first)."""
        pos = 0
        if self.buf:
            pos = min(len(self.buf), len(view))
            view[:pos] = self.buf[:pos]
            self.buf = self.buf[pos:]
        while pos < len(view):
            got = self.sock.recv_into(view[pos:])
            if not got:
                raise PeerError(f"the peer closed the connection after {pos} of {len(view)} bytes")
            pos += got

    def close(self) -> None:
        self.sock.close()


def serve_auth(conn: Conn, secret: Optional[str]) -> int:
    """Server side of the handshake; the client's node. PeerError (after telling the client) on failure."""
    nonce = secrets.token_hex(16)
    conn.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    try:
        conn.send_line({"nonce": nonce, "ready": secret is not None})
        hello = conn.read_line()
    except socket.timeout:
        raise PeerError(f"the handshake took longer than {HANDSHAKE_TIMEOUT:g} s", "slow handshake") from None
    finally:
        conn.deadline = None
        conn.sock.settimeout(IO_TIMEOUT)
    if secret is None:
        raise PeerNotReady("this agent does not know the job's replica secret yet")
    node, theirs, mac = hello.get("node"), hello.get("nonce"), hello.get("mac")
    if not (_is_int(node, MAX_WORLD) and isinstance(theirs, str) and len(theirs) == 32 and isinstance(mac, str)):
        raise PeerError("malformed handshake", "malformed handshake")
    if not hmac.compare_digest(mac, _mac(secret, "client", nonce, theirs, str(node))):
        conn.send_line({"ok": False, "error": "wrong replica secret"})
        raise PeerError(f"a connection claiming to be node {node} does not know the job's replica secret",
                        "wrong secret")
    conn.send_line({"ok": True, "mac": _mac(secret, "server", theirs, nonce)})
    return int(node)


def client_auth(conn: Conn, secret: str, node: int) -> None:
    first = conn.read_line()
    nonce = first.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 32:
        raise PeerError("malformed handshake")
    if first.get("ready") is not True:
        raise PeerNotReady("the peer's agent does not know the job's replica secret yet (its trainers have not "
                           "started); retried later")
    mine = secrets.token_hex(16)
    conn.send_line({"node": node, "nonce": mine, "mac": _mac(secret, "client", nonce, mine, str(node))})
    reply = conn.read_line()
    mac = reply.get("mac")
    if reply.get("ok") is not True or not isinstance(mac, str) or \
            not hmac.compare_digest(mac, _mac(secret, "server", mine, nonce)):
        raise PeerError(f"the peer did not prove it knows the job's replica secret: {reply.get('error')!r}")


def quote(data: bytes, limit: int = QUOTE) -> str:
    """A sender's bytes as a message may show them: the first ``limit`` escaped, never more (a refusal line
    must not carry what a stranger sends)."""
    return repr(data[:limit]) + ("…" if len(data) > limit else "")


def _is_int(value: Any, limit: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


_FIELDS = {"put": {"rank": MAX_WORLD, "world_size": MAX_WORLD + 1, "step": 1 << 62, "data_len": MAX_DATA,
                   "meta_len": MAX_META},
           "list": {"rank": MAX_WORLD},
           "get": {"rank": MAX_WORLD, "step": 1 << 62}}


def request(obj: Dict[str, Any]) -> Dict[str, Any]:
    """A checked request (BadMessage names the first bad field)."""
    op = obj.get("op")
    if op not in _FIELDS:
        raise BadMessage(f"unknown op {str(op)[:40]!r}")
    for name, limit in _FIELDS[op].items():
        if not _is_int(obj.get(name), limit):
            raise BadMessage(f"{op}: field {name!r} must be an integer in [0, {limit}), got {str(obj.get(name))[:40]!r}")
    if op == "put" and not (obj["rank"] < obj["world_size"] and obj["meta_len"] > 0):
        raise BadMessage(f"put: rank {obj['rank']} of world_size {obj['world_size']}, meta_len {obj['meta_len']}")
    return {k: obj[k] for k in ("op", *_FIELDS[op])}


class Pacer:
    """Holds a sender to ``rate`` bytes/s (0: no cap) and pauses it while ``busy()`` says training needs
    the machine (a snapshot being copied), for ``max_pause`` seconds per chunk at most: replication waits
    for training, never the other way round, and never forever."""

    def __init__(self, rate: float, busy: Callable[[], bool] = lambda: False, max_pause: float = 5.0):
        self.rate, self.busy, self.max_pause = rate, busy, max_pause
        self.t0 = time.monotonic()
        self.sent = 0
        self.paused = 0.0

    def before(self, nbytes: int) -> None:
        start = time.monotonic()
        while self.busy() and time.monotonic() - start < self.max_pause:
            time.sleep(0.005)
        self.paused += time.monotonic() - start
        self.sent += nbytes
        if self.rate > 0:
            ahead = self.sent / self.rate - (time.monotonic() - self.t0 - self.paused)
            if ahead > 0:
                time.sleep(ahead)


def digest(h: Hasher) -> int:
    return int(h.hexdigest(), 16)


def send_bytes(conn: Conn, regions: List[memoryview], pacer: Pacer, intact: Callable[[], bool]) -> None:
    """The regions, then the trailer (their checksum, and whether ``intact()`` after the last byte)."""
    h = Hasher()
    for region in regions:
        for pos in range(0, len(region), CHUNK):
            piece = region[pos:pos + CHUNK]
            pacer.before(len(piece))
            h.update(piece)
            conn.sock.sendall(piece)
    conn.sock.sendall(TRAILER.pack(digest(h), 1 if intact() else 0))


def receive_bytes(conn: Conn, regions: List[memoryview]) -> None:
    """Fill the regions and check the trailer; PeerError if the bytes are damaged or the sender's slot
    changed while it sent them."""
    h = Hasher()
    for region in regions:
        for pos in range(0, len(region), CHUNK):
            piece = region[pos:pos + CHUNK]
            conn.read_into(piece)
            h.update(piece)
    trailer = bytearray(TRAILER.size)
    conn.read_into(memoryview(trailer))
    theirs, intact = TRAILER.unpack(trailer)
    if theirs != digest(h):
        raise PeerError(f"checksum mismatch: received {digest(h):016x}, the sender computed {theirs:016x}")
    if intact != 1:
        raise PeerError("the sender's snapshot was overwritten while it was sent")


def low_priority(sock: socket.socket) -> None:
    """Training's own traffic first: the lowest socket priority and the 'lower effort' DSCP class (CS1)."""
    for level, opt, value in ((socket.SOL_SOCKET, getattr(socket, "SO_PRIORITY", None), 0),
                              (socket.IPPROTO_IP, socket.IP_TOS, 0x20)):
        if opt is not None:
            try:
                sock.setsockopt(level, opt, value)
            except OSError:
                pass
