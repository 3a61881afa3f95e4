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
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

from easyckpt.engine.load.dcp import Wanted, data_files
from easyckpt.engine.load.reads import Fetched
from easyckpt.errors import CheckpointError
from easyckpt.formats.layout import scratch_name
from easyckpt.formats.manifest import MANIFEST_NAME, Manifest
from easyckpt.storage import stepfiles
from easyckpt.storage.base import Buffer
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.resolve import storage_for

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


def local_copy(step_dir: str, manifest: Manifest, directory: str, wanted: Optional[Wanted] = None,
               files: Optional[Callable[[str], bool]] = None,
               on_bytes: Optional[Callable[[int], None]] = None, fetched: Optional[Fetched] = None) -> str:
    """``step_dir`` as a local directory for a framework reader that only opens paths (Megatron's torch_dist
    reader, DCP's, DeepSpeed's, the Trainer's best-model load): the step itself on a file system; for an object
    store, the listed files (those ``files`` accepts: the ones the reader opens) downloaded into ``directory``,
    each checked against the manifest on the way, then the manifest, which the caller removes. With
    ``wanted``, a DCP data file the manifest lists item by item holds only the items this rank's load reads
    (ranged reads, each item checked), at their offsets, the rest a hole: each rank fetches what it needs, not
    the whole step. What the load already fetched and checked (``fetched``, reads.Fetched) is written from
    memory, not fetched again. ``on_bytes`` hears of every piece fetched."""
    if storage_for(step_dir).local:
        return step_dir
    fresh(directory)
    kept = fetched if fetched is not None else Fetched()
    try:
        for rel, entry in manifest.files.items():
            if files is not None and not files(rel):
                continue
            whole, items = kept.take(rel)
            target = os.path.join(directory, rel)
            if wanted is not None and entry.items is not None and data_files([os.path.basename(rel)]):
                picked = [i for i, item in enumerate(entry.items) if wanted(item.ident)]
                got: Dict[int, Buffer] = {} if whole is None else {
                    i: memoryview(whole)[entry.items[i].offset:entry.items[i].offset + entry.items[i].length]
                    for i in picked}
                got.update((i, items[i]) for i in picked if i in items and i not in got)
                kept.reused += sum(len(memoryview(b)) for b in got.values())
                more: Dict[int, bytearray] = {}
                problem, _ = stepfiles.read_items(step_dir, rel, manifest, [i for i in picked if i not in got],
                                                  on_bytes, keep=more)
                if problem:
                    raise CheckpointError(problem)
                got.update(more)
                _storage.makedirs(os.path.dirname(target))
                _storage.write_sparse(target, entry.size, [(entry.items[i].offset, got[i]) for i in picked])
                continue
            data = whole if whole is not None else stepfiles.read_verified(step_dir, rel, manifest)
            if whole is not None:
                kept.reused += len(memoryview(data))
            elif on_bytes is not None:
                on_bytes(len(data))
            staged_file(os.path.dirname(target), os.path.basename(rel), data)
        # the manifest last, as in a committed step: a reader that looks for it (DeepSpeed's converter) finds one
        staged_file(directory, MANIFEST_NAME, manifest.to_bytes())
    except BaseException:
        remove(directory)
        raise
    return directory


@contextlib.contextmanager
def local_step(step_dir: str, manifest: Manifest, directory: str, wanted: Optional[Wanted] = None,
               files: Optional[Callable[[str], bool]] = None, on_bytes: Optional[Callable[[int], None]] = None,
               fetched: Optional[Fetched] = None) -> Iterator[str]:
    """local_copy for the length of a block: a downloaded copy is removed when it ends."""
    here = local_copy(step_dir, manifest, directory, wanted, files, on_bytes, fetched)
    try:
        yield here
    finally:
        if here != step_dir:
            remove(here)


# what a DCP load (dtensor.py, megatron/torchdist.py) is given to open a committed step by path: called with what
# the load reads of the data files and which files its reader opens, a block that has the step as a local directory
Stage = Callable[[Wanted, Callable[[str], bool]], ContextManager[str]]


def staging(step_dir: str, manifest: Manifest, directory: str,
            report: Optional[Callable[[int, int, int], None]] = None, fetched: Optional[Fetched] = None) -> Stage:
    """A Stage over committed step ``step_dir``: the step itself on a file system, a sparse copy of what the
    load reads in ``directory`` from an object store (local_step), made first of what the loader ``fetched``;
    ``report(fetched, reused, listed)`` hears, for each copy, the bytes fetched for it, the bytes taken from
    what the loader had fetched, and the bytes of the files the reader opens."""
    kept = fetched if fetched is not None else Fetched()

    @contextlib.contextmanager
    def stage(wanted: Wanted, files: Callable[[str], bool]) -> Iterator[str]:
        count, before = [0], kept.reused

        def on_bytes(n: int) -> None:
            count[0] += n
        with local_step(step_dir, manifest, directory, wanted, files, on_bytes, kept) as here:
            if here != step_dir and report is not None:
                report(count[0], kept.reused - before, sum(e.size for rel, e in manifest.files.items() if files(rel)))
            yield here
    return stage


@contextlib.contextmanager
def local_committed(step_dir: str, step: int, directory: str) -> Iterator[str]:
    """local_step of committed step ``step`` at ``step_dir``; CheckpointError if its manifest does not commit it."""
    manifest = stepfiles.committed(step_dir, step)
    if manifest is None:
        raise CheckpointError(f"{step_dir}: no committed step {step} there (its manifest is missing or invalid)")
    with local_step(step_dir, manifest, directory) as here:
        yield here
