"""An S3-compatible object store (AWS S3, Ceph RGW, MinIO, ...) as a Storage back-end (base.py), over boto3.

Paths are ``s3://bucket/key``; a "directory" is a key prefix ending in ``/``. What differs from POSIX, and
why the commit is designed around it (base.py's docstring gives the call order):

- there is no rename: a step's objects are written under its final prefix, and the manifest, written LAST
  with a conditional create (``If-None-Match: *`` on a single PUT, which RGW 16 honours; it ignores the
  header on CompleteMultipartUpload), is the commit. A prefix without a manifest is invisible to readers;
  ``create_exclusive`` never overwrites a committed manifest.
- an object appears whole or not at all (a PUT, or a multipart upload once completed): ``write_atomic`` is a
  plain PUT; ``sync`` and ``sync_dir`` have nothing to do.
- a large object is a multipart upload, its parts sent by a small pool of threads (parts of
  ``part_bytes``, at most ``parallel`` in flight), streamed from the caller's buffers: a shard is never
  copied whole in memory. An upload that is never completed (its writer killed) holds its parts until
  ``abort_uploads`` removes them; a new agent of the job does that for its prefix.
- deleting a step deletes its manifest FIRST, so that a half-deleted step is never read as a checkpoint.

Credentials and endpoint come from where boto3 looks (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, the AWS
config and credentials files, AWS_ENDPOINT_URL) or from ``endpoint_url``. ``check`` asks the store for the
bucket once, so wrong credentials, a missing bucket or an unreachable endpoint fail with a message naming
what to fix, before anything else. This module never imports torch (the agent uses it).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from easyckpt import _faults as faults
from easyckpt.errors import AlreadyCommitted, ConfigError, StoreError
from easyckpt.storage.base import Buffer

SCHEME = "s3://"
PART_BYTES = 64 << 20          # S3 allows 5 MiB to 5 GiB per part, 10,000 parts
PARALLEL = 8


def is_url(path: str) -> bool:
    return str(path).startswith(SCHEME)


@dataclass(frozen=True)
class Location:
    bucket: str
    key: str            # without a leading "/"; "" is the bucket's top

    @classmethod
    def parse(cls, url: str) -> "Location":
        if not is_url(url):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, key = url[len(SCHEME):].partition("/")
        if not bucket or "//" in key or any(part in (".", "..") for part in key.split("/")):
            raise ValueError(f"{url!r}: expected s3://BUCKET/PREFIX (no '.', '..' or empty path parts)")
        return cls(bucket, key)

    def prefix(self) -> str:
        """The key as a directory prefix ("" or ending in "/")."""
        return self.key if not self.key or self.key.endswith("/") else self.key + "/"


@dataclass(frozen=True)
class Patience:
    """How long one request may take: boto3's attempts (standard mode: exponential backoff between them, on
    throttling (503 SlowDown) and connection errors too) and its timeouts, in seconds."""
    attempts: int = 5
    connect_timeout: float = 10
    read_timeout: float = 60


# for a thread that must keep answering (the agent's loop): one attempt, short timeouts; it asks again later
QUICK = Patience(attempts=1, connect_timeout=2, read_timeout=10)


def client(endpoint_url: Optional[str] = None, max_pool: int = PARALLEL * 2, patience: Patience = Patience()) -> Any:
    """A boto3 S3 client (credentials and region as boto3 finds them; ``endpoint_url`` for a compatible store)."""
    try:
        import boto3
        from botocore.config import Config as BotoConfig
    except ImportError:
        raise ConfigError("s3:// save directories need boto3: pip install 'easyckpt[s3]'") from None
    cfg = BotoConfig(max_pool_connections=max_pool, retries={"max_attempts": patience.attempts, "mode": "standard"},
                     connect_timeout=patience.connect_timeout, read_timeout=patience.read_timeout,
                     s3={"addressing_style": "path"})
    # a session of its own: the default session keeps the credentials it found first, whatever changes since
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg)


def _code(exc: BaseException) -> str:
    """The store's error code (NoSuchKey, 412, SlowDown...) of a failed request; "" when it never answered."""
    if isinstance(exc, StoreError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""


def _failed(what: str, url: str, exc: BaseException) -> StoreError:
    """The client's exception (after its bounded retries) as an OSError naming the request and the answer."""
    if isinstance(exc, StoreError):
        return exc
    code = _code(exc)
    failed = StoreError(f"{what} {url}: {code + ': ' if code else ''}{type(exc).__name__}: {exc}")
    failed.__cause__ = exc
    return failed


class _Client:
    """The boto3 client with every request's failure (after boto3's bounded retries) an OSError, StoreError,
    caused by the client's exception (``_code`` reads the store's answer from it): callers that survive a store
    that does not answer (the agent) catch OSError, as they do for a file system."""

    def __init__(self, c: Any):
        self._c = c

    def get_paginator(self, name: str) -> Any:
        return self._c.get_paginator(name)      # pages fail while iterated: their callers turn that into StoreError

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._c, name)

        def call(**kwargs: Any) -> Any:
            try:
                return method(**kwargs)
            except Exception as exc:  # noqa: BLE001 - every failure of a request is the store's answer
                raise _failed(name, f"{SCHEME}{kwargs.get('Bucket', '')}/{kwargs.get('Key', '')}", exc) from exc
        return call


