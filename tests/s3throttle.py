"""A throttling front for the tests' real S3 server: a TCP proxy on 127.0.0.1 that answers the first request of
a new connection with ``503 SlowDown`` (S3's throttling answer, its XML error body) while it is told to refuse,
and otherwise passes the connection through to the gateway untouched. The server behind it is the real one; the
client library is not touched: what is tested is how easyckpt's client meets a store that throttles.

    with ThrottlingProxy(server["ENDPOINT"]) as proxy:
        proxy.refuse(3)                  # the next three new connections: 503 SlowDown, then closed
        S3Storage(endpoint_url=proxy.url)...
"""
from __future__ import annotations

import socket
import threading
from typing import List, Optional, Tuple
from urllib.parse import urlparse

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')
TIMEOUT = 30.0        # every socket of the proxy: nothing waits for ever


class ThrottlingProxy:
    def __init__(self, endpoint: str):
        parsed = urlparse(endpoint)
        self.upstream: Tuple[str, int] = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.5)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._remaining = 0
        self.refused = 0              # requests answered 503 SlowDown so far
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._open: List[socket.socket] = []        # shut at exit: a pooled connection's pipe returns at once
        self._accepting = threading.Thread(target=self._accept, name="s3throttle-accept", daemon=True)

    def __enter__(self) -> "ThrottlingProxy":
        self._accepting.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._accepting.join(timeout=TIMEOUT)
        self._listener.close()
        with self._lock:
            self._shut()
        for t in list(self._threads):
            t.join(timeout=TIMEOUT)

    def refuse(self, n: int) -> None:
        """Answer the first request of each of the next ``n`` new connections with 503 SlowDown; the connections
        open now are closed, so that the client's next requests come on new ones (a pooled connection whose peer
        closed it is replaced by the client before it is used)."""
        with self._lock:
            self._remaining = n
            self._shut()

    def _shut(self) -> None:
        for sock in self._open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._open = []

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), name="s3throttle-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT)
        with self._lock:
            self._open.append(conn)
        with conn:
            head = _read_head(conn)
            if head is None:
                return
            with self._lock:
                refuse = self._remaining > 0
                if refuse:
                    self._remaining -= 1
                    self.refused += 1
            if refuse:
                _refuse(conn, head)
                return
            with socket.create_connection(self.upstream, timeout=TIMEOUT) as up:
                with self._lock:
                    self._open.append(up)
                up.sendall(head)
                back = threading.Thread(target=_pipe, args=(up, conn), daemon=True)
                back.start()
                _pipe(conn, up)
                back.join(timeout=TIMEOUT)


def _read_head(conn: socket.socket) -> Optional[bytes]:
    """The request line and headers (and whatever of the body came with them); None if the client left."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            got = conn.recv(65536)
        except OSError:
            return None
        if not got or len(data) > 1 << 20:
            return None
        data += got
    return data


def _refuse(conn: socket.socket, head: bytes) -> None:
    """503 SlowDown, then close. A body the client sends without waiting (no ``Expect: 100-continue``) is read
    first, as a server does, so that the client sees the answer and not a reset."""
    headers, _, early = head.partition(b"\r\n\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in
              (line.partition(b":") for line in headers.split(b"\r\n")[1:])}
    if fields.get(b"expect", b"").lower() != b"100-continue":
        left = int(fields.get(b"content-length", b"0") or 0) - len(early)
        while left > 0:
            try:
                got = conn.recv(min(left, 1 << 20))
            except OSError:
                return
            if not got:
                return
            left -= len(got)
    try:
        conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                     + str(len(SLOW_DOWN)).encode() + b"\r\nConnection: close\r\n\r\n" + SLOW_DOWN)
    except OSError:
        pass


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
