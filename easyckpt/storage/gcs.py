"""Google Cloud Storage as a Storage back-end (base.py): paths are ``gs://bucket/key``, over google-cloud-storage.

The commit is s3.py's, with GCS's own preconditions (base.py's docstring gives the call order):

- no rename: a step's objects go under its final prefix, and the manifest, created LAST with
  ``ifGenerationMatch=0`` (the object must not exist), is the commit; ``create_exclusive`` never replaces a
  committed manifest (412 → AlreadyCommitted).
- a large object is uploaded as part objects (``<key>.easyckpt-part-<id>-<n>``, ``parallel`` at a time), then
  composed into the object (32 sources per compose, in levels beyond) and the parts deleted: the object appears
  whole or not at all. A killed writer leaves its parts; ``abort_uploads`` lists and deletes them (a resumable
  upload would be invisible instead, and its bytes sent one chunk after another).
- the lease (storelock.py): ``create_version`` returns the object's generation, ``put_if_match`` replaces it only
  while it is still that generation (``ifGenerationMatch=<generation>``), ``read_version`` takes the bytes, the
  generation, Last-Modified and the reply's Date from one GET (the store's clock, never this host's).

Client library: google-cloud-storage (Google's own, kept by Google). obstore's GCS store uses the XML API paths,
which fake-gcs-server answers 404, so it cannot be tested here; gcsfs wraps the same JSON API with an event loop.
Measured on this project's 2-core machine against fake-gcs-server (128 MiB, best of 3; the emulator, not the
client, bounds these): this writer (16 MiB part objects, 8 in flight, composed) 89 MB/s up, the SDK's one
resumable upload 116 MB/s (the emulator copies each part again to compose; real GCS composes in metadata);
ranged reads, 8 in flight, 356 MB/s down, one GET 534 MB/s. Credentials and project come from where
google-auth looks (GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, the metadata server);
STORAGE_EMULATOR_HOST points it at an emulator (anonymous then). fake-gcs-server honours ``ifGenerationMatch``
only on uploads of at most 8 MiB, and not on compose: real GCS honours both (a manifest over 8 MiB is created
by a resumable upload, which takes the precondition at its start). This module never imports torch.
"""
from __future__ import annotations

import os
import secrets
from functools import partial
from email.utils import parsedate_to_datetime
from typing import Any, List, Optional, Tuple
from urllib.parse import quote

from easyckpt.errors import AlreadyCommitted, ConfigError, ObjectChanged
from easyckpt.formats.manifest import MANIFEST_NAME
from easyckpt.storage.base import Buffer, Version
from easyckpt.storage.blobstore import BlobStore
from easyckpt.storage.blobwriter import PARALLEL, PART_BYTES, Location, Pool, failed

SCHEME = "gs://"
PART_TAG = ".easyckpt-part-"      # a part object's name: <key><PART_TAG><upload id>-<n>
_COMPOSE = 32                     # GCS composes at most 32 sources at once


def _client() -> Any:
    try:
        from google.cloud import storage     # noqa: PLC0415 - importing easyckpt must not import google
    except ImportError:
        raise ConfigError("gs:// save directories need google-cloud-storage: pip install 'easyckpt[gcs]'") from None
    project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT") or "<none>"
    try:
        return storage.Client(project=project)
    except Exception as exc:  # noqa: BLE001 - google.auth's DefaultCredentialsError and the like
        raise ConfigError(f"gs://: no Google Cloud credentials ({type(exc).__name__}: {exc}): set "
                          f"GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`") from None


def _status(exc: BaseException) -> int:
    """The HTTP status of a failed request (google.api_core's exceptions carry ``code``); 0 when none came."""
    exc = exc.__cause__ if exc.__cause__ is not None and not hasattr(exc, "code") else exc
    code = getattr(exc, "code", None)
    return code if isinstance(code, int) else 0


