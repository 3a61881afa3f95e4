"""The agent's socket: accept, check who talks, read lines, turn them into typed messages, hand them on.

Order of events for a connection:
  accept → the peer's uid (SO_PEERCRED) must be the agent's own, else it is closed unheard
  each line → protocol.parse (a typed message, or an ``error`` reply naming the bad field)
            → the connection's first message must carry the job's key, else an error and the close
            → persist/flush/bye only after hello, and only for the rank that said hello
            → ``Handler.on_message``
  EOF or an error → ``Handler.on_disconnect`` (a trainer that never said bye has died)

It owns the connections and what it knows of each (``Client``); what a message means is the
handler's business (agent.py).

Refusals are counted, not written one line each (docs/reliability.md promise 13): another local user
looping connections must not fill the save dir through the audit log. The first REFUSED_FREE of each
REFUSED_EVERY seconds are logged whole, the rest as one summary line per interval with their count. A
reply to a client that reads nothing waits REPLY_WAIT at most, then that client is dropped: the loop
serves every other client.
"""
from __future__ import annotations

import hmac
import os
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol

from easyckpt.formats import protocol
from easyckpt.formats.replies import ErrorReply, Reply, encode_reply
from easyckpt.ipc import agentsocket
from easyckpt.storage.auditlog import AuditLog

REFUSED_FREE = 10       # refusals logged whole per interval
REFUSED_EVERY = 60.0    # seconds; the rest of an interval's refusals are one summary line
REPLY_WAIT = 1.0        # seconds a reply may take to leave; a client that reads nothing is dropped


class Refusals:
    """The audit log's view of refused connections and messages: bounded in lines per interval."""

    def __init__(self, log: AuditLog, clock: Any = time.monotonic) -> None:
        self.log, self.clock = log, clock
        self.since, self.logged, self.held, self.total, self.last = clock(), 0, 0, 0, ""

    def __call__(self, **fields: Any) -> None:
        self.flush()
        self.total += 1
        if self.logged < REFUSED_FREE:
            self.logged += 1
            self.log.emit("refused", **fields)
        else:
            self.held, self.last = self.held + 1, str(fields.get("message", ""))[:200]

    def flush(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.since < REFUSED_EVERY:
            return
        if self.held:
            self.log.emit("refused", count=self.held, seconds=round(now - self.since, 1),
                          message=f"{self.held} more connections or messages refused in the last "
                                  f"{now - self.since:.0f} s (the last: {self.last})")
        self.since, self.logged, self.held = now, 0, 0


@dataclass
class Client:
    reader: agentsocket.LineReader = field(default_factory=agentsocket.LineReader)
    rank: Optional[int] = None
    said_bye: bool = False
    pid: int = 0
    authed: bool = False          # its first message carried the job's key


class Handler(Protocol):
    def on_message(self, conn: Any, client: Client, msg: protocol.Message) -> None: ...

    def on_disconnect(self, conn: Any, client: Client) -> None: ...


class Transport(Protocol):
    """What the agent's loop asks of whatever brings it messages: Server on the job's socket, or an
    in-process one (easyckpt/_testing/). A connection is any hashable token the transport hands out."""

    handler: Optional[Handler]
    clients: Dict[Any, Client]

    def watch(self, fd: int) -> None: ...

    def poll(self, timeout: float) -> None: ...

    def trainers(self) -> List[Client]: ...

    def send(self, conn: Any, reply: Reply) -> None: ...

    def disconnect(self, conn: Any) -> None: ...

    def close(self) -> None: ...


# the ops a connection may send only after its hello, and only for the rank it said hello as
_AFTER_HELLO = (protocol.Persist, protocol.Flush, protocol.Bye, protocol.ReplicaList, protocol.ReplicaFetch,
                protocol.Listen, protocol.Peers)


def admit(client: Client, msg: protocol.Message, key: Optional[str], job_key: bytes) -> None:
    """Who may say ``msg`` (BadMessage when not): the connection's first message carries the job's key;
    per-rank ops come after hello, for that rank only. Every transport applies it."""
    if not client.authed:
        if not hmac.compare_digest((key or "").encode(), job_key):
            raise protocol.BadMessage("the first message must carry the job's key")
        client.authed = True
    if isinstance(msg, _AFTER_HELLO):
        if client.rank is None:
            raise protocol.BadMessage(f"{msg.op} before hello")
        if getattr(msg, "rank", client.rank) != client.rank:
            raise protocol.BadMessage(f"{msg.op} for rank {getattr(msg, 'rank', None)} on a connection that "
                                      f"said hello as rank {client.rank}")


class Server:
    def __init__(self, job_id: str, key: str, log: AuditLog):
        self.key, self.log = key.encode(), log
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(agentsocket.address(job_id))   # raises if an agent of this job is alive
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.clients: Dict[socket.socket, Client] = {}
        self.handler: Optional[Handler] = None
        self.refusals = Refusals(log)

    def watch(self, fd: int) -> None:
        """Wake ``poll`` when ``fd`` is readable (the persist worker's results)."""
        self.sel.register(fd, selectors.EVENT_READ)

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` for connections, lines or a watched fd; serve what came."""
        for key, _ in self.sel.select(timeout=timeout):
            if key.fileobj is self.listener:
                self._accept()
            elif key.fileobj in self.clients:
                self._read(key.fileobj)
        self.refusals.flush()

    def trainers(self) -> List[Client]:
        return [c for c in self.clients.values() if c.rank is not None]

    def send(self, conn: socket.socket, reply: Reply) -> None:
        try:
            conn.settimeout(REPLY_WAIT)
            conn.sendall(encode_reply(reply))
            conn.setblocking(False)
        except socket.timeout:        # it reads nothing: the loop must not wait on it
            if conn in self.clients:
                self.disconnect(conn)
        except OSError:
            pass   # the trainer is gone; its disconnect is handled by the loop

    def disconnect(self, conn: socket.socket) -> None:
        client = self.clients.pop(conn)
        self.sel.unregister(conn)
        conn.close()
        assert self.handler is not None
        self.handler.on_disconnect(conn, client)

    def close(self) -> None:
        """Stop listening (first, at exit: no trainer attaches to an agent that is leaving)."""
        self.sel.unregister(self.listener)
        self.listener.close()
        self.refusals.flush(force=True)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        uid = agentsocket.peer_uid(conn)
        if uid != os.geteuid():     # docs/reliability.md promise 9: another user's process never gets a word in
            self.refusals(message=f"connection from uid {uid} (not this job's user) closed")
            conn.close()
            return
        conn.setblocking(False)
        self.sel.register(conn, selectors.EVENT_READ)
        self.clients[conn] = Client()

    def _read(self, conn: socket.socket) -> None:
        client = self.clients[conn]
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.disconnect(conn)
            return
        assert self.handler is not None
        try:
            for line in client.reader.feed(data):
                try:
                    msg = self._check(client, line)
                except protocol.BadMessage as exc:
                    self._refuse(conn, client, str(exc))
                    if not client.authed:
                        self.disconnect(conn)
                        return
                    continue
                self.handler.on_message(conn, client, msg)
                if conn not in self.clients:
                    return
        except protocol.BadMessage as exc:     # a line too long: nothing sane comes after it
            self._refuse(conn, client, str(exc))
            self.disconnect(conn)

    def _check(self, client: Client, line: bytes) -> protocol.Message:
        msg, key = protocol.parse(line)
        admit(client, msg, key, self.key)
        return msg

    def _refuse(self, conn: socket.socket, client: Client, why: str) -> None:
        self.refusals(rank=client.rank, message=f"bad message: {why}")
        self.send(conn, ErrorReply(why))
