"""What the gs:// and az:// back-ends (gcs.py, azure.py) answer the same way: every verb that needs no more of a
store than its own ``read`` (a ranged GET), ``_stat`` (one object's size and modification time), ``_stamps``
(the modification times under a prefix) and ``is_dir``; the pool their writers (blobwriter.PartWriter) and
ranged reads share; a failed request as the StoreError that names it. Each store's module keeps what its SDK
decides: the requests, the conditional create, the lease, the uploads.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, TypeVar

from easyckpt.storage import objectread
from easyckpt.errors import ConfigError
from easyckpt.storage.blobwriter import Location, PartWriter, Parts, Pool, failed

T = TypeVar("T")


class BlobStore:
    has_rename = False        # an object store: the commit is the manifest, created last (manifestcommit.py)
    local = False
    scheme = ""               # the subclass's: "gs", "az"
    _pool: Pool

    # -- what each store's module answers ------------------------------------------------------------------
    def _status(self, exc: BaseException) -> int:
        """The HTTP status of a failed request; 0 when no reply came."""
        raise NotImplementedError

    def _stat(self, loc: Location) -> Optional[Tuple[int, float]]:
        """The object's size and modification time (one request), None when there is no such object."""
        raise NotImplementedError

    def _stamps(self, loc: Location) -> List[float]:
        """The modification times of the objects under ``loc``'s prefix."""
        raise NotImplementedError

    def is_dir(self, path: str) -> bool:
        raise NotImplementedError

    def read(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        raise NotImplementedError

    def _list_one(self, loc: Location) -> None:
        """One listing request under ``loc``'s prefix (what ``check`` asks of the store)."""
        raise NotImplementedError

    def _endpoint(self) -> str:
        """Where the requests go, for messages."""
        raise NotImplementedError

    def _parts(self, loc: Location) -> Parts:
        """How the store takes an object in parts (blobwriter.Parts)."""
        raise NotImplementedError

    container = "bucket"      # what the store calls the top of a URL
    credentials_hint = ""     # what to set when the credentials are refused
    endpoint_hint = ""        # what to check when nothing answers
    part_bytes: int

    # -- the same on every store -----------------------------------------------------------------------------
    @property
    def pool(self) -> Any:
        return self._pool.pool

    def wait_for_room(self) -> None:
        self._pool.wait_for_room()

    def close(self) -> None:
        self._pool.close()

    def _do(self, what: str, url: str, call: Callable[[], T]) -> T:
        """``call()``, its failure a StoreError (an OSError) naming the request; FileNotFoundError on a 404."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - every failure of a request is the store's answer
            if self._status(exc) == 404:
                raise FileNotFoundError(url) from None
            raise failed(what, url, exc) from None

    def check(self, url: str) -> None:
        """ConfigError naming what to fix when the bucket (container) of ``url`` cannot be listed with these
        credentials."""
        loc = Location.parse(url, self.scheme)
        try:
            self._list_one(loc)
        except Exception as exc:  # noqa: BLE001 - every failure is named for the user
            code = self._status(exc)
            if code in (401, 403) or type(exc).__name__ == "ClientAuthenticationError":
                hint = f"the credentials were refused: {self.credentials_hint}"
            elif code == 404:
                hint = f"{self.container} {loc.bucket!r} does not exist: create it first"
            elif not code:
                hint = f"the endpoint does not answer ({type(exc).__name__}: {exc}): {self.endpoint_hint}"
            else:
                hint = f"{code}: {exc}"
            raise ConfigError(f"cannot use {url} (endpoint {self._endpoint()}): {hint}") from None

    def makedirs(self, path: str) -> None:
        """Prefixes need no creating."""

    def make_own_dir(self, path: str) -> None:
        """No staging directory on a store."""

    def check_own_dir(self, path: str) -> None:
        pass

    def open_writer(self, path: str, direct: bool = True) -> PartWriter:
        if self.is_file(path):
            raise FileExistsError(f"{path} exists")
        return PartWriter(self._pool, self._parts(Location.parse(path, self.scheme)), path, self.part_bytes)

    def is_file(self, path: str) -> bool:
        return self._stat(Location.parse(path, self.scheme)) is not None

    def exists(self, path: str) -> bool:
        return self.is_file(path) or self.is_dir(path)

    def owner(self, path: str) -> Optional[Tuple[int, int]]:
        return None     # who may write is the bucket's (container's) policy: no owner to check

    def size(self, path: str) -> int:
        stat = self._stat(Location.parse(path, self.scheme))
        if stat is None:
            raise FileNotFoundError(path)
        return stat[0]

    def mtime(self, path: str) -> float:
        loc = Location.parse(path, self.scheme)
        stat = self._stat(loc)
        if stat is not None:
            return stat[1]
        stamps = self._stamps(loc)
        return float(max(stamps)) if stamps else 0.0

    def read_hashed(self, path: str, algo: Optional[str] = None, on_bytes: Optional[Callable[[int], None]] = None,
                    size: Optional[int] = None) -> Tuple[memoryview, Optional[str]]:
        return objectread.read_hashed(self, path, algo, on_bytes, size)

    def read_into(self, path: str, offset: int, view: memoryview) -> int:
        """``len(view)`` bytes from ``offset`` into ``view`` (one ranged GET); fewer only when the object is shorter."""
        data = self.read(path, offset, len(view)) if len(view) else b""
        view[:len(data)] = data
        return len(data)

    def read_ranges(self, path: str, ranges: List[Tuple[int, int]]) -> List[bytes]:
        """Several ``(offset, length)`` ranges of one object, fetched in parallel."""
        futures = [self.pool.submit(self.read, path, off, n) for off, n in ranges]
        return [f.result() for f in futures]
