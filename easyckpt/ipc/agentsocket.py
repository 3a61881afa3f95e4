"""The trainer ↔ agent socket on one node: its abstract address, reading lines off it, and who is at the
other end. The messages that travel on it are formats/protocol.py's; this is the mechanics."""
from __future__ import annotations

import os
import socket
import struct
from typing import Iterator, Optional

from easyckpt.errors import BadMessage
from easyckpt.formats.protocol import MAX_LINE
from easyckpt.formats.replies import Reply, parse_reply


def address(job_id: str) -> str:
    return f"\0easyckpt-agent-{job_id}"



class LineReader:
    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Complete lines (bytes), in order; BadMessage when a line grows past MAX_LINE."""
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                yield line
        if len(self.buf) > MAX_LINE:
            self.buf = b""
            raise BadMessage(f"a line longer than {MAX_LINE} bytes")


def recv_one(sock: socket.socket, reader: LineReader) -> Optional[Reply]:
    """Block (under the socket's timeout) until the agent's next reply arrives, checked (replies.py;
    BadMessage when it is not a valid reply); None on EOF."""
    while True:
        for line in reader.feed(b""):
            return parse_reply(line)
        data = sock.recv(65536)
        if not data:
            return None
        for line in reader.feed(data):   # the reader yields lazily: what follows the line stays buffered
            return parse_reply(line)


def agent_listening(job_id: str, timeout: float = 0.5, own: bool = False) -> bool:
    """Whether anything listens on the job's agent address (connect only; nothing is sent). Bounded: an
    agent that accepts nothing (stopped, or its backlog filled by others) answers EAGAIN at once, and that
    still counts as listening: the name is held (docs/reliability.md promise 13). ``own``: a process of this
    user only (another user's listener is no agent of the job; one that accepts nothing cannot be asked who it is,
    and counts)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(address(job_id))
        return same_user(probe) if own else True
    except (BlockingIOError, socket.timeout):
        return True
    except OSError:
        return False
    finally:
        probe.close()


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end (SO_PEERCRED: set by the kernel, cannot be forged)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    uid: int
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def same_user(sock: socket.socket) -> bool:
    return peer_uid(sock) == os.geteuid()


__all__ = ["LineReader", "address", "agent_listening", "peer_uid", "recv_one", "same_user"]
