"""Trainer ↔ agent protocol: JSON lines over an abstract Unix socket (no file on disk; the name is
free again the moment the agent dies, which also makes it the agent's single-instance lock).

Order of messages a trainer sends (the agent answers only hello and flush):

  1. hello   {rank, world_size, local_rank, pid}       → {ok, agent_pid}
  2. persist {rank, slot, generation, step}             after each snapshot on a storage step
  3. flush   {rank, step, slot, generation}             → {ok, step, error} once the rank's shard of
                                                          ``step`` is durable (or failed); persists
                                                          it first if this agent never heard of it
  4. bye     {rank}                                     the trainer is done; its slots go with it
A connection that closes without bye is a trainer that died: the agent persists the newest complete
snapshot of its dead ranks, keeps the slots for agent_idle_timeout so a restart can resume from
memory, then removes them and exits.
"""
from __future__ import annotations

import json
import socket
from typing import Any, Dict, Optional


def address(job_id: str) -> str:
    return f"\0easyckpt-agent-{job_id}"


def encode(msg: Dict[str, Any]) -> bytes:
    return (json.dumps(msg) + "\n").encode()


class LineReader:
    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes):
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


def recv_one(sock: socket.socket, reader: LineReader) -> Optional[Dict[str, Any]]:
    """Block (under the socket's timeout) until one message arrives; None on EOF."""
    pending = list(reader.feed(b""))
    while not pending:
        data = sock.recv(65536)
        if not data:
            return None
        pending = list(reader.feed(data))
    msg, rest = pending[0], pending[1:]
    if rest:
        reader.buf = b"".join(encode(m) for m in rest) + reader.buf
    return msg
