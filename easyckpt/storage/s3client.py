"""The client side of the S3-compatible back-end (s3.py): URLs, the boto3 client and its patience, and every
request's failure turned into an OSError (StoreError) that names the request and the store's answer.
This module never imports torch (the agent uses it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from easyckpt.errors import ConfigError, StoreError

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
    # total_max_attempts counts the first request too (botocore's max_attempts would count retries only: one more)
    cfg = BotoConfig(max_pool_connections=max_pool,
                     retries={"total_max_attempts": patience.attempts, "mode": "standard"},
                     connect_timeout=patience.connect_timeout, read_timeout=patience.read_timeout,
                     s3={"addressing_style": "path"})
    # a session of its own: the default session keeps the credentials it found first, whatever changes since
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg)


def _code(exc: BaseException) -> str:
    """The store's error code (NoSuchKey, 412, SlowDown...) of a failed request; "" when it never answered."""
    if isinstance(exc, StoreError) and exc.__cause__ is not None:
        exc = exc.__cause__
    # a timeout has a ``response`` too, None (requests' exceptions, botocore's ReadTimeoutError): no answer
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return str(error.get("Code", "")) if isinstance(error, dict) else ""


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