class GcsStorage(BlobStore):
    """The Storage verbs (base.py) on Google Cloud Storage; paths are ``gs://bucket/key`` URLs."""

    scheme = SCHEME

    def _status(self, exc: BaseException) -> int:
        return _status(exc)

    def _stat(self, loc: Location) -> Optional[Tuple[int, float]]:
        blob = self._get(loc)
        return None if blob is None else (int(blob.size), float(blob.updated.timestamp()))

    def _list_one(self, loc: Location) -> None:
        list(self.c.list_blobs(loc.bucket, prefix=loc.prefix(), max_results=1, timeout=self._timeout))

    def _endpoint(self) -> str:
        return os.environ.get("STORAGE_EMULATOR_HOST") or "Google Cloud Storage"

    def _parts(self, loc: Location) -> "_Parts":
        return _Parts(self, loc)

    credentials_hint = ("set GOOGLE_APPLICATION_CREDENTIALS (or gcloud's application-default login) to an account "
                        "that may read and write this bucket")
    endpoint_hint = "check STORAGE_EMULATOR_HOST"

    def _stamps(self, loc: Location) -> List[float]:
        return [b.updated.timestamp() for b in self._list(loc, None)[0]]

    def __init__(self, part_bytes: int = PART_BYTES, parallel: int = PARALLEL, client: Any = None,
                 quick: bool = False):
        from google.api_core.retry import Retry     # noqa: PLC0415
        from google.cloud.storage.retry import DEFAULT_RETRY     # noqa: PLC0415
        self.c = client if client is not None else _client()
        self.part_bytes, self.parallel = part_bytes, parallel
        self._pool = Pool(parallel, "easyckpt-gcs")
        # ``quick``: for a thread that must keep answering (the agent's loop): one attempt, short timeouts
        # (else retried for 20 s at most, about boto3's standard mode for S3: a failed step is said, the next tried)
        self._retry: Optional[Retry] = None if quick else DEFAULT_RETRY.with_timeout(20.0)
        self._timeout: Tuple[float, float] = (2.0, 10.0) if quick else (10.0, 60.0)

    def _blob(self, loc: Location) -> Any:
        return self.c.bucket(loc.bucket).blob(loc.key)

    # ---- writes -----------------------------------------------------------------------------------

    def upload(self, loc: Location, data: bytes, generation: Optional[int] = None) -> int:
        """One object from ``data`` (created only where ``generation`` matches: 0, only if none); its generation."""
        blob = self._blob(loc)
        blob.upload_from_string(data, if_generation_match=generation, timeout=self._timeout,
                                retry=self._retry, checksum="crc32c")
        return int(blob.generation)

    def write_atomic(self, path: str, data: Buffer) -> None:
        self._do("upload", path, lambda: self.upload(Location.parse(path, SCHEME), bytes(data)))

    def create_exclusive(self, path: str, data: Buffer) -> None:
        """Create ``path`` unless it exists (AlreadyCommitted then): the commit."""
        self.create_version(path, data)

    def create_version(self, path: str, data: Buffer) -> str:
        """``create_exclusive``, returning the new object's generation (for a later ``put_if_match``)."""
        try:
            return str(self.upload(Location.parse(path, SCHEME), bytes(data), generation=0))
        except Exception as exc:  # noqa: BLE001 - the store's refusal is the answer
            if _status(exc) == 412:
                raise AlreadyCommitted(f"{path} exists: a committed object is never replaced") from None
            raise failed("upload (ifGenerationMatch=0)", path, exc) from None

    def put_if_match(self, path: str, data: Buffer, etag: str) -> str:
        """Replace ``path`` only while it is the generation ``etag``; ObjectChanged when it is not (replaced or
        removed); the new generation."""
        try:
            return str(self.upload(Location.parse(path, SCHEME), bytes(data), generation=int(etag)))
        except Exception as exc:  # noqa: BLE001
            if _status(exc) in (404, 412):
                raise ObjectChanged(f"{path} is no longer the generation {etag} (another writer replaced or "
                                    f"removed it)") from None
            raise failed(f"upload (ifGenerationMatch={etag})", path, exc) from None

    def sync_dir(self, path: str) -> None:
        """Names are durable once an object is complete."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        raise NotImplementedError("an object store has no rename: the manifest written last is the commit")

    def set_aside(self, src: str, dst: str) -> None:
        """Copied in the store (rewrite), the manifest last; then the originals deleted, the manifest first."""
        s, d = Location.parse(src, SCHEME), Location.parse(dst, SCHEME)
        if self._names(d):
            raise FileExistsError(f"{dst} exists")
        keys = sorted((k for k, _ in self._names(s)), key=lambda k: k.endswith("/" + MANIFEST_NAME))
        bucket = self.c.bucket(s.bucket)
        for k in keys:
            self._do("copy", s.url(k), partial(bucket.copy_blob, bucket.blob(k), self.c.bucket(d.bucket),
                                               d.prefix() + k[len(s.prefix()):], timeout=self._timeout,
                                               retry=self._retry))
        self.delete(src)

    def delete(self, path: str) -> None:
        """An object, or every object under the prefix ``path/``; manifests first."""
        loc = Location.parse(path, SCHEME)
        if not loc.key:
            raise ValueError(f"{path}: refusing to delete a whole bucket")
        keys = [k for k, _ in self._names(loc)] + ([loc.key] if self.is_file(path) else [])
        first = [k for k in keys if k.endswith("/" + MANIFEST_NAME)]
        self._delete_keys(loc, first)
        self._delete_keys(loc, [k for k in keys if k not in first])

    def delete_files(self, paths: List[str]) -> None:
        for path in paths:
            loc = Location.parse(path, SCHEME)
            if not loc.key or loc.key.endswith("/"):
                raise ValueError(f"{path}: not an object's name")
            self._delete_keys(loc, [loc.key])

    def _delete_keys(self, loc: Location, keys: List[str]) -> None:
        """One request per object, in the pool (the emulator answers no batch request); a missing one is no error."""
        bucket = self.c.bucket(loc.bucket)

        def one(k: str) -> None:
            try:
                bucket.delete_blob(k, timeout=self._timeout, retry=self._retry)
            except Exception as exc:  # noqa: BLE001
                if _status(exc) != 404:
                    raise failed("delete", loc.url(k), exc) from None
        for fut in [self.pool.submit(one, k) for k in keys]:
            fut.result()

    def abort_uploads(self, path: str) -> List[str]:
        """Delete the part objects of every unfinished upload under ``path`` (a killed writer's); their keys."""
        loc = Location.parse(path, SCHEME)
        parts = [k for k, _ in self._names(loc) if PART_TAG in k]
        self._delete_keys(loc, parts)
        return sorted({k.split(PART_TAG)[0] for k in parts})

    # ---- reads ------------------------------------------------------------------------------------

    def _list(self, loc: Location, delimiter: Optional[str]) -> Tuple[List[Any], List[str]]:
        def call() -> Tuple[List[Any], List[str]]:
            it = self.c.list_blobs(loc.bucket, prefix=loc.prefix(), delimiter=delimiter, timeout=self._timeout,
                                   retry=self._retry)
            blobs = list(it)
            return blobs, sorted(it.prefixes)
        return self._do("list", loc.url(), call)

    def _names(self, loc: Location) -> List[Tuple[str, int]]:
        return [(b.name, int(b.size or 0)) for b in self._list(loc, None)[0]]

    def _get(self, loc: Location) -> Any:
        """The object's metadata (one GET), None when there is none."""
        if not loc.key or loc.key.endswith("/"):
            return None
        return self._do("get", loc.url(), lambda: self.c.bucket(loc.bucket).get_blob(
            loc.key, timeout=self._timeout, retry=self._retry))

    def listdir(self, path: str) -> List[str]:
        loc = Location.parse(path, SCHEME)
        blobs, prefixes = self._list(loc, "/")
        names = {b.name[len(loc.prefix()):] for b in blobs} | {p[len(loc.prefix()):].rstrip("/") for p in prefixes}
        if not blobs and not prefixes:
            raise FileNotFoundError(f"{path}: no object under this prefix")
        return sorted(n for n in names if n)

    def is_dir(self, path: str) -> bool:
        loc = Location.parse(path, SCHEME)
        return self._do("list", path, lambda: bool(list(self.c.list_blobs(
            loc.bucket, prefix=loc.prefix(), max_results=1, timeout=self._timeout, retry=self._retry))))

    def subdirs(self, path: str) -> List[str]:
        loc = Location.parse(path, SCHEME)
        return sorted(n for n in (p[len(loc.prefix()):].rstrip("/") for p in self._list(loc, "/")[1]) if n)

    def files(self, path: str) -> List[Tuple[str, int]]:
        loc = Location.parse(path, SCHEME)
        return [(k[len(loc.prefix()):], n) for k, n in self._names(loc)]

    def read_version(self, path: str, limit: int) -> Optional[Version]:
        """At most ``limit`` first bytes of ``path`` with its generation (as ``etag``), its Last-Modified and the
        reply's Date, from one GET of the object's media; None when there is no such object."""
        loc = Location.parse(path, SCHEME)
        url = (f"{self.c._connection.API_BASE_URL}/download/storage/v1/b/{quote(loc.bucket, safe='')}/o/"
               f"{quote(loc.key, safe='')}?alt=media")
        headers = {"Range": f"bytes=0-{limit - 1}"} if limit > 0 else {}
        reply = self._do("GET", path, lambda: self.c._http.get(url, headers=headers, timeout=self._timeout))
        if reply.status_code == 404:
            return None
        if reply.status_code not in (200, 206):
            raise failed("GET", path, RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}"))
        data = reply.content[:limit] if limit > 0 else b""

        def stamp(name: str) -> Optional[float]:
            try:
                return parsedate_to_datetime(reply.headers.get(name, "")).timestamp()
            except (TypeError, ValueError):
                return None
        modified = stamp("Last-Modified")
        return Version(data, reply.headers.get("x-goog-generation", ""), modified or 0.0,
                       stamp("Date") if modified is not None else None)

    def read(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        if length == 0:
            return b""
        blob = self._blob(Location.parse(path, SCHEME))
        end = None if length < 0 else offset + length - 1

        def call() -> bytes:
            try:
                return bytes(blob.download_as_bytes(start=offset or None, end=end, timeout=self._timeout,
                                                    retry=self._retry, checksum=None))
            except Exception as exc:  # noqa: BLE001
                if _status(exc) == 416:      # a range starting past the end
                    return b""
                raise
        return self._do("GET", path, call)

    def read_own(self, path: str, max_bytes: int) -> bytes:
        return self.read(path, 0, max_bytes)     # who may write is the bucket's policy: no owner to check


class _Parts:
    """One object's upload as part objects composed at the end (blobwriter.Parts)."""

    def __init__(self, store: GcsStorage, loc: Location):
        self.store, self.loc = store, loc
        self.tag = f"{loc.key}{PART_TAG}{secrets.token_hex(6)}-"

    def put(self, data: bytes) -> None:
        self.store._do("upload", self.loc.url(), lambda: self.store.upload(self.loc, data))

    def part(self, number: int, data: bytes) -> str:
        name = f"{self.tag}{number:05d}"
        self.store._do("upload", self.loc.url(name), lambda: self.store.upload(
            Location(SCHEME, self.loc.bucket, name), data))
        return name

    def complete(self, tokens: List[str]) -> None:
        """Composed into the object, in levels of 32 sources; then the parts (and levels) deleted."""
        bucket, made, level = self.store.c.bucket(self.loc.bucket), list(tokens), 0
        while len(tokens) > _COMPOSE:
            level += 1
            groups = [tokens[i:i + _COMPOSE] for i in range(0, len(tokens), _COMPOSE)]
            tokens = [f"{self.tag}c{level}-{i:05d}" for i in range(len(groups))]
            for name, group in zip(tokens, groups):
                self._compose(bucket, group, name)
            made += tokens
        self._compose(bucket, tokens, self.loc.key)
        self.abort(made)

    def _compose(self, bucket: Any, sources: List[str], name: str) -> None:
        target = bucket.blob(name)
        self.store._do("compose", self.loc.url(name), lambda: target.compose(
            [bucket.blob(s) for s in sources], timeout=self.store._timeout, retry=self.store._retry))

    def abort(self, tokens: List[str]) -> None:
        self.store._delete_keys(self.loc, tokens)
