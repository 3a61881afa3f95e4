"""Azure Blob Storage as a Storage back-end (base.py): paths are ``az://container/key``, over azure-storage-blob.

The commit is s3.py's, with Azure's own conditions (base.py's docstring gives the call order):

- no rename: a step's objects go under its final prefix, and the manifest, created LAST with ``If-None-Match: *``
  (the blob must not exist: 409 BlobAlreadyExists otherwise), is the commit; ``create_exclusive`` never replaces a
  committed manifest.
- a large blob is written as blocks (``stage_block``, ``parallel`` at a time), then made whole by one
  ``commit_block_list``: nothing is visible under its name until then. A killed writer leaves uncommitted blocks,
  invisible to a plain listing; ``abort_uploads`` finds those blobs (a listing that includes uncommitted blobs)
  and drops them (an empty block list committed, then the blob deleted: real Azure answers 404 to deleting a
  blob that has only uncommitted blocks).
- the lease (storelock.py): ``create_version`` returns the blob's ETag, ``put_if_match`` replaces it only while it
  is still that ETag (``If-Match``, 412 otherwise), ``read_version`` takes the bytes, the ETag, Last-Modified and
  the reply's Date from one GET (the store's clock, never this host's).

Client library: azure-storage-blob (Microsoft's own, kept by Microsoft; adlfs wraps it). Measured on this
project's 2-core machine against Azurite (128 MiB, best of 3; Azurite, a node process, bounds these): this writer
(16 MiB blocks, 8 in flight) 68 MB/s up against the SDK's upload_blob(max_concurrency=8) 134 MB/s: a gap left to
close (measured when each part was copied twice before it was sent; once now, not measured again); ranged reads, 8 in flight, 307 MB/s down, one GET
130 MB/s. Credentials and endpoint as Azure's tools find them: AZURE_STORAGE_CONNECTION_STRING (its
BlobEndpoint names an emulator), else AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or
AZURE_STORAGE_SAS_TOKEN, else azure-identity's DefaultAzureCredential (environment, managed identity, az login).
This module never imports torch, and azure only when a store is opened.
"""
from __future__ import annotations

import base64
import os
import secrets
import time
from email.utils import parsedate_to_datetime
from typing import Any, Dict, List, Optional, Tuple

from easyckpt.errors import AlreadyCommitted, ConfigError, ObjectChanged, StoreError
from easyckpt.formats.manifest import MANIFEST_NAME
from easyckpt.storage.base import Buffer, Version
from easyckpt.storage.blobstore import BlobStore
from easyckpt.storage.blobwriter import PARALLEL, PART_BYTES, Location, Pool, failed

SCHEME = "az://"
_COPY_WAIT_S = 300.0      # set_aside: how long a server-side copy may stay pending


def _service(quick: bool) -> Any:
    try:
        from azure.storage.blob import BlobServiceClient, ExponentialRetry     # noqa: PLC0415 - not on import
    except ImportError:
        raise ConfigError("az:// save directories need azure-storage-blob: pip install 'easyckpt[azure]'") from None
    # ``quick``: for a thread that must keep answering (the agent's loop): one attempt, short timeouts. Else 3
    # retries 3, 5 and 9 s apart (as boto3's standard mode for S3): the SDK's default (15, 18, 24 s) outlasted a
    # 30 s outage silently, each persist taking 44 s, where a failed step should be said and the next one tried
    retry = ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=0 if quick else 3)
    kw: Dict[str, Any] = dict(retry_policy=retry, connection_timeout=2 if quick else 10,
                              read_timeout=10 if quick else 60, max_single_put_size=256 << 20)
    conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if conn:
        return BlobServiceClient.from_connection_string(conn, **kw)
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or os.environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise ConfigError("az://: no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING, or "
                          "AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or "
                          "an azure-identity login)")
    credential: Any = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY") or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    if not credential:
        try:
            from azure.identity import DefaultAzureCredential     # noqa: PLC0415
        except ImportError:
            raise ConfigError("az://: no AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, and azure-identity "
                              "is not installed for a login (pip install azure-identity)") from None
        credential = DefaultAzureCredential()
    return BlobServiceClient(f"https://{account}.blob.core.windows.net", credential=credential, **kw)


