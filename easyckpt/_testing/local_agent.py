"""One node's agent in this process: the real Agent (its handlers, coordinator, job directory, commit and
retention) over an in-process transport, with a Persister that has no thread of its own. Engines attach
to it through LocalLink (an engine/seams.py AgentLink), so the engine's behaviours (save, persist, commit,
load, the verdicts, the audit log) run in one interpreter without spawning the agent.

Every call is serialised by one lock, as the agent's single loop serialises its messages; after each
message the loop turns and the queued disk work runs, on the caller's thread, until nothing is left.
What this does not have: the socket (who may connect is server.py's, tested on its own), the agent as a
separate process (kill -9, SIGTERM: the real-process tests keep those)."""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Type, TypeVar

from easyckpt.agent.agent import Agent
from easyckpt.agent.persister import Persister
from easyckpt.agent.server import Client, Handler, admit
from easyckpt.config import Config
from easyckpt.errors import AgentError, BadMessage
from easyckpt.formats import protocol
from easyckpt.formats.replies import ErrorReply, HelloReply, Reply, StatusReply, expect
from easyckpt.ipc import jobkey
from easyckpt.storage.savedir import SaveDir

R = TypeVar("R")


class LocalServer:
    """server.Transport without a socket: connections are tokens, replies wait in a queue per token."""

    def __init__(self, job_key: str):
        self.key = job_key.encode()
        self.handler: Optional[Handler] = None
        self.clients: Dict[Any, Client] = {}
        self.replies: Dict[Any, Deque[Reply]] = {}

    def connect(self) -> object:
        conn = object()
        self.clients[conn] = Client()
        self.replies[conn] = collections.deque()
        return conn

    def deliver(self, conn: object, msg: protocol.Message, key: Optional[str] = None) -> None:
        client = self.clients[conn]
        try:
            admit(client, msg, key, self.key)
        except BadMessage as exc:
            self.send(conn, ErrorReply(str(exc)))
            return
        assert self.handler is not None
        self.handler.on_message(conn, client, msg)

    def watch(self, fd: int) -> None:
        pass

    def poll(self, timeout: float) -> None:
        pass

    def trainers(self) -> List[Client]:
        return [c for c in self.clients.values() if c.rank is not None]

    def send(self, conn: Any, reply: Reply) -> None:
        if conn in self.replies:
            self.replies[conn].append(reply)

    def disconnect(self, conn: Any) -> None:
        client = self.clients.pop(conn, None)
        self.replies.pop(conn, None)
        if client is not None and self.handler is not None:
            self.handler.on_disconnect(conn, client)

    def close(self) -> None:
        pass


class LocalAgent:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        SaveDir.of(cfg).storage.makedirs(cfg.save_dir)     # as the first trainer does before it starts an agent
        self.key = jobkey.ensure(cfg.job_id)
        self.server = LocalServer(self.key)
        self.agent = Agent(cfg, server=self.server, persister=lambda run: Persister(run, threaded=False))
        self._worker: Persister = self.agent.persister  # type: ignore[assignment]
        self.lock = threading.RLock()
        self.left = False
        self.agent.start()

    def settle(self) -> None:
        """Turn the loop and run the queued disk work until neither has anything left."""
        with self.lock:
            while not self.left:
                ran = self._worker.drain()
                if self.agent.turn():
                    self.agent.shutdown()
                    self.left = True
                    return
                if not ran and not self._worker.queued_persists():
                    return

    def deliver(self, conn: object, msg: protocol.Message, key: Optional[str] = None) -> None:
        with self.lock:
            if self.left:
                raise AgentError(f"the in-process agent of job {self.cfg.job_id} has left")
            self.server.deliver(conn, msg, key)
            self.agent._execute()
        self.settle()

    def take(self, conn: object) -> Optional[Reply]:
        with self.lock:
            queue = self.server.replies.get(conn)
            return queue.popleft() if queue else None

    def link(self, rank: int, world_size: int, local_rank: Optional[int] = None) -> "LocalLink":
        return LocalLink(self, rank, world_size, rank if local_rank is None else local_rank)

    def tick(self, seconds: float = 0.0) -> None:
        """Let the loop run for ``seconds`` (commit timeouts, the grace clock), turning it every 10 ms."""
        deadline = time.monotonic() + seconds
        while True:
            self.settle()
            if time.monotonic() >= deadline or self.left:
                return
            time.sleep(0.01)

    def close(self) -> None:
        """Leave as the agent leaves (its slots and key go when every trainer said bye)."""
        with self.lock:
            if not self.left:
                self.left = True
                self.agent.shutdown()


class LocalLink:
    """engine/seams.AgentLink to a LocalAgent: this rank's connection, said hello on at once."""

    def __init__(self, local: LocalAgent, rank: int, world_size: int, local_rank: int):
        self.local, self.rank = local, rank
        with local.lock:
            self.conn: Optional[object] = local.server.connect()
        local.deliver(self.conn, protocol.Hello(rank, world_size, local_rank, os.getpid()), key=local.key)
        hello = local.take(self.conn)
        if not isinstance(hello, HelloReply) or not hello.ok:
            raise AgentError(f"rank {rank}: the in-process agent refused the hello: {getattr(hello, 'error', hello)}")
        self.agent_pid: Optional[int] = hello.agent_pid

    def send(self, msg: protocol.Message) -> None:
        if self.conn is None:
            raise AgentError(f"rank {self.rank}: the connection to the in-process agent is closed")
        self.local.deliver(self.conn, msg)

    def request(self, msg: protocol.Message, kind: Type[R], timeout: float) -> R:
        self.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            assert self.conn is not None
            reply = self.local.take(self.conn)
            if reply is not None:
                try:
                    return expect(reply, kind)
                except BadMessage as exc:
                    raise AgentError(f"rank {self.rank}: the agent refused {msg.op}: {exc}") from None
            if time.monotonic() > deadline or self.local.left:
                raise AgentError(f"rank {self.rank}: the agent did not answer {msg.op} within {timeout}s")
            self.local.tick(0.01)

    def side(self, msg: protocol.Message, timeout: float = 2.0) -> Optional[Reply]:
        if self.local.left:
            return None
        with self.local.lock:
            conn = self.local.server.connect()
        try:
            self.local.deliver(conn, msg, key=self.local.key)
            return self.local.take(conn)
        except AgentError:
            return None
        finally:
            with self.local.lock:
                if conn in self.local.server.clients:
                    self.local.server.disconnect(conn)

    def status(self, timeout: float) -> Optional[StatusReply]:
        reply = self.side(protocol.Status(), timeout)
        return reply if isinstance(reply, StatusReply) else None

    def alive(self) -> bool:
        return not self.local.left

    def reattach(self, why: str) -> None:
        raise AgentError(f"rank {self.rank}: the in-process agent is gone ({why}); nothing restarts it here")

    def close(self) -> None:
        """The connection ends (after bye, a trainer that finished; without, a trainer that died)."""
        if self.conn is not None:
            with self.local.lock:
                if self.conn in self.local.server.clients:
                    self.local.server.disconnect(self.conn)
                self.local.agent._execute()
            self.conn = None
            self.local.settle()
