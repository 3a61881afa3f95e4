"""The client side of the S3-compatible back-end (s3.py): URLs, the boto3 client and its patience, and every
request's failure turned into an OSError (StoreError) that names the request and the store's answer.
This module never imports torch (the agent uses it)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

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
    """A boto3 S3 client (credentials and region as boto3 finds them; ``endpoint_url`` for a compatible store).

    What it computes over each request's body, and why (every byte it saves is CPU the gateway or training
    needs: on a 2-core machine a 216 MB upload went from 0.75 s to 0.56 s with neither, see
    docs/object-storage.md):

    - no per-request CRC32, sent or asked for on reads (botocore's default since 1.36): every file and item has its own
      checksum in the manifest, checked by every load and by ``easyckpt verify`` whatever carried the bytes,
      which a per-request check cannot do for the bytes once stored. (botocore still adds one where the store
      requires it, e.g. a batch delete.)
    - the body's SHA-256 in the request's signature (``sign_payload``) only where it guards something: over
      https TLS already guards the bytes in transit (AWS's SDKs do not sign there either), and to a loopback
      endpoint nothing travels a network; over plain http to another host it is signed, so that nothing on
      the way can change a checkpoint's bytes. EASYCKPT_S3_SIGN_PAYLOAD=1 or 0 decides it instead.
    The request itself (who may write what where) is signed always."""
    try:
        import boto3
        from botocore.config import Config as BotoConfig
    except ImportError:
        raise ConfigError("s3:// save directories need boto3: pip install 'easyckpt[s3]'") from None
    session = boto3.session.Session()   # its own: the default session keeps the credentials it found first
    # where the requests go, as boto3 resolves it (the setting, AWS_ENDPOINT_URL, the config file, else AWS)
    resolved = session.client("s3", endpoint_url=endpoint_url).meta.endpoint_url
    # total_max_attempts counts the first request too (botocore's max_attempts would count retries only: one more)
    cfg = BotoConfig(max_pool_connections=max_pool,
                     retries={"total_max_attempts": patience.attempts, "mode": "standard"},
                     connect_timeout=patience.connect_timeout, read_timeout=patience.read_timeout,
                     request_checksum_calculation="when_required", response_checksum_validation="when_required",
                     s3={"addressing_style": "path", "payload_signing_enabled": sign_payload(resolved)})
    return session.client("s3", endpoint_url=endpoint_url, config=cfg)


def sign_payload(endpoint: str) -> bool:
    """Whether requests to ``endpoint`` carry their body's SHA-256 in the signature (``client``'s docstring):
    EASYCKPT_S3_SIGN_PAYLOAD (1 or 0) if set, else only over plain http to a host other than this one."""
    raw = os.environ.get("EASYCKPT_S3_SIGN_PAYLOAD", "")
    if raw:
        if raw not in ("0", "1"):
            raise ConfigError(f"EASYCKPT_S3_SIGN_PAYLOAD={raw!r}: expected 1 (sign each request's body) or 0")
        return raw == "1"
    url = urlsplit(endpoint)
    if url.scheme != "http":
        return False
    host = url.hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:          # a name: it may resolve anywhere
        return True


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