def _status(exc: BaseException) -> int:
    code = getattr(exc, "status_code", None)
    return code if isinstance(code, int) else 0


def _block_id(tag: str, number: int) -> str:
    return base64.b64encode(f"{tag}-{number:05d}".encode()).decode()


class AzureStorage(BlobStore):
    """The Storage verbs (base.py) on Azure Blob Storage; paths are ``az://container/key`` URLs."""

    scheme = SCHEME

    def _status(self, exc: BaseException) -> int:
        return _status(exc)

    def _stat(self, loc: Location) -> Optional[Tuple[int, float]]:
        props = self._props(loc)
        return None if props is None else (int(props.size), float(props.last_modified.timestamp()))

    def _list_one(self, loc: Location) -> None:
        container = self.c.get_container_client(loc.bucket)
        next(iter(container.list_blobs(name_starts_with=loc.prefix(), results_per_page=1).by_page()), None)

    def _endpoint(self) -> str:
        return str(self.c.url)

    def _parts(self, loc: Location) -> "_Blocks":
        return _Blocks(self, loc)

    container = "container"
    credentials_hint = ("set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_TOKEN) "
                        "to a key of this account")
    endpoint_hint = "check the BlobEndpoint of AZURE_STORAGE_CONNECTION_STRING"

    def _stamps(self, loc: Location) -> List[float]:
        return [b.last_modified.timestamp() for b in self._list(loc)]

    def __init__(self, part_bytes: int = PART_BYTES, parallel: int = PARALLEL, client: Any = None,
                 quick: bool = False):
        self.c = client if client is not None else _service(quick)
        self.part_bytes, self.parallel = part_bytes, parallel
        self._pool = Pool(parallel, "easyckpt-azure")

    def blob(self, loc: Location) -> Any:
        return self.c.get_blob_client(loc.bucket, loc.key)

    # ---- writes -----------------------------------------------------------------------------------

    def write_atomic(self, path: str, data: Buffer) -> None:
        blob = self.blob(Location.parse(path, SCHEME))
        self._do("upload", path, lambda: blob.upload_blob(bytes(data), overwrite=True))

    def create_exclusive(self, path: str, data: Buffer) -> None:
        """Create ``path`` unless it exists (AlreadyCommitted then): the commit."""
        self.create_version(path, data)

    def create_version(self, path: str, data: Buffer) -> str:
        """``create_exclusive`` (``If-None-Match: *``), returning the new blob's ETag."""
        blob = self.blob(Location.parse(path, SCHEME))
        try:
            return str(blob.upload_blob(bytes(data), overwrite=False)["etag"])
        except Exception as exc:  # noqa: BLE001 - the store's refusal is the answer
            if _status(exc) in (409, 412):
                raise AlreadyCommitted(f"{path} exists: a committed object is never replaced") from None
            raise failed("upload (If-None-Match: *)", path, exc) from None

    def put_if_match(self, path: str, data: Buffer, etag: str) -> str:
        """Replace ``path`` only while it is the version ``etag`` (``If-Match``); ObjectChanged when it is not."""
        from azure.core import MatchConditions     # noqa: PLC0415
        blob = self.blob(Location.parse(path, SCHEME))
        try:
            return str(blob.upload_blob(bytes(data), overwrite=True, etag=etag,
                                        match_condition=MatchConditions.IfNotModified)["etag"])
        except Exception as exc:  # noqa: BLE001
            if _status(exc) in (404, 409, 412):
                raise ObjectChanged(f"{path} is no longer the version {etag} (another writer replaced or "
                                    f"removed it)") from None
            raise failed(f"upload (If-Match: {etag})", path, exc) from None

    def sync_dir(self, path: str) -> None:
        """Names are durable once a blob is committed."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        raise NotImplementedError("an object store has no rename: the manifest written last is the commit")

    def set_aside(self, src: str, dst: str) -> None:
        """Copied in the store (server-side copies, each waited for), the manifest last; then the originals
        deleted, the manifest first."""
        s, d = Location.parse(src, SCHEME), Location.parse(dst, SCHEME)
        if self._list(d):
            raise FileExistsError(f"{dst} exists")
        keys = sorted((b.name for b in self._list(s)), key=lambda k: k.endswith("/" + MANIFEST_NAME))
        for k in keys:
            self._copy(Location(SCHEME, s.bucket, k), Location(SCHEME, d.bucket, d.prefix() + k[len(s.prefix()):]))
        self.delete(src)

    def _copy(self, src: Location, dst: Location) -> None:
        target = self.blob(dst)
        self._do("copy", dst.url(), lambda: target.start_copy_from_url(self.blob(src).url))
        deadline = time.monotonic() + _COPY_WAIT_S
        while True:
            copy = self._do("get properties", dst.url(), lambda: target.get_blob_properties().copy)
            if copy.status != "pending":
                break
            if time.monotonic() > deadline:
                raise StoreError(f"copy {src.url()} -> {dst.url()}: still pending after {_COPY_WAIT_S:g} s")
            time.sleep(0.2)
        if copy.status != "success":
            raise StoreError(f"copy {src.url()} -> {dst.url()}: {copy.status} ({copy.status_description})")

    def delete(self, path: str) -> None:
        """A blob, or every blob under the prefix ``path/``; manifests first."""
        loc = Location.parse(path, SCHEME)
        if not loc.key:
            raise ValueError(f"{path}: refusing to delete a whole container")
        keys = [b.name for b in self._list(loc)] + ([loc.key] if self.is_file(path) else [])
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
        """One request per blob, in the pool; a missing one is no error."""
        def one(k: str) -> None:
            try:
                self.c.get_blob_client(loc.bucket, k).delete_blob()
            except Exception as exc:  # noqa: BLE001
                if _status(exc) != 404:
                    raise failed("delete", loc.url(k), exc) from None
        for fut in [self.pool.submit(one, k) for k in keys]:
            fut.result()

    def abort_uploads(self, path: str) -> List[str]:
        """Drop every blob under ``path`` that has only uncommitted blocks (a killed writer's); their keys."""
        loc = Location.parse(path, SCHEME)
        committed = {b.name for b in self._list(loc)}
        pending = sorted({b.name for b in self._list(loc, ["uncommittedblobs"])} - committed)
        for k in pending:
            self.drop_uncommitted(Location(SCHEME, loc.bucket, k))
        return pending

    def drop_uncommitted(self, loc: Location) -> None:
        """A blob of uncommitted blocks gone: committed empty, then deleted (its blocks go with it)."""
        blob = self.blob(loc)
        self._do("commit (empty)", loc.url(), lambda: blob.commit_block_list([]))
        self._delete_keys(loc, [loc.key])

    # ---- reads ------------------------------------------------------------------------------------

    def _list(self, loc: Location, include: Optional[List[str]] = None) -> List[Any]:
        container = self.c.get_container_client(loc.bucket)
        return self._do("list", loc.url(), lambda: list(container.list_blobs(name_starts_with=loc.prefix(),
                                                                              include=include)))

    def _walk(self, loc: Location) -> Tuple[List[str], List[str]]:
        """(blob names, sub-prefix names) directly under the prefix ``loc``."""
        container = self.c.get_container_client(loc.bucket)
        items = self._do("list", loc.url(), lambda: list(container.walk_blobs(name_starts_with=loc.prefix(),
                                                                               delimiter="/")))
        cut = len(loc.prefix())
        subs = [i.name[cut:].rstrip("/") for i in items if i.name.endswith("/")]
        return [i.name[cut:] for i in items if not i.name.endswith("/")], subs

    def _props(self, loc: Location) -> Any:
        if not loc.key or loc.key.endswith("/"):
            return None
        blob = self.blob(loc)
        try:
            return self._do("get properties", loc.url(), blob.get_blob_properties)
        except FileNotFoundError:
            return None

    def listdir(self, path: str) -> List[str]:
        names, subs = self._walk(Location.parse(path, SCHEME))
        if not names and not subs:
            raise FileNotFoundError(f"{path}: no object under this prefix")
        return sorted(n for n in set(names) | set(subs) if n)

    def is_dir(self, path: str) -> bool:
        loc = Location.parse(path, SCHEME)
        container = self.c.get_container_client(loc.bucket)
        pages = container.list_blobs(name_starts_with=loc.prefix(), results_per_page=1).by_page()
        return self._do("list", path, lambda: bool(list(next(iter(pages), []))))

    def subdirs(self, path: str) -> List[str]:
        return sorted(n for n in self._walk(Location.parse(path, SCHEME))[1] if n)

    def files(self, path: str) -> List[Tuple[str, int]]:
        loc = Location.parse(path, SCHEME)
        return [(b.name[len(loc.prefix()):], int(b.size)) for b in self._list(loc)]

    def read_version(self, path: str, limit: int) -> Optional[Version]:
        """At most ``limit`` first bytes of ``path`` with its ETag, Last-Modified and the reply's Date, from one
        GET; None when there is no such blob."""
        blob, dates = self.blob(Location.parse(path, SCHEME)), []

        def hook(response: Any) -> None:
            dates.append(response.http_response.headers.get("Date", ""))

        def call() -> Tuple[bytes, Any]:
            if limit > 0:
                got = blob.download_blob(offset=0, length=limit, raw_response_hook=hook)
                return bytes(got.readall()), got.properties
            return b"", blob.get_blob_properties(raw_response_hook=hook)
        try:
            data, props = self._do("GET", path, call)
        except FileNotFoundError:
            return None
        try:
            store_now: Optional[float] = parsedate_to_datetime(dates[0]).timestamp() if dates else None
        except (TypeError, ValueError):
            store_now = None
        return Version(data[:limit], str(props.etag), float(props.last_modified.timestamp()), store_now)

    def read(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        if length == 0:
            return b""
        blob = self.blob(Location.parse(path, SCHEME))

        def call() -> bytes:
            try:
                return bytes(blob.download_blob(offset=offset, length=None if length < 0 else length,
                                                max_concurrency=1).readall())
            except Exception as exc:  # noqa: BLE001
                if _status(exc) == 416:      # a range starting past the end
                    return b""
                raise
        return self._do("GET", path, call)

    def read_own(self, path: str, max_bytes: int) -> bytes:
        return self.read(path, 0, max_bytes)     # who may write is the container's policy: no owner to check


class _Blocks:
    """One blob's upload as blocks staged side by side and committed at the end (blobwriter.Parts)."""

    def __init__(self, store: AzureStorage, loc: Location):
        self.store, self.loc, self.blob = store, loc, store.blob(loc)
        self.tag = secrets.token_hex(6)       # block ids of one blob must all have one length

    def put(self, data: bytes) -> None:
        self.store._do("upload", self.loc.url(), lambda: self.blob.upload_blob(data, overwrite=True))

    def part(self, number: int, data: bytes) -> str:
        block = _block_id(self.tag, number)
        self.store._do("stage block", self.loc.url(), lambda: self.blob.stage_block(block, data))
        return block

    def complete(self, tokens: List[str]) -> None:
        from azure.storage.blob import BlobBlock     # noqa: PLC0415
        self.store._do("commit block list", self.loc.url(),
                       lambda: self.blob.commit_block_list([BlobBlock(block_id=t) for t in tokens]))

    def abort(self, tokens: List[str]) -> None:
        self.store.drop_uncommitted(self.loc)
