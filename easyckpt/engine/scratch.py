"""Files for framework calls that only speak in paths: scratch directories next to the checkpoints.

The Hugging Face Trainer's tokenizer or processor can only save itself into a directory, its resume path
reads ``trainer_state.json`` from one, and DeepSpeed ships a helper script as a file of its package.
Adapters hold no file I/O (.importlinter keeps them from storage/), so they come here. A scratch directory is named by
formats/layout.py's ``scratch_name`` (job and, where ranks differ, rank: two jobs or ranks on one output
directory never share one); it is created, written and removed through the Storage interface, and whoever
made it removes it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, List, Optional, Tuple

from easyckpt.errors import CheckpointError
from easyckpt.formats.layout import scratch_name
from easyckpt.formats.manifest import MANIFEST_NAME, Manifest
from easyckpt.storage import stepfiles
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.resolve import remote

_storage = PosixStorage()


def path(save_dir: str, kind: str, job_id: str, rank: Optional[int] = None) -> str:
    return os.path.join(save_dir, scratch_name(kind, job_id, rank))


def files_written_by(save: Callable[[str], None], scratch: str) -> List[Tuple[str, bytes]]:
    """The files ``save(directory)`` writes (top level, sorted by name), read back from the scratch
    directory ``scratch``, which is emptied first and removed after."""
    _storage.delete(scratch)
    try:
        save(scratch)
        return [(name, _storage.read(os.path.join(scratch, name))) for name in sorted(_storage.listdir(scratch))]
    finally:
        _storage.delete(scratch)


def file_bytes(path: str) -> bytes:
    """The content of a file that ships with a framework (e.g. DeepSpeed's zero_to_fp32.py)."""
    with open(path, "rb") as f:
        return f.read()


def staged_file(directory: str, name: str, data: bytes) -> str:
    """``directory`` holding one file ``name`` with ``data`` (for a loader that reads it by path)."""
    _storage.makedirs(directory)
    _storage.write_atomic(os.path.join(directory, name), data)
    return directory


def fresh(directory: str) -> str:
    """``directory`` empty (what an earlier run left there removed)."""
    _storage.delete(directory)
    _storage.makedirs(directory)
    return directory


def remove(directory: str) -> None:
    _storage.delete(directory)


def local_copy(step_dir: str, manifest: Manifest, directory: str) -> str:
    """``step_dir`` as a local directory for a framework reader that only opens paths (Megatron's torch_dist
    reader, DCP's, DeepSpeed's, the Trainer's best-model load): the step itself on a file system; for an object
    store, every listed file downloaded into ``directory`` (checked against the manifest on the way), then the
    manifest, which the caller removes."""
    if remote(step_dir) is None:
        return step_dir
    fresh(directory)
    try:
        for rel in manifest.files:
            staged_file(os.path.dirname(os.path.join(directory, rel)), os.path.basename(rel),
                        stepfiles.read_verified(step_dir, rel, manifest))
        # the manifest last, as in a committed step: a reader that looks for it (DeepSpeed's converter) finds one
        staged_file(directory, MANIFEST_NAME, manifest.to_bytes())
    except BaseException:
        remove(directory)
        raise
    return directory


@contextlib.contextmanager
def local_step(step_dir: str, manifest: Manifest, directory: str) -> Iterator[str]:
    """local_copy for the length of a block: a downloaded copy is removed when it ends."""
    here = local_copy(step_dir, manifest, directory)
    try:
        yield here
    finally:
        if here != step_dir:
            remove(here)


@contextlib.contextmanager
def local_committed(step_dir: str, step: int, directory: str) -> Iterator[str]:
    """local_step of committed step ``step`` at ``step_dir``; CheckpointError if its manifest does not commit it."""
    manifest = stepfiles.committed(step_dir, step)
    if manifest is None:
        raise CheckpointError(f"{step_dir}: no committed step {step} there (its manifest is missing or invalid)")
    with local_step(step_dir, manifest, directory) as here:
        yield here
