"""Which Storage back-end serves a path: an ``s3://bucket/prefix`` URL an S3-compatible store (s3.py), anything
else the local or network file system (posix.py). The one place a save directory's name picks its back-end.

One S3 client per process and endpoint, made on first use: the agent, a trainer's loader and the CLI each reach
the store through it. The endpoint is the job's ``endpoint_url`` setting where a Config has set it
(``set_endpoint``), else where boto3 looks (AWS_ENDPOINT_URL, the AWS config file), else AWS itself.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, Optional, Tuple, cast

from easyckpt.errors import ConfigError
from easyckpt.storage.base import Storage
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.s3 import S3Storage
from easyckpt.storage.s3client import PART_BYTES, QUICK, Patience, is_url

MIN_PART_MIB = 5     # S3's smallest part (but the last)
# ---- issue 52 item 5: gs:// and az:// (to become entries of the scheme registry) ----
SCHEMES = ("s3://", "gs://", "az://")     # every object store's URL scheme this package opens


def is_store_url(path: object) -> bool:
    """Whether ``path`` is an object store's URL (s3://, gs://, az://)."""
    return str(path).startswith(SCHEMES)
# ---- end issue 52 item 5 ----

_lock = threading.Lock()
_stores: Dict[Tuple[object, ...], S3Storage] = {}
_endpoint: Optional[str] = None


def part_bytes() -> int:
    """The multipart upload's part size: EASYCKPT_S3_PART_MIB (at least 5, S3's minimum), else 64 MiB. Larger
    parts mean fewer requests, smaller ones less memory per upload in flight (parallel x part)."""
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


def remote(path: str, quick: bool = False) -> Optional[S3Storage]:
    """The object store serving ``path``, or None when it is a file-system path. ``quick``: a client that tries
    once with short timeouts (s3.QUICK), for a thread that must keep answering while the store is down."""
    if str(path).startswith(("gs://", "az://")):     # issue 52 item 5
        return _other_store(str(path), quick)
    if not is_url(str(path)):
        return None
    # keyed by what boto3 reads from the environment too: a process whose environment changes (a test, a
    # tool run on two stores) gets a client for the store it now names
    key = (_endpoint, os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_ACCESS_KEY_ID"), quick)
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = S3Storage(_endpoint, part_bytes=part_bytes(),
                                             patience=QUICK if quick else Patience())
        return store


# ---- issue 52 item 5: gs:// and az:// ----
_others: Dict[Tuple[object, ...], object] = {}


def _other_store(path: str, quick: bool) -> Optional[S3Storage]:
    """The GCS or Azure store of ``path``, one per process and environment (the variables each SDK reads), made on
    first use; their modules imported only then (importing easyckpt imports no google or azure library). Typed as
    S3Storage until the Storage protocol carries the read and lease verbs (they have them, by the same names)."""
    gcs = path.startswith("gs://")
    env = ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS") if gcs else (
        "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY")
    key = (path[:5], quick) + tuple(os.environ.get(name) for name in env)
    with _lock:
        store = _others.get(key)
        if store is None:
            if gcs:
                from easyckpt.storage.gcs import GcsStorage
                store = _others[key] = GcsStorage(part_bytes=part_bytes(), quick=quick)
            else:
                from easyckpt.storage.azure import AzureStorage
                store = _others[key] = AzureStorage(part_bytes=part_bytes(), quick=quick)
        return cast(S3Storage, store)
# ---- end issue 52 item 5 ----


def storage_for(path: str, quick: bool = False) -> Storage:
    """The back-end of ``path``: the object store of an s3://, gs:// or az:// URL, else the POSIX file system."""
    store = remote(path, quick)
    return store if store is not None else PosixStorage()