class S3Writer:
    """One new object, written front to back: buffered into parts of ``part_bytes``, each uploaded by the pool
    as soon as it is full (a multipart upload, started at the first full part); ``finish`` completes it (a
    small object is one PUT). Nothing is visible under the key before ``finish``."""

    def __init__(self, storage: "S3Storage", loc: Location):
        self.storage, self.loc = storage, loc
        self.size = 0
        self._buf = bytearray()
        self._upload_id: Optional[str] = None
        self._parts: List[Tuple[int, "Future[str]"]] = []
        self._done = False

    def write(self, data: Buffer) -> int:
        """Full parts go out as they are cut from ``data`` (one copy each); only a part's remainder is buffered."""
        view = memoryview(data).cast("B")
        n, pos, part = len(view), 0, self.storage.part_bytes
        self.size += n
        if self._buf:
            pos = min(part - len(self._buf), n)
            self._buf += view[:pos]
            if len(self._buf) == part:
                self._send(bytes(self._buf))
                self._buf = bytearray()
        while n - pos >= part:
            self._send(bytes(view[pos:pos + part]))
            pos += part
        self._buf += view[pos:]
        return n

    def write_mapped(self, view: memoryview, start: int, end: int) -> None:
        self.write(view[start:end])

    def _send(self, part: bytes) -> None:
        s = self.storage
        if self._upload_id is None:
            self._upload_id = s.c.create_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key)["UploadId"]
        number = len(self._parts) + 1
        # at most ``parallel`` parts in flight (memory: parallel x part_bytes): wait for the oldest first
        pending = [f for _, f in self._parts if not f.done()]
        if len(pending) >= s.parallel:
            pending[0].result()
        self._parts.append((number, s.pool.submit(self._upload_part, number, part)))
        if number == 1:
            self._parts[0][1].result()
            faults.inject("store.after_first_part")     # a writer killed mid-upload: tests/test_s3_checkpoints.py

    def _upload_part(self, number: int, data: bytes) -> str:
        reply = self.storage.c.upload_part(Bucket=self.loc.bucket, Key=self.loc.key, UploadId=self._upload_id,
                                           PartNumber=number, Body=data)
        return str(reply["ETag"])

    def finish(self) -> None:
        s = self.storage
        try:
            if self._upload_id is None:
                s.c.put_object(Bucket=self.loc.bucket, Key=self.loc.key, Body=bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                parts = [{"PartNumber": n, "ETag": f.result()} for n, f in self._parts]
                s.c.complete_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key, UploadId=self._upload_id,
                                              MultipartUpload={"Parts": parts})
            self._buf = bytearray()
            self._done = True
        except BaseException:
            self.close()
            raise

    def sync(self) -> None:
        """A completed upload is durable."""

    def close(self) -> None:
        """An unfinished upload is aborted (its parts freed); a finished one stays."""
        if self._done or self._upload_id is None:
            return
        for _, f in self._parts:
            f.cancel()
        try:
            self.storage.c.abort_multipart_upload(Bucket=self.loc.bucket, Key=self.loc.key, UploadId=self._upload_id)
        except Exception:  # noqa: BLE001 - best effort: abort_uploads removes what is left
            pass
        self._upload_id = None


