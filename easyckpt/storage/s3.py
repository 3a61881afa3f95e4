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
- a small object that several writers change (the job's lease, storelock.py) is read with its ETag and the
  store's own times (``read_version``) and replaced only if it is still that version (``put_if_match``: a PUT
  with ``If-Match``; RGW 16 checks it atomically, against the ETag without its quotes, and ignores ``If-Match``
  on DELETE, so nothing here deletes conditionally).

Credentials and endpoint come from where boto3 looks (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, the AWS
config and credentials files, AWS_ENDPOINT_URL) or from ``endpoint_url``. ``check`` asks the store for the
bucket once, so wrong credentials, a missing bucket or an unreachable endpoint fail with a message naming
what to fix, before anything else. This module never imports torch (the agent uses it).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from easyckpt.errors import AlreadyCommitted, ConfigError, ObjectChanged, StoreError
from easyckpt.formats.manifest import MANIFEST_NAME
from easyckpt.storage import objectread
from easyckpt.storage.base import Buffer, Version
from easyckpt.storage.s3writer import S3Writer
from easyckpt.storage.s3client import (
    PARALLEL,
    PART_BYTES,
    SCHEME,
    Location,
    Patience,
    _Client,
    _code,
    _failed,
    client,
)


_CHUNK = 1 << 20     # read_into's reads from a reply's body
_REFUSED = ("PreconditionFailed", "412", "ConditionalRequestConflict")     # a conditional request's "no"


