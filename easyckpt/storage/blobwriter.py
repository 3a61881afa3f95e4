"""What the gs:// (gcs.py) and az:// (azure.py) back-ends share: their URLs, and one new object written front to
back as parts that a small pool of threads uploads while the next ones are cut from the caller's buffers.

Each store assembles the parts its own way (``Parts``): GCS as part objects composed into the final one, Azure as
blocks staged and then committed as a block list. Both are what S3's multipart upload is to s3writer.py: nothing is
visible under the final name until the last call, and a writer killed before it leaves parts that the store's
``abort_uploads`` finds and removes (a new agent of the job does that for its prefix). This module never imports
torch, google or azure (the agent uses it)."""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, List, Optional, Protocol

from easyckpt import _faults as faults
from easyckpt.errors import StoreError
from easyckpt.storage.base import Buffer

PARALLEL = 8
PART_BYTES = 64 << 20


@dataclass(frozen=True)
class Location:
    """``scheme://bucket/key``: the bucket (a GCS bucket, an Azure container) and the key ("" for its top)."""
    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str, scheme: str) -> "Location":
        if not str(url).startswith(scheme):
            raise ValueError(f"{url!r} is not a {scheme} URL")
        bucket, _, key = url[len(scheme):].partition("/")
        if not bucket or "//" in key or any(part in (".", "..") for part in key.split("/")):
            raise ValueError(f"{url!r}: expected {scheme}BUCKET/PREFIX (no '.', '..' or empty path parts)")
        return cls(scheme, bucket, key)

    def prefix(self) -> str:
        """The key as a directory prefix ("" or ending in "/")."""
        return self.key if not self.key or self.key.endswith("/") else self.key + "/"

    def url(self, key: Optional[str] = None) -> str:
        return f"{self.scheme}{self.bucket}/{self.key if key is None else key}"


def failed(what: str, url: str, exc: BaseException) -> StoreError:
    """A client's exception (after its own bounded retries) as an OSError naming the request and the answer:
    callers that survive a store that does not answer (the agent) catch OSError, as for a file system."""
    if isinstance(exc, StoreError):
        return exc
    error = StoreError(f"{what} {url}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class Parts(Protocol):
    """One object's upload as its store does it: ``put`` a small object whole, ``part`` numbered parts (from 1, in
    any order, side by side), ``complete`` them in order into the object (visible then, never before), ``abort``
    what the parts left."""

    def put(self, data: bytes) -> None: ...

    def part(self, number: int, data: bytes) -> str: ...

    def complete(self, tokens: List[str]) -> None: ...

    def abort(self, tokens: List[str]) -> None: ...


class Pool:
    """The threads a store's writers and ranged reads share (``parallel`` of them) and the bound on small
    objects in flight: a store's ``pool`` and ``wait_for_room`` (s3.py's, for the same reasons)."""

    def __init__(self, parallel: int, name: str):
        self.parallel, self._name = parallel, name
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._puts: List["Future[Any]"] = []

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix=self._name)
            return self._pool

    def track(self, put: "Future[Any]") -> "Future[Any]":
        with self._lock:
            self._puts = [f for f in self._puts if not f.done()] + [put]
        return put

    def wait_for_room(self) -> None:
        while True:
            with self._lock:
                self._puts = [f for f in self._puts if not f.done()]
                oldest = self._puts[0] if len(self._puts) >= self.parallel else None
            if oldest is None:
                return
            wait([oldest])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class PartWriter:
    """One new object (base.Writer): cut into parts of ``part_bytes``, each uploaded by the pool as soon as it is full
    (at most ``parallel`` in flight: memory parallel x part_bytes); ``finish`` hands over the rest, ``sync`` waits
    and completes. A part is joined into one bytes before it goes (the client libraries take bytes, not a list of
    views: one copy of each part, which S3's writer avoids)."""

    def __init__(self, pool: Pool, parts: Parts, url: str, part_bytes: int):
        self.pool, self.parts, self.url, self.part_bytes = pool, parts, url, part_bytes
        self.size = 0
        self._held: List[Any] = []         # bytes copied by write, views of the caller's mapping (write_mapped)
        self._n = 0
        self._sent: List["Future[str]"] = []
        self._put: Optional["Future[Any]"] = None
        self._done = self._closed = False

    def write(self, data: Buffer) -> int:
        self._add(memoryview(data).cast("B"), copy=True)
        return len(data)

    def write_mapped(self, view: memoryview, start: int, end: int) -> None:
        """Not copied until its part is cut (``view`` must stay unchanged until then: ``finish`` cuts the last)."""
        self._add(view[start:end], copy=False)

    def _add(self, view: memoryview, copy: bool) -> None:
        self.size += len(view)
        while view:
            take = min(self.part_bytes - self._n, len(view))
            self._held.append(bytes(view[:take]) if copy else view[:take])
            self._n += take
            view = view[take:]
            if self._n == self.part_bytes:
                self._send()

    def _cut(self) -> bytes:
        data = b"".join(self._held)
        self._held, self._n = [], 0
        return data

    def _send(self) -> None:
        number = len(self._sent) + 1
        pending = [f for f in self._sent if not f.done()]
        if len(pending) >= self.pool.parallel:
            pending[0].result()
        self._sent.append(self.pool.pool.submit(self.parts.part, number, self._cut()))
        if number == 1 and faults.armed("store.after_first_part"):
            # a writer killed with a part in the store (tests/test_store_checkpoints.py)
            self._sent[0].result()
            faults.inject("store.after_first_part")

    def finish(self) -> None:
        try:
            if not self._sent:
                if self._put is None:
                    self.pool.wait_for_room()
                    self._put = self.pool.track(self.pool.pool.submit(self.parts.put, self._cut()))
            elif self._n:
                self._send()
        except BaseException:
            self.close()
            raise

    def sync(self) -> None:
        """The object is whole, visible and durable when this returns."""
        if self._done:
            return
        if self._closed:
            raise RuntimeError(f"{self.url}: given up (closed) before it was synced")
        try:
            if self._put is None and not self._sent:
                self.finish()
            if self._put is not None:
                self._put.result()
            else:
                self.parts.complete([f.result() for f in self._sent])
            self._done = True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """An unfinished object is given up: queued parts cancelled, sent ones waited for, then their parts
        removed (best effort: the store's ``abort_uploads`` removes what is left)."""
        if self._done or self._closed:
            return
        self._closed = True
        sent = [f for f in self._sent if not f.cancel()]
        if self._put is not None and not self._put.cancel():
            sent.append(self._put)
        wait(sent)
        tokens = [f.result() for f in sent if f is not self._put and f.exception() is None]
        if tokens:
            try:
                self.parts.abort(tokens)
            except Exception:  # noqa: BLE001 - best effort
                pass
