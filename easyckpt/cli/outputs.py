"""Writing what a conversion produces: each file atomically, never over a file of the checkpoint itself;
those written inside the step directory are listed in its manifest (so ``easyckpt verify`` covers them),
marked ``derived_by`` — the only files of a step a later conversion may replace."""
from __future__ import annotations

import functools
import os
from typing import Callable, Dict, Optional, Sequence

from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import NAMINGS, Naming
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.progress import Progress
from easyckpt.storage import stepfiles
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.resolve import storage_for
from easyckpt.storage.savedir import SaveDir

ProgressFactory = Callable[[int, str], Progress]
DERIVED_BY = "easyckpt.cli.consolidate"        # the value earlier releases wrote: their outputs stay replaceable


def relpath_inside(step_dir: str, output: str) -> Optional[str]:
    if not storage_for(step_dir).local:     # an output is always local (main.py refuses one in the store)
        return None
    base, out = os.path.realpath(step_dir), os.path.realpath(output)
    return os.path.relpath(out, base) if os.path.commonpath([base, out]) == base else None


def refuse_replacing(step_dir: str, man: mf.Manifest, output: str) -> None:
    rel = relpath_inside(step_dir, output)
    if rel is None:
        return
    entry = man.files.get(rel)
    if rel == mf.MANIFEST_NAME or rel == "." or (entry is not None and entry.derived_by != DERIVED_BY):
        raise ValueError(f"{output} is a file of the checkpoint itself; refusing to replace it: choose another "
                         f"--output (the default is consolidated/ or consolidated.safetensors in the step directory)")


def bar(progress: Optional[ProgressFactory], total: int, desc: str) -> Progress:
    return progress(total, desc) if progress is not None else Progress(total, desc, force=False)


def write(step_dir: str, man: mf.Manifest, files: Dict[str, bytes], progress: Optional[ProgressFactory],
          stale: Sequence[str] = ()) -> None:
    """Each file atomically, in the order given (the last one can mark the set complete for readers), then
    the ``stale`` files deleted (an earlier output this one replaces under other names)."""
    storage = PosixStorage()      # the output may be anywhere (--output), so no SaveDir of its own
    listed: Dict[str, mf.FileEntry] = {}
    with bar(progress, sum(map(len, files.values())), "write") as b:
        for path, data in files.items():
            _write_atomically(storage, path, data, b)
            rel = relpath_inside(step_dir, path)
            if rel is not None:
                listed[rel] = mf.FileEntry(len(data), mf.checksum(data), ShardFormat.of_filename(path),
                                           derived_by=DERIVED_BY)
    dropped = [rel for rel in map(functools.partial(relpath_inside, step_dir), stale) if rel is not None]
    if listed or dropped:
        current = stepfiles.read(step_dir)
        if current is None:
            raise ValueError(f"{step_dir} has no valid manifest")
        current = current.with_files(listed, drop=dropped)
        SaveDir(os.path.dirname(step_dir), NAMINGS.get(man.framework, Naming())).write_manifest(step_dir, current)
    for path in stale:            # after the manifest: a listed file is never missing
        storage.delete(path)


def _write_atomically(storage: PosixStorage, path: str, data: bytes, b: Progress) -> None:
    """Readers see the previous file or the complete new one (Storage.write_atomic: temp, fsync, rename)."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory; give the output a file name (e.g. {path}/model.safetensors)")
    try:
        storage.makedirs(os.path.dirname(os.path.abspath(path)))
        storage.write_atomic(path, data)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc}") from exc
    b.update(len(data))