class S3Storage:
    """The Storage verbs (base.py) on one S3-compatible store; paths are ``s3://bucket/key`` URLs."""

    has_rename = False
    local = False

    def __init__(self, endpoint_url: Optional[str] = None, part_bytes: int = PART_BYTES, parallel: int = PARALLEL,
                 c: Any = None, patience: Patience = Patience()):
        self.endpoint_url = endpoint_url
        self.part_bytes, self.parallel = part_bytes, parallel
        self.c = _Client(c if c is not None else client(endpoint_url, parallel * 2, patience))
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._puts: List["Future[Any]"] = []
        self._bare_etags = False     # put_if_match: this store wants If-Match's ETag without quotes (RGW)

    def track(self, put: "Future[Any]") -> "Future[Any]":
        with self._lock:
            self._puts = [f for f in self._puts if not f.done()] + [put]
        return put

    def wait_for_room(self) -> None:
        """Until fewer than ``parallel`` handed-over PUTs are in flight (memory: parallel x part_bytes at most)."""
        while True:
            with self._lock:
                self._puts = [f for f in self._puts if not f.done()]
                oldest = self._puts[0] if len(self._puts) >= self.parallel else None
            if oldest is None:
                return
            try:
                oldest.result()
            except Exception:  # noqa: BLE001 - its own writer's sync reports it
                pass

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
        if self.is_file(path):      # one HEAD: a prefix of the same name is no object (``exists`` would LIST too)
            raise FileExistsError(f"{path} exists")
        return S3Writer(self, Location.parse(path))

    def write_atomic(self, path: str, data: Buffer) -> None:
        loc = Location.parse(path)
        self.c.put_object(Bucket=loc.bucket, Key=loc.key, Body=bytes(data))

    def create_exclusive(self, path: str, data: Buffer) -> None:
        """Create ``path`` with ``data`` unless it exists (AlreadyCommitted then): the commit's PUT."""
        self.create_version(path, data)

    def create_version(self, path: str, data: Buffer) -> str:
        """``create_exclusive``, returning the new object's ETag (for a later ``put_if_match``)."""
        loc = Location.parse(path)
        try:
            reply = self.c.put_object(Bucket=loc.bucket, Key=loc.key, Body=bytes(data), IfNoneMatch="*")
        except Exception as exc:  # noqa: BLE001 - the store's refusal is the answer
            if _code(exc) in _REFUSED:
                raise AlreadyCommitted(f"{path} exists: a committed object is never replaced") from None
            raise
        return str(reply.get("ETag", ""))

    def put_if_match(self, path: str, data: Buffer, etag: str) -> str:
        """Replace ``path`` with ``data`` only if it is still the version whose ETag is ``etag`` (a PUT with
        ``If-Match``, which the store checks atomically); ObjectChanged when another writer replaced or removed
        it meanwhile. Returns the new ETag. RGW compares If-Match with the ETag unquoted and refuses the quoted
        form S3 documents: a refusal while the object still has ``etag`` is that, and the PUT is sent again
        with it bare (then always, for this store)."""
        loc = Location.parse(path)
        for bare in ((True,) if self._bare_etags else (False, True)):
            try:
                reply = self.c.put_object(Bucket=loc.bucket, Key=loc.key, Body=bytes(data),
                                          IfMatch=etag.strip('"') if bare else etag)
                self._bare_etags = bare
                return str(reply.get("ETag", ""))
            except Exception as exc:  # noqa: BLE001 - the store's refusal is the answer
                if _code(exc) not in _REFUSED + ("404", "NoSuchKey"):
                    raise
            now = self.read_version(path, 0)
            if now is None or now.etag.strip('"') != etag.strip('"'):
                raise ObjectChanged(f"{path} is no longer the version {etag} (another writer replaced or removed it)")
        raise StoreError(f"put_object {path}: the store refused If-Match {etag} although the object has that ETag: "
                         f"it does not support conditional writes, which the job's lease needs")

    def sync_dir(self, path: str) -> None:
        """Names are durable once an object is complete."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        raise NotImplementedError("an object store has no rename: the manifest written last is the commit")

    def set_aside(self, src: str, dst: str) -> None:
        """Copied in the store (server-side; boto3's managed copy, in parts for large objects), the manifest last;
        then the originals deleted, the manifest first (Storage.set_aside)."""
        s, d = Location.parse(src), Location.parse(dst)
        if _list_keys(self, d):
            raise FileExistsError(f"{dst} exists")
        keys = sorted((k for k, _ in _list_keys(self, s)), key=lambda k: k.endswith("/" + MANIFEST_NAME))
        for k in keys:
            self.c.copy(CopySource={"Bucket": s.bucket, "Key": k}, Bucket=d.bucket,
                        Key=d.prefix() + k[len(s.prefix()):])
        self.delete(src)

    def delete(self, path: str) -> None:
        """An object, or every object under the prefix ``path/``; the manifest (``*/easyckpt_manifest.json``)
        first, so a half-deleted step is never taken for a checkpoint."""
        loc = Location.parse(path)
        if not loc.key:
            raise ValueError(f"{path}: refusing to delete a whole bucket")
        keys = [k for k, _ in _list_keys(self, loc)]
        if self._head(loc) is not None:
            keys.append(loc.key)
        first = [k for k in keys if k.endswith("/" + MANIFEST_NAME)]
        for k in first:
            self.c.delete_object(Bucket=loc.bucket, Key=k)
        self._delete_keys(loc.bucket, [k for k in keys if k not in first], path)

    def delete_files(self, paths: List[str]) -> None:
        """These objects, by name (nothing listed): one batch request per bucket (the commit's markers and
        claim: one request where deleting each as a prefix took three)."""
        by_bucket: Dict[str, List[str]] = {}
        for path in paths:
            loc = Location.parse(path)
            if not loc.key or loc.key.endswith("/"):
                raise ValueError(f"{path}: not an object's name")
            by_bucket.setdefault(loc.bucket, []).append(loc.key)
        for bucket, keys in by_bucket.items():
            self._delete_keys(bucket, keys, f"{SCHEME}{bucket}")

    def _delete_keys(self, bucket: str, keys: List[str], under: str) -> None:
        for i in range(0, len(keys), 1000):
            reply = self.c.delete_objects(Bucket=bucket,
                                          Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            # a batch delete answers 200 and names the keys it did not delete: each is a failure, not a success
            errors = reply.get("Errors") or []
            if errors:
                bad = errors[0]
                more = f" (and {len(errors) - 1} more keys under {under})" if len(errors) > 1 else ""
                raise StoreError(f"delete {SCHEME}{bucket}/{bad.get('Key', '')}: {bad.get('Code', '')}: "
                                 f"{bad.get('Message', '')}{more}")

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

    def subdirs(self, path: str) -> List[str]:
        loc = Location.parse(path)
        names: Set[str] = set()
        try:
            for page in self.c.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=loc.prefix(),
                                                                         Delimiter="/"):
                names.update(sub["Prefix"][len(loc.prefix()):].rstrip("/") for sub in page.get("CommonPrefixes", []))
        except Exception as exc:  # noqa: BLE001
            raise _failed("LIST", path, exc) from None
        return sorted(n for n in names if n)

    def is_file(self, path: str) -> bool:
        return self._head(Location.parse(path)) is not None

    def exists(self, path: str) -> bool:
        loc = Location.parse(path)
        return self._head(loc) is not None or self.is_dir(path)

    def size(self, path: str) -> int:
        head = self._head(Location.parse(path))
        if head is None:
            raise FileNotFoundError(path)
        return int(head["ContentLength"])

    def owner(self, path: str) -> Optional[Tuple[int, int]]:
        return None     # who may write is the bucket's policy: no owner to check

    def read_hashed(self, path: str, algo: Optional[str] = None, on_bytes: Optional[Callable[[int], None]] = None,
                    size: Optional[int] = None) -> Tuple[memoryview, Optional[str]]:
        return objectread.read_hashed(self, path, algo, on_bytes, size)

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

    def read_version(self, path: str, limit: int) -> Optional[Version]:
        """At most ``limit`` first bytes of ``path`` with its ETag and the store's times, from one GET (so the
        bytes are those of that ETag); None when there is no such object."""
        loc = Location.parse(path)
        try:
            reply = self.c.get_object(Bucket=loc.bucket, Key=loc.key)
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in ("404", "NoSuchKey"):
                return None
            raise _failed("GET", path, exc) from None
        body = reply["Body"]
        try:
            data = bytes(body.read(limit)) if limit > 0 else b""
        except Exception as exc:  # noqa: BLE001 - a connection cut mid-body
            raise _failed("GET (reading the body of)", path, exc) from None
        finally:
            body.close()        # the rest of a larger object is never read
        date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            store_now: Optional[float] = parsedate_to_datetime(date).timestamp() if date else None
        except (TypeError, ValueError):
            store_now = None
        return Version(data, str(reply.get("ETag", "")), float(reply["LastModified"].timestamp()), store_now)

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

    def read_own(self, path: str, max_bytes: int) -> bytes:
        return self.read(path, 0, max_bytes)     # who may write is the bucket's policy: no owner to check

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        """``len(view)`` bytes from ``offset`` into ``view`` (one ranged GET, read in chunks of ``_CHUNK`` bytes: no
        buffer of the request's size between the socket and the caller's); the bytes received, fewer only when
        the object is shorter."""
        loc = Location.parse(path)
        if not len(view):
            return 0
        try:
            body = self.c.get_object(Bucket=loc.bucket, Key=loc.key,
                                     Range=f"bytes={offset}-{offset + len(view) - 1}")["Body"]
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in ("404", "NoSuchKey"):
                raise FileNotFoundError(path) from None
            if _code(exc) == "InvalidRange":
                return 0
            raise _failed("GET", path, exc) from None
        got = 0
        try:
            # in chunks, each copied into place: urllib3 2's readinto reads the whole request into a temporary
            # bytes (itself a copy of a zeroed bytearray) before copying it, three copies of a 32 MiB piece
            while got < len(view):
                data = body.read(min(_CHUNK, len(view) - got))
                if not data:
                    break
                view[got:got + len(data)] = data
                got += len(data)
        except Exception as exc:  # noqa: BLE001 - a connection cut mid-body
            raise _failed("GET (reading the body of)", path, exc) from None
        finally:
            body.close()
        return got

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

