"""Which Storage back-end serves a path: the one place a save directory's name picks its back-end.

A URL ``SCHEME://bucket/prefix`` of a scheme in ``_BACKENDS`` is an object store's (s3:// an S3-compatible store,
s3.py; gs:// Google Cloud Storage, gcs.py; az:// Azure Blob Storage, azure.py); anything else is the local or network file system (posix.py). A back-end for another store is one entry
there: its module is imported only when a path of its scheme is opened, so importing easyckpt never imports a
store's client library (boto3, google-cloud-storage, azure-storage-blob). Callers ask ``storage_for(path)``, then
the back-end (``Storage.local``, its verbs); ``is_store_url`` / ``is_url`` for settings checked before a store is
opened. Nothing outside this module tests a path for a scheme.

One client per process, scheme and credentials, made on first use: the agent, a trainer's loader and the CLI
each reach the store through it. The s3:// endpoint is the job's ``endpoint_url`` setting where a Config has set
it (``set_endpoint``), else where boto3 looks (AWS_ENDPOINT_URL, the AWS config file), else AWS itself.
"""
from __future__ import annotations

import os
import re
import threading
from typing import Callable, Dict, NamedTuple, Optional, Tuple

from easyckpt.errors import ConfigError
from easyckpt.storage.base import Storage
from easyckpt.storage.posix import PosixStorage

MIN_PART_MIB = 5     # S3's smallest part (but the last)
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

_lock = threading.Lock()
_stores: Dict[Tuple[object, ...], Storage] = {}
_endpoint: Optional[str] = None


class Backend(NamedTuple):
    make: Callable[[bool], Storage]           # quick -> a new client of the store (quick: tries once, short timeouts)
    key: Callable[[], Tuple[object, ...]]     # what the client depends on: another value, another client


def part_bytes() -> int:
    """The multipart upload's part size: EASYCKPT_S3_PART_MIB (at least 5, S3's minimum), else 64 MiB. Larger
    parts mean fewer requests, smaller ones less memory per upload in flight (parallel x part)."""
    from easyckpt.storage.s3client import PART_BYTES

    raw = os.environ.get("EASYCKPT_S3_PART_MIB", "")
    if not raw:
        return PART_BYTES
    try:
        mib = int(raw)
    except ValueError:
        mib = 0
    if mib < MIN_PART_MIB:
        raise ConfigError(f"EASYCKPT_S3_PART_MIB={raw!r}: expected a whole number of MiB >= {MIN_PART_MIB}")
    return mib << 20


def set_endpoint(endpoint_url: Optional[str]) -> None:
    """The endpoint of s3:// paths in this process from now on (the job's setting; None: boto3's own lookup)."""
    global _endpoint
    _endpoint = endpoint_url or None


def _s3(quick: bool) -> Storage:
    from easyckpt.storage.s3 import S3Storage
    from easyckpt.storage.s3client import QUICK, Patience

    return S3Storage(_endpoint, part_bytes=part_bytes(), patience=QUICK if quick else Patience())


def _s3_key() -> Tuple[object, ...]:
    # keyed by what boto3 reads from the environment too: a process whose environment changes (a test, a tool
    # run on two stores) gets a client for the store it now names
    return _endpoint, os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_ACCESS_KEY_ID")


def _gcs(quick: bool) -> Storage:
    from easyckpt.storage.gcs import GcsStorage

    return GcsStorage(part_bytes=part_bytes(), quick=quick)


def _gcs_key() -> Tuple[object, ...]:
    # what google-cloud-storage reads from the environment: the emulator's address, the credentials' file
    return tuple(os.environ.get(name) for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"))


def _azure(quick: bool) -> Storage:
    from easyckpt.storage.azure import AzureStorage

    return AzureStorage(part_bytes=part_bytes(), quick=quick)


def _azure_key() -> Tuple[object, ...]:
    return tuple(os.environ.get(name) for name in (
        "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"))


_BACKENDS: Dict[str, Backend] = {
    "s3": Backend(_s3, _s3_key),
    "gs": Backend(_gcs, _gcs_key),       # Google Cloud Storage (storage/gcs.py, extra "gcs")
    "az": Backend(_azure, _azure_key),   # Azure Blob Storage (storage/azure.py, extra "azure")
}


def scheme(path: object) -> Optional[str]:
    """The URL scheme of ``path`` ("s3"), lower case; None for a file-system path."""
    m = _URL.match(str(path))
    return m.group(1).lower() if m else None


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL at all (any scheme: one no back-end serves is refused, never a directory)."""
    return scheme(path) is not None


def is_store_url(path: object) -> bool:
    """Whether ``path`` is an object store's URL of a scheme easyckpt serves."""
    return scheme(path) in _BACKENDS


def schemes() -> Tuple[str, ...]:
    """The URL schemes a save directory may have, as users write them ("s3://")."""
    return tuple(f"{s}://" for s in _BACKENDS)


def remote(path: str, quick: bool = False) -> Optional[Storage]:
    """THE parser of a save directory's name: the object store serving ``path``, or None when it is a file-system
    path. ``quick``: a client that tries once with short timeouts (s3client.QUICK), for a thread that must keep
    answering while the store is down."""
    backend = _BACKENDS.get(scheme(path) or "")
    if backend is None:
        return None
    key = (scheme(path), quick) + backend.key()
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = backend.make(quick)
        return store


def storage_for(path: str, quick: bool = False) -> Storage:
    """The back-end of ``path``: the object store of a URL, else the POSIX file system."""
    store = remote(path, quick)
    return store if store is not None else PosixStorage()
