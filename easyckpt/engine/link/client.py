"""Trainer side of the agent protocol (formats/protocol.py): attach to the node's agent, starting it on
demand, and send it typed messages (``protocol.Persist(...)``, ...).

The first local rank starts the agent when none answers; it runs in its own session so that neither
a kill of the trainer's process group (torchrun) nor the trainer's death takes it down. Sending never
blocks on storage: a persist request is one small message.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Optional, Type, TypeVar

from easyckpt.config import Config
from easyckpt.errors import AgentError, BadMessage, ConfigError
from easyckpt.formats import protocol
from easyckpt.formats.layout import agent_log_name
from easyckpt.formats.replies import ErrorReply, HelloReply, Reply, StatusReply, expect
from easyckpt.ipc import agentsocket, jobkey, shm
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.savedir import SaveDir

R = TypeVar("R")
SEND_WAIT = 1.0     # seconds the rest of a message may take once the agent took its first bytes

class AgentClient:
    def __init__(self, cfg: Config, rank: int, local_rank: int, world_size: int, log: AuditLog):
        self.cfg, self.rank, self.local_rank, self.world_size, self.log = cfg, rank, local_rank, world_size, log
        self.sock: Optional[socket.socket] = None
        self.reader = agentsocket.LineReader()
        self.agent_pid: Optional[int] = None
        self._spawned: Optional[subprocess.Popen] = None
        self._attached_once = False     # after the first attach, any local rank restarts a dead agent
        self._key: Optional[str] = None   # the job's key, read once: side connections carry it
        # A process forked from the trainer (data-loader workers, a multiprocessing manager) would keep
        # the connection open after the trainer died, and the agent would never learn of the death.
        os.register_at_fork(after_in_child=self._drop_in_child)
        self._connect()

    def _drop_in_child(self) -> None:
        if self.sock is not None:
            try:
                os.close(self.sock.detach())   # this process's copy only; the trainer keeps its own
            except OSError:
                pass
            self.sock = None

    def _connect(self) -> None:
        deadline = time.monotonic() + self.cfg.agent_start_timeout
        while True:
            # read at each try: the agent of the job's previous run, leaving, removes the key when no agent listens,
            # and one this job is starting may not listen yet; a new key is then made, which the next agent reads
            key = self._key = jobkey.ensure(self.cfg.job_id)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.cfg.agent_start_timeout)
            reply: Optional[Reply] = None
            try:
                sock.connect(agentsocket.address(self.cfg.job_id))
                uid = agentsocket.peer_uid(sock)
                if uid == os.geteuid():
                    hello = protocol.Hello(self.rank, self.world_size, self.local_rank, os.getpid())
                    sock.sendall(protocol.encode(hello, key=key))
                    self.reader = agentsocket.LineReader()
                    reply = agentsocket.recv_one(sock, self.reader)
            except (OSError, ValueError):   # no agent yet, one on its way out, or a garbled reply: try again
                uid = os.geteuid()
            if uid != os.geteuid():
                sock.close()
                raise AgentError(f"rank {self.rank}: the agent address of job {self.cfg.job_id} is held by a "
                                 f"process of uid {uid}, not of this job's user: easyckpt will not talk to it. "
                                 f"Stop that process (see `ss -xlp | grep easyckpt-agent-{self.cfg.job_id}`), or "
                                 f"give this job another save_dir or job_name")
            if isinstance(reply, HelloReply) and reply.ok and reply.agent_pid is not None:
                self.sock, self.agent_pid = sock, reply.agent_pid
                self._attached_once = True
                return
            sock.close()
            if isinstance(reply, (HelloReply, ErrorReply)) and reply.error and not self._key_changed(key):
                raise ConfigError(reply.error[:2000])
            if (self.local_rank == 0 or self._attached_once) and (self._spawned is None or
                                                                 self._spawned.poll() is not None):
                self._spawn()
            if time.monotonic() > deadline:
                log = self._agent_log()
                where = (f"see {log} for its errors" if os.path.exists(log) else
                         f"no agent was ever started ({log} does not exist): local rank 0 starts it, so see local "
                         f"rank 0's own error output; it failed or hangs before it could start one")
                raise AgentError(f"rank {self.rank}: no easyckpt agent answered for job {self.cfg.job_id} within "
                                 f"{self.cfg.agent_start_timeout}s; {where}")
            time.sleep(0.05)

    def _key_changed(self, sent: str) -> bool:
        """The job's key is no longer the one a refused hello carried (see _connect): try again with the new one."""
        try:
            return jobkey.read(self.cfg.job_id) != sent
        except FileNotFoundError:
            return True

    def alive(self) -> bool:
        """Whether the agent this trainer attached to still runs (a cheap check, no message)."""
        return self.agent_pid is not None and shm.pid_alive(self.agent_pid) and \
            agentsocket.agent_listening(self.cfg.job_id)

    def reattach(self, why: str) -> None:
        """The agent died: start a new one (any local rank may) and attach to it. Its hello releases the
        slot reservations the dead agent held, so snapshots and persists go on."""
        self.log.emit("warning", rank=self.rank, message=f"the easyckpt agent (pid {self.agent_pid}) is gone "
                                                          f"({why}); starting a new one")
        self.close()
        self._connect()

    def _agent_log(self) -> str:
        return os.path.join(self.cfg.node_dir, agent_log_name(socket.gethostname()))

    def _spawn(self) -> None:
        # beside the audit log in the node's directory (the save dir itself, unless that is an object store)
        _, fd = SaveDir(self.cfg.node_dir, self.cfg.naming).open_agent_log(socket.gethostname())
        try:
            self._spawned = subprocess.Popen(
                [sys.executable, "-m", "easyckpt.agent", json.dumps(self.cfg.to_json())],
                stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, close_fds=True, start_new_session=True)
        finally:
            os.close(fd)

    def send(self, msg: protocol.Message) -> None:
        """Send one message; if the agent died in the meantime, re-attach (restarting it) once."""
        data = protocol.encode(msg)
        for attempt in (0, 1):
            try:
                if self.sock is None:
                    self._connect()
                assert self.sock is not None    # _connect returns only once attached
                # without blocking: an agent that reads nothing (stopped, hung) costs this message, not
                # training's time; a small AF_UNIX send goes whole or not at all, so no line is ever torn
                self.sock.setblocking(False)
                sent = self.sock.send(data)
                if sent < len(data):
                    self.sock.settimeout(SEND_WAIT)
                    self.sock.sendall(data[sent:])
                return
            except BlockingIOError:
                stopped = " (it is stopped: SIGSTOP or a debugger)" if shm.pid_stopped(self.agent_pid or 0) else ""
                raise AgentError(f"rank {self.rank}: the easyckpt agent (pid {self.agent_pid}) reads nothing"
                                 f"{stopped}: {msg.op} skipped") from None
            except (OSError, AgentError) as exc:
                self.log.emit("warning", rank=self.rank, message=f"agent connection lost ({exc}); re-attaching")
                self.close()
                if attempt:
                    raise AgentError(f"rank {self.rank}: cannot reach the easyckpt agent: {exc}") from exc

    def request(self, msg: protocol.Message, kind: Type[R], timeout: float) -> R:
        """Send ``msg`` and wait for its reply, a ``kind`` (an error reply, or a reply that is not valid,
        raises AgentError). If the agent dies meanwhile, a new one is started and asked once more (a flush
        then persists the step from the slot: nothing waits for a dead agent)."""
        deadline = time.monotonic() + timeout
        for attempt in (0, 1):
            self.send(msg)
            assert self.sock is not None
            try:
                while True:
                    self.sock.settimeout(min(1.0, max(0.01, deadline - time.monotonic())))
                    try:
                        reply = agentsocket.recv_one(self.sock, self.reader)
                        break
                    except socket.timeout:
                        if time.monotonic() > deadline:
                            raise AgentError(f"rank {self.rank}: the agent did not answer {msg.op} within "
                                             f"{timeout}s") from None
                        if not self.alive():
                            reply = None
                            break
            except OSError:
                reply = None
            except BadMessage as exc:
                raise AgentError(f"rank {self.rank}: the agent's answer to {msg.op} is not valid: {exc}") from None
            if reply is not None:
                try:
                    return expect(reply, kind)
                except BadMessage as exc:
                    raise AgentError(f"rank {self.rank}: the agent refused {msg.op}: {exc}") from None
            if attempt:
                break
            self.reattach(f"it exited while answering {msg.op}")
        raise AgentError(f"rank {self.rank}: the agent exited twice while answering {msg.op}")

    def side(self, msg: protocol.Message, timeout: float = 2.0) -> Optional[Reply]:
        """``msg`` on a connection of its own (one_shot), with the key this client already read."""
        return one_shot(self.cfg.job_id, msg, timeout, key=self._key)

    def status(self, timeout: float) -> Optional[StatusReply]:
        reply = self.side(protocol.Status(), timeout)
        return reply if isinstance(reply, StatusReply) else None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def one_shot(job_id: str, msg: protocol.Message, timeout: float = 2.0,
             key: Optional[str] = None) -> Optional[Reply]:
    """Send one message to a job's agent on a connection of its own (no hello: the agent does not count it
    as a trainer); return the reply for ops that have one (status), None otherwise or when no agent of
    this user runs. Threads other than the trainer's main one use this, so they never share its socket."""
    try:
        key = key if key is not None else jobkey.read(job_id)
    except (OSError, ValueError, AgentError):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(agentsocket.address(job_id))
        if not agentsocket.same_user(sock):
            return None
        sock.sendall(protocol.encode(msg, key=key))
        if not isinstance(msg, protocol.Status):
            return None
        return agentsocket.recv_one(sock, agentsocket.LineReader())
    except (OSError, ValueError):
        return None
    finally:
        sock.close()


def agent_status(job_id: str, timeout: float = 2.0) -> Optional[StatusReply]:
    """The agent's status, checked (formats/replies.py); None when no agent answers with a valid one."""
    reply = one_shot(job_id, protocol.Status(), timeout)
    return reply if isinstance(reply, StatusReply) else None
