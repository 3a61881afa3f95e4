"""Trainer ↔ agent protocol: JSON lines over an abstract Unix socket (no file on disk; the name is
free again the moment the agent dies, which also makes it the agent's single-instance lock).

Who may talk (promise 9). The name of an abstract socket is public (/proc/net/unix) and carries no
file permissions, so both ends check the other: the agent accepts a connection only from a process of
its own user (SO_PEERCRED), and the first message of every connection must carry the job's key — 32
random bytes in a 0600 file in /dev/shm that only the job's user can read (jobkey.py). A trainer, in
turn, talks only to an agent of its own user, so a squatter on the name gets nothing. Every message is
checked against the schema below before it is used; a bad one gets an ``error`` reply and the agent
lives on.

Order of messages a trainer sends (the agent answers only hello, flush and status):

  1. hello   {key, rank, world_size, local_rank, pid}  → {ok, agent_pid} or {ok: false, error}
  2. persist {rank, slot, generation, step}             after each snapshot on a storage step
  3. flush   {rank, step, slot, generation}             → {ok, step, error} once the rank's shard of
                                                          ``step`` is durable (or failed); persists
                                                          it first if this agent never heard of it
  4. bye     {rank}                                     the trainer is done; its slots go with it
Side channels, each on a connection of its own whose one message carries ``key`` (client.one_shot):
  term {rank, at} (a SIGTERM arrived), term_step {rank, step}, damaged {step, reason} (the loader
  rejected a committed step), status {} → the agent's state.
A connection that closes without bye is a trainer that died: the agent persists the newest complete
snapshot of its dead ranks, keeps the slots for agent_idle_timeout so a restart can resume from
memory, then removes them and exits.
"""
from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Dict, Optional

from easyckpt.errors import BadMessage

MAX_LINE = 1 << 16          # no valid message comes close; a longer line is an attack or a bug

# op -> {field: type}; ints are non-negative; the first message of a connection also carries "key"
SCHEMA: Dict[str, Dict[str, type]] = {
    "hello": {"rank": int, "world_size": int, "local_rank": int, "pid": int},
    "persist": {"rank": int, "slot": int, "generation": int, "step": int},
    "flush": {"rank": int, "step": int, "slot": int, "generation": int},
    "bye": {"rank": int},
    "term": {"rank": int, "at": float},
    "term_step": {"rank": int, "step": int},
    "damaged": {"step": int, "reason": str},
    "status": {},
}


def address(job_id: str) -> str:
    return f"\0easyckpt-agent-{job_id}"


def encode(msg: Dict[str, Any]) -> bytes:
    return (json.dumps(msg) + "\n").encode()


def parse(line: bytes) -> Dict[str, Any]:
    """One checked message; BadMessage says what is wrong with it."""
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise BadMessage(f"not JSON: {line[:80]!r}") from None
    if not isinstance(msg, dict):
        raise BadMessage("a message is a JSON object")
    op = msg.get("op")
    if op not in SCHEMA:
        raise BadMessage(f"unknown op {str(op)[:40]!r}")
    for name, kind in SCHEMA[op].items():
        value = msg.get(name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = msg[name] = float(value)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise BadMessage(f"{op}: field {name!r} must be {kind.__name__}, got {str(value)[:40]!r}")
        if kind is int and not 0 <= value < 2 ** 62:
            raise BadMessage(f"{op}: field {name!r} = {value} is out of range")
        if kind is str and len(value) > 4096:
            raise BadMessage(f"{op}: field {name!r} is too long")
    if op in ("persist", "flush") and msg["slot"] not in (0, 1):
        raise BadMessage(f"{op}: slot must be 0 or 1")
    if op == "hello" and (msg["world_size"] < 1 or msg["rank"] >= msg["world_size"]):
        raise BadMessage(f"hello: rank {msg['rank']} is not below world_size {msg['world_size']}")
    return msg


class LineReader:
    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes):
        """Complete lines (bytes), in order; BadMessage when a line grows past MAX_LINE."""
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                yield line
        if len(self.buf) > MAX_LINE:
            self.buf = b""
            raise BadMessage(f"a line longer than {MAX_LINE} bytes")


def recv_one(sock: socket.socket, reader: LineReader) -> Optional[Dict[str, Any]]:
    """Block (under the socket's timeout) until one JSON object arrives; None on EOF."""
    while True:
        for line in reader.feed(b""):
            return _reply(line, reader)
        data = sock.recv(65536)
        if not data:
            return None
        for line in reader.feed(data):
            return _reply(line, reader)


def _reply(line: bytes, reader: LineReader) -> Dict[str, Any]:
    # put back what came after this line (the reader yields lazily, so only the rest of buf remains)
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise BadMessage("the agent's reply is not a JSON object")
    return msg


def agent_listening(job_id: str) -> bool:
    """Whether anything listens on the job's agent address (connect only; nothing is sent)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(address(job_id))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end (SO_PEERCRED: set by the kernel, cannot be forged)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def same_user(sock: socket.socket) -> bool:
    return peer_uid(sock) == os.geteuid()
