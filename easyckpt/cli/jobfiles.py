"""Where an operator tool that changes a save directory (``easyckpt prune``) takes the job's lock and writes its
log: the save dir itself, or for an object store the job's lease there (storage/storelock.py) and the job's
default local_dir on this node (config.default_local_dir)."""
from __future__ import annotations

from typing import Union

from easyckpt.config import default_local_dir
from easyckpt.storage.joblock import JobLock
from easyckpt.storage.resolve import is_store_url as is_url, remote, storage_for
from easyckpt.storage.storelock import StoreLock


def prune_lock(save_dir: str, job: str) -> Union[JobLock, StoreLock]:
    """The job lock prune takes: the save dir's flock, or on an object store the job's lease, taken only when no
    lease runs (not even this job's own)."""
    store = remote(save_dir)
    return StoreLock(store, save_dir, job, None, own_ok=False) if store is not None else JobLock(save_dir, job, None)


def node_dir(save_dir: str, job: str) -> str:
    """Where prune's log goes: the save dir, or for an object store the job's default local_dir on this node."""
    if not is_url(save_dir):
        return save_dir
    where = default_local_dir(job)
    storage_for(where).makedirs(where)
    return where
