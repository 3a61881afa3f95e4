"""Trainer side of the agent protocol (protocol.py): attach to the node's agent, starting it on demand.

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
from typing import Any, Dict, Optional

from ..config import Config
from ..errors import AgentError, ConfigError
from ..events import AuditLog
from . import protocol


class AgentClient:
    def __init__(self, cfg: Config, rank: int, local_rank: int, world_size: int, log: AuditLog):
        self.cfg, self.rank, self.local_rank, self.world_size, self.log = cfg, rank, local_rank, world_size, log
        self.sock: Optional[socket.socket] = None
        self.reader = protocol.LineReader()
        self.agent_pid: Optional[int] = None
        self._spawned: Optional[subprocess.Popen] = None
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
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.cfg.agent_start_timeout)
            try:
                sock.connect(protocol.address(self.cfg.job_id))
                sock.sendall(protocol.encode({"op": "hello", "rank": self.rank, "world_size": self.world_size,
                                              "local_rank": self.local_rank, "pid": os.getpid()}))
                self.reader = protocol.LineReader()
                reply = protocol.recv_one(sock, self.reader)
                if reply and reply.get("ok"):
                    self.sock, self.agent_pid = sock, reply["agent_pid"]
                    return
                sock.close()   # an agent on its way out: try again (and start a new one)
                if reply and reply.get("error"):
                    raise ConfigError(reply["error"])
            except OSError:
                sock.close()
            if self.local_rank == 0 and (self._spawned is None or self._spawned.poll() is not None):
                self._spawn()
            if time.monotonic() > deadline:
                raise AgentError(f"rank {self.rank}: no easyckpt agent answered for job {self.cfg.job_id} within "
                                 f"{self.cfg.agent_start_timeout}s; local rank 0 starts it — see "
                                 f"{self._agent_log()} for its errors")
            time.sleep(0.05)

    def _agent_log(self) -> str:
        return os.path.join(self.cfg.save_dir, f".easyckpt-agent-{socket.gethostname()}.log")

    def _spawn(self) -> None:
        with open(self._agent_log(), "ab") as err:
            self._spawned = subprocess.Popen(
                [sys.executable, "-m", "easyckpt.engine.agent", json.dumps(self.cfg.to_json())],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, close_fds=True, start_new_session=True)

    def send(self, msg: Dict[str, Any]) -> None:
        """Send one message; if the agent died in the meantime, re-attach (restarting it) once."""
        for attempt in (0, 1):
            try:
                if self.sock is None:
                    self._connect()
                self.sock.sendall(protocol.encode(msg))
                return
            except (OSError, AgentError) as exc:
                self.log.emit("warning", rank=self.rank, message=f"agent connection lost ({exc}); re-attaching")
                self.close()
                if attempt:
                    raise AgentError(f"rank {self.rank}: cannot reach the easyckpt agent: {exc}") from exc

    def request(self, msg: Dict[str, Any], timeout: float) -> Dict[str, Any]:
        self.send(msg)
        assert self.sock is not None
        self.sock.settimeout(timeout)
        try:
            reply = protocol.recv_one(self.sock, self.reader)
        except socket.timeout:
            raise AgentError(f"rank {self.rank}: the agent did not answer {msg['op']} within {timeout}s") from None
        if reply is None:
            raise AgentError(f"rank {self.rank}: the agent exited while answering {msg['op']}")
        return reply

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def one_shot(job_id: str, msg: Dict[str, Any], timeout: float = 2.0) -> Optional[Dict[str, Any]]:
    """Send one message to a job's agent on a connection of its own (no hello: the agent does not count it
    as a trainer); return the reply for ops that have one (status), None otherwise or when no agent runs.
    Threads other than the trainer's main one use this, so they never share its socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(protocol.address(job_id))
        sock.sendall(protocol.encode(msg))
        if msg.get("op") != "status":
            return None
        return protocol.recv_one(sock, protocol.LineReader())
    except OSError:
        return None
    finally:
        sock.close()