class S3Storage:
    """The Storage verbs (base.py) on one S3-compatible store; paths are ``s3://bucket/key`` URLs."""

    has_rename = False

    def __init__(self, endpoint_url: Optional[str] = None, part_bytes: int = PART_BYTES, parallel: int = PARALLEL,
                 c: Any = None, patience: Patience = Patience()):
        self.endpoint_url = endpoint_url
        self.part_bytes, self.parallel = part_bytes, parallel
        self.c = _Client(c if c is not None else client(endpoint_url, parallel * 2, patience))
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="easyckpt-s3")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def check(self, url: str) -> None:
        """ConfigError naming what to fix when the bucket of ``url`` cannot be reached with these credentials."""
        loc = Location.parse(url)
        where = f"{url} (endpoint {self.endpoint_url or 'from the AWS configuration'})"
        try:
            self.c.head_bucket(Bucket=loc.bucket)
        except Exception as exc:  # noqa: BLE001 - every failure is named for the user
            code = _code(exc)
            cause = exc.__cause__ if isinstance(exc, StoreError) and exc.__cause__ is not None else exc
            if type(cause).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
                hint = ("no credentials: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the AWS credentials file, "
                        "AWS_PROFILE) to a key of this store")
            elif code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                hint = ("the credentials were refused: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the AWS "
                        "credentials file) to a key of this store")
            elif code in ("404", "NoSuchBucket"):
                hint = f"bucket {loc.bucket!r} does not exist: create it first"
            elif not code:
                hint = (f"the endpoint does not answer ({type(cause).__name__}: {cause}): check endpoint_url / "
                        f"AWS_ENDPOINT_URL")
            else:
                hint = f"{code}: {cause}"
            raise ConfigError(f"cannot use {where}: {hint}") from None

    # ---- writes -----------------------------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        """Prefixes need no creating."""

    def make_own_dir(self, path: str) -> None:
        """No staging directory on a store: the step's objects go under its final prefix."""

    def check_own_dir(self, path: str) -> None:
        pass

    def open_writer(self, path: str, direct: bool = True) -> S3Writer:
        loc = Location.parse(path)
        if self.exists(path):
            raise FileExistsError(f"{path} exists")
        return S3Writer(self, loc)

    def write_atomic(self, path: str, data: Buffer) -> None:
        loc = Location.parse(path)
        self.c.put_object(Bucket=loc.bucket, Key=loc.key, Body=bytes(data))

    def create_exclusive(self, path: str, data: Buffer) -> None:
        """Create ``path`` with ``data`` unless it exists (AlreadyCommitted then): the commit's PUT."""
        loc = Location.parse(path)
        try:
            self.c.put_object(Bucket=loc.bucket, Key=loc.key, Body=bytes(data), IfNoneMatch="*")
        except Exception as exc:  # noqa: BLE001 - the store's refusal is the answer
            if _code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise AlreadyCommitted(f"{path} exists: a committed object is never replaced") from None
            raise

    def sync_dir(self, path: str) -> None:
        """Names are durable once an object is complete."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        raise NotImplementedError("an object store has no rename: the manifest written last is the commit")

    def delete(self, path: str) -> None:
        """An object, or every object under the prefix ``path/``; the manifest (``*/easyckpt_manifest.json``)
        first, so a half-deleted step is never taken for a checkpoint."""
        loc = Location.parse(path)
        if not loc.key:
            raise ValueError(f"{path}: refusing to delete a whole bucket")
        keys = [k for k, _ in _list_keys(self, loc)]
        if self._head(loc) is not None:
            keys.append(loc.key)
        first = [k for k in keys if k.endswith("/easyckpt_manifest.json")]
        for k in first:
            self.c.delete_object(Bucket=loc.bucket, Key=k)
        rest = [k for k in keys if k not in first]
        for i in range(0, len(rest), 1000):
            self.c.delete_objects(Bucket=loc.bucket, Delete={"Objects": [{"Key": k} for k in rest[i:i + 1000]],
                                                              "Quiet": True})

    def abort_uploads(self, path: str) -> List[str]:
        """Abort every incomplete multipart upload under the prefix ``path`` (a killed writer's); returns their keys."""
        loc = Location.parse(path)
        aborted = []
        kwargs: Dict[str, Any] = {"Bucket": loc.bucket, "Prefix": loc.prefix()}
        while True:
            page = self.c.list_multipart_uploads(**kwargs)
            for up in page.get("Uploads", []):
                self.c.abort_multipart_upload(Bucket=loc.bucket, Key=up["Key"], UploadId=up["UploadId"])
                aborted.append(up["Key"])
            if not page.get("IsTruncated"):
                return aborted
            kwargs.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))

    # ---- reads ------------------------------------------------------------------------------------

    def _head(self, loc: Location) -> Optional[Dict[str, Any]]:
        if not loc.key or loc.key.endswith("/"):
            return None
        try:
            return dict(self.c.head_object(Bucket=loc.bucket, Key=loc.key))
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise _failed("HEAD", f"{SCHEME}{loc.bucket}/{loc.key}", exc) from None

    def listdir(self, path: str) -> List[str]:
        loc = Location.parse(path)
        names, found = set(), False
        paginator = self.c.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=loc.bucket, Prefix=loc.prefix(), Delimiter="/"):
                for obj in page.get("Contents", []):
                    found = True
                    names.add(obj["Key"][len(loc.prefix()):])
                for sub in page.get("CommonPrefixes", []):
                    found = True
                    names.add(sub["Prefix"][len(loc.prefix()):].rstrip("/"))
        except Exception as exc:  # noqa: BLE001
            raise _failed("LIST", path, exc) from None
        if not found:
            raise FileNotFoundError(f"{path}: no object under this prefix")
        return sorted(n for n in names if n)

    def is_dir(self, path: str) -> bool:
        loc = Location.parse(path)
        try:
            page = self.c.list_objects_v2(Bucket=loc.bucket, Prefix=loc.prefix(), MaxKeys=1)
        except Exception as exc:  # noqa: BLE001
            raise _failed("LIST", path, exc) from None
        return bool(page.get("KeyCount") or page.get("Contents"))

    def exists(self, path: str) -> bool:
        loc = Location.parse(path)
        return self._head(loc) is not None or self.is_dir(path)

    def size(self, path: str) -> int:
        head = self._head(Location.parse(path))
        if head is None:
            raise FileNotFoundError(path)
        return int(head["ContentLength"])

    def files(self, path: str) -> List[Tuple[str, int]]:
        loc = Location.parse(path)
        return [(k[len(loc.prefix()):], n) for k, n in _list_keys(self, loc)]

    def mtime(self, path: str) -> float:
        loc = Location.parse(path)
        head = self._head(loc)
        if head is not None:
            return float(head["LastModified"].timestamp())
        stamps = [obj["LastModified"].timestamp() for obj in _list_objects(self, loc)]
        return float(max(stamps)) if stamps else 0.0

    def read(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        loc = Location.parse(path)
        if length == 0:
            return b""
        kwargs: Dict[str, Any] = {}
        if offset or length >= 0:
            kwargs["Range"] = f"bytes={offset}-{'' if length < 0 else offset + length - 1}"
        try:
            body = self.c.get_object(Bucket=loc.bucket, Key=loc.key, **kwargs)["Body"]
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in ("404", "NoSuchKey"):
                raise FileNotFoundError(path) from None
            if _code(exc) == "InvalidRange":
                return b""
            raise _failed("GET", path, exc) from None
        try:
            return bytes(body.read())
        except Exception as exc:  # noqa: BLE001 - a connection cut mid-body
            raise _failed("GET (reading the body of)", path, exc) from None
        finally:
            body.close()

    def read_ranges(self, path: str, ranges: List[Tuple[int, int]]) -> List[bytes]:
        """Several ``(offset, length)`` ranges of one object, fetched in parallel (ranged GETs)."""
        futures = [self.pool.submit(self.read, path, off, n) for off, n in ranges]
        return [f.result() for f in futures]


def _list_objects(storage: S3Storage, loc: Location) -> List[Dict[str, Any]]:
    """Every object under the prefix ``loc``, recursively, as the listing describes it."""
    out: List[Dict[str, Any]] = []
    try:
        for page in storage.c.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=loc.prefix()):
            out.extend(page.get("Contents", []))
    except Exception as exc:  # noqa: BLE001
        raise _failed("LIST", f"{SCHEME}{loc.bucket}/{loc.key}", exc) from None
    return out


def _list_keys(storage: S3Storage, loc: Location) -> List[Tuple[str, int]]:
    """Every object under the prefix ``loc`` (key, size), recursively."""
    return [(obj["Key"], int(obj["Size"])) for obj in _list_objects(storage, loc)]

