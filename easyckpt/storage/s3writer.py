"""One new object of an S3-compatible store (s3.py), written front to back as a multipart upload whose parts a
small pool of threads sends while the next ones are cut from the caller's buffers (what comes from the snapshot's
mapping is sent from it, never copied), or as one PUT when it is small. Its own module because the store's verbs
(s3.py) are another job: this one holds an upload's state from the first part to its completion or abort."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, List, Optional, Protocol, Tuple, Union

from easyckpt import _faults as faults
from easyckpt.storage.base import Buffer
from easyckpt.storage.s3client import SCHEME, Location

JOIN_BYTES = 256 << 10     # views smaller than this are copied into the part's last piece instead
Piece = Union[bytearray, memoryview]     # a copy of what ``write`` was given, or a view of the caller's mapping


class Body:
    """A request's body made of pieces, never joined: views of the snapshot's mapping (``write_mapped``) and
    copies of what ``write`` was given. boto3 takes it as a file (it asks ``len``, ``read``, ``seek``, ``tell``),
    and each ``read`` answers a whole piece, which urllib3 hands to one ``sendall``. A bytes body would be
    copied into a BytesIO and sent 16 KiB per call (botocore's handler for PutObject and UploadPart), a part
    of the mapping copied first: on this 2-core machine a 216 MB upload went from about 350 to 416-436 MB/s
    without them (docs/object-storage.md)."""

    def __init__(self, pieces: List[Piece]):
        self._pieces = [memoryview(p).cast("B") for p in pieces if len(p)]
        self._size = sum(len(p) for p in self._pieces)
        self._at = 0        # bytes read so far
        self._i = 0         # the piece the position is in
        self._start = 0     # where that piece starts

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = 0) -> int:
        self._at = max(0, min(self._size, offset + (self._at if whence == 1 else self._size if whence == 2 else 0)))
        self._i = self._start = 0
        while self._i < len(self._pieces) and self._at >= self._start + len(self._pieces[self._i]):
            self._start += len(self._pieces[self._i])
            self._i += 1
        return self._at

    def read(self, n: int = -1) -> Union[bytes, memoryview]:
        """The rest of the piece the position is in (``n`` is ignored: urllib3 and botocore read until empty)."""
        if self._i >= len(self._pieces):
            return b""
        piece = self._pieces[self._i]
        out = piece[self._at - self._start:]
        self._start += len(piece)
        self._at = self._start
        self._i += 1
        return out


class Store(Protocol):
    """What a writer uses of its store (s3.S3Storage): the client, the part size and the pool that sends parts,
    and the bound on small PUTs in flight."""
    c: Any
    part_bytes: int
    parallel: int

    @property
    def pool(self) -> ThreadPoolExecutor: ...

    def wait_for_room(self) -> None: ...

    def track(self, put: "Future[Any]") -> "Future[Any]": ...


class S3Writer:
    """One new object, written front to back: cut into parts of ``part_bytes``, each uploaded by the pool
    as soon as it is full (a multipart upload, started at the first full part). ``finish`` hands over the rest
    (a small object's one PUT goes to the pool) and returns; ``sync`` waits for it and completes the upload:
    the object is visible, whole, when ``sync`` returns, never before. So a step's files upload side by side
    (stepwriter.py finishes every file, then syncs them all) instead of one after the other."""

    def __init__(self, storage: Store, loc: Location):
        self.storage, self.loc = storage, loc
        self.size = 0
        self._pieces: List[Piece] = []     # what the next part holds so far
        self._held = 0                     # its bytes
        self._upload_id: Optional[str] = None
        self._parts: List[Tuple[int, "Future[str]"]] = []
        self._put: Optional["Future[Any]"] = None     # a small object's one PUT, handed over by finish
        self._done = False         # synced: the object is whole and visible
        self._closed = False       # given up (close): it never will be

    def write(self, data: Buffer) -> int:
        """Copied (the caller may reuse ``data`` once this returns); a full part goes out at once."""
        return self._add(memoryview(data).cast("B"), copy=True)

    def write_mapped(self, view: memoryview, start: int, end: int) -> None:
        """Not copied: the parts send straight from ``view`` (the snapshot's slot), which must stay unchanged until
        ``sync`` or ``close`` returns; both wait for every request that reads it."""
        self._add(view[start:end], copy=False)

    def _add(self, view: memoryview, copy: bool) -> int:
        n, part = len(view), self.storage.part_bytes
        self.size += n
        # a small view joins the copied piece: one sendall per small tensor cost more than the copy (a torch file
        # of many small tensors would send thousands of pieces a part)
        copy = copy or n < JOIN_BYTES
        while view:
            take = min(part - self._held, len(view))
            if not copy:
                self._pieces.append(view[:take])
            elif self._pieces and isinstance(self._pieces[-1], bytearray):
                self._pieces[-1] += view[:take]          # small writes (headers, pickles) join one piece
            else:
                self._pieces.append(bytearray(view[:take]))
            self._held += take
            view = view[take:]
            if self._held == part:
                self._send(self._cut())
        return n

    def _cut(self) -> Body:
        body = Body(self._pieces)
        self._pieces, self._held = [], 0
        return body

    def _send(self, part: Body) -> None:
        s = self.storage
        if self._upload_id is None:
            self._upload_id = s.c.create_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key)["UploadId"]
        number = len(self._parts) + 1
        # at most ``parallel`` parts in flight (memory: parallel x part_bytes, of copies at most): oldest first
        pending = [f for _, f in self._parts if not f.done()]
        if len(pending) >= s.parallel:
            pending[0].result()
        self._parts.append((number, s.pool.submit(self._upload_part, number, part)))
        if number == 1 and faults.armed("store.after_first_part"):
            # a writer killed with a part in the store (tests/test_store_checkpoints.py); otherwise the first part
            # does not hold back the next ones (a 216 MB file is 4 parts: waiting made a quarter of it serial)
            self._parts[0][1].result()
            faults.inject("store.after_first_part")

    def _upload_part(self, number: int, data: Body) -> str:
        reply = self.storage.c.upload_part(Bucket=self.loc.bucket, Key=self.loc.key, UploadId=self._upload_id,
                                           PartNumber=number, Body=data)
        return str(reply["ETag"])

    def finish(self) -> None:
        """Everything written is handed over; ``sync`` makes the object whole and visible."""
        s = self.storage
        try:
            if self._upload_id is None:
                if self._put is None:
                    s.wait_for_room()      # at most ``parallel`` small objects held in memory, in flight
                    self._put = s.track(s.pool.submit(s.c.put_object, Bucket=self.loc.bucket, Key=self.loc.key,
                                                      Body=self._cut()))
            elif self._held:
                self._send(self._cut())    # what was held now belongs to its request
        except BaseException:
            self.close()
            raise

    def sync(self) -> None:
        """The object is complete, whole and durable (a completed upload is): waits for what finish handed over."""
        if self._done:
            return
        if self._closed:
            raise RuntimeError(f"{SCHEME}{self.loc.bucket}/{self.loc.key}: given up (closed) before it was synced")
        s = self.storage
        try:
            if self._put is None and self._upload_id is None:
                self.finish()
            if self._upload_id is None:
                assert self._put is not None
                self._put.result()
            else:
                parts = [{"PartNumber": n, "ETag": f.result()} for n, f in self._parts]
                s.c.complete_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key, UploadId=self._upload_id,
                                              MultipartUpload={"Parts": parts})
            self._done = True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """An unfinished object is given up: its requests still queued are cancelled, those already sent are waited
        for (each bounded by the client's timeouts and attempts), then an unfinished upload is aborted (its parts
        freed); a synced one stays. Waiting matters: a failed persist's step is cleaned up next (its prefix listed
        and deleted), and a PUT still in flight then landed after the clean-up, leaving an object no step owns.
        (A small object's PUT that succeeded stays until that clean-up deletes it: nothing lists it without a
        manifest.)"""
        if self._done or self._closed:
            return
        self._closed = True
        sent = [f for _, f in self._parts if not f.cancel()]
        if self._put is not None and not self._put.cancel():
            sent.append(self._put)
        wait(sent)        # their outcome is not ours to report: the failure that made us give up is
        if self._upload_id is None:
            return
        try:
            self.storage.c.abort_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key, UploadId=self._upload_id)
        except Exception:  # noqa: BLE001 - best effort: abort_uploads removes what is left
            pass
        self._upload_id = None
