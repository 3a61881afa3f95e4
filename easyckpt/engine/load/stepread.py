"""Read and check what one rank needs of a committed step (newest.py's step 4): each file or item against the
manifest, a whole file's ranged GETs from an object store fetched ahead, the decoded trees returned, or the
verdict on the first problem. Its own module because choosing the step (newest.py, agree.py) is another job.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from easyckpt.engine.load import torchparts
from easyckpt.engine.load.reads import Fetched, Needed, Read, reads
from easyckpt.engine.shards import codecs
from easyckpt.errors import ManifestError
from easyckpt.formats import manifest as mf
from easyckpt.formats import verdicts
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.formats.verdicts import Verdict
from easyckpt.progress import Progress
from easyckpt.storage import stepfiles
from easyckpt.storage.resolve import storage_for

# (relpath, optional): an optional file may be absent (e.g. the RNG state of a rank that did not exist
# when the checkpoint was written); (relpath, optional, [item, ...]): only those items of a file the
# manifest lists item by item (stepfiles.read_items), read and checked alone, the file itself not loaded;
# (relpath, optional, pick): a torch.save file the agent wrote, its pickle and only the tensors ``pick``
# chooses (torchparts.py; it sees the trees of the files listed before this one)


def read_step(step_dir: str, needed: Needed, progress: bool = False, listed: Optional[Manifest] = None,
              kept: Optional[Fetched] = None
              ) -> Tuple[Optional[Dict[str, Any]], Optional[Verdict], int, Optional[Manifest]]:
    """(trees, this rank's verdict, bytes read, the manifest) of committed step ``step_dir``. ``listed``: the
    step's manifest as the listing read and validated it (a committed manifest is never replaced); else it is
    read here. ``kept``: receives what the framework's reader opens next (reads.Fetched; an object store)."""
    try:
        man = listed if listed is not None else stepfiles.load(step_dir)
    except ManifestError as exc:
        return None, verdicts.corrupt(str(exc)), 0, None
    except FileNotFoundError:
        return None, verdicts.corrupt(f"{mf.MANIFEST_NAME} missing"), 0, None
    except OSError as exc:
        return None, verdicts.unreadable(f"{mf.MANIFEST_NAME} unreadable ({exc})"), 0, None
    try:
        wanted = reads(needed, man)
    except ValueError as exc:   # ConfigError, CheckpointError: the adapter cannot restore this step into this job
        return None, verdicts.incompatible(str(exc)), 0, man
    # only what this rank reads: every rank checking every rank's files would be world_size² lstats
    planted = stepfiles.owner_problem(step_dir, [w.relpath for w in wanted if w.relpath in man.files])
    if planted:
        return None, verdicts.untrusted(planted), 0, man
    # a bar on rank 0 when asked for (EASYCKPT_PROGRESS=1) or on a terminal: a large load takes minutes
    total = sum(_wanted_bytes(man, want) for want in wanted)
    with Progress(total if progress else 0, f"load {os.path.basename(step_dir)}") as bar:
        return read_files(step_dir, man, wanted, bar.update if bar.on else None, kept)


def _wanted_bytes(man: Manifest, want: Read) -> int:
    """What reading one entry of ``needed`` costs: the file, or the items picked of it (for the bar)."""
    entry = man.files.get(want.relpath)
    if entry is None:
        return 0
    if want.items is None:
        return entry.size
    items = entry.items or ()
    return sum(items[i].length for i in want.items if type(i) is int and 0 <= i < len(items))


def read_files(step_dir: str, man: Manifest, asked: Sequence[Union[Read, Sequence[Any]]],
               on_bytes: Optional[Callable[[int], None]], kept: Optional[Fetched] = None
               ) -> Tuple[Optional[Dict[str, Any]], Optional[Verdict], int, Optional[Manifest]]:
    trees: Dict[str, Any] = {}
    wanted = [Read.of(w) for w in asked]
    nbytes = 0
    with _Prefetch(step_dir, man, wanted) as ahead:
        for want in wanted:
            answer = _read_one(ahead, want, trees, on_bytes, kept)
            if isinstance(answer, Verdict):
                return None, answer, 0, man
            nbytes += answer
    return trees, None, nbytes, man


class _Prefetch:
    """On an object store, every whole file this rank reads is fetched at once, each by a thread of its own that
    hands its ranged GETs to the store's pool: the pool stays full across file boundaries and a file is decoded
    while the next ones arrive (read one after the other, the pool ran dry at the end of each). What is not
    taken (a verdict ended the read) is cancelled, or waited for and dropped. On a file system: nothing."""

    def __init__(self, step_dir: str, man: Manifest, wanted: Sequence[Read]):
        self.step_dir, self.man = step_dir, man
        self.futures: Dict[str, "Future[Tuple[memoryview, str]]"] = {}
        self.pool: Optional[ThreadPoolExecutor] = None
        whole = [w.relpath for w in wanted if w.whole and w.relpath in man.files]
        if storage_for(step_dir).local or len(whole) < 2:
            return
        self.pool = ThreadPoolExecutor(max_workers=len(whole), thread_name_prefix="easyckpt-prefetch")
        for rel in whole:
            self.futures[rel] = self.pool.submit(stepfiles.read_entry_hashed, step_dir, rel, man.algo, None,
                                                 man.files[rel].size)

    def take(self, rel: str) -> "Optional[Future[Tuple[memoryview, str]]]":
        return self.futures.pop(rel, None)

    def __enter__(self) -> "_Prefetch":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _read_one(ahead: _Prefetch, want: Read, trees: Dict[str, Any], on_bytes: Optional[Callable[[int], None]],
              kept: Optional[Fetched]) -> Union[int, Verdict]:
    """Read, check and decode one entry of ``needed`` of the step ``ahead`` reads into ``trees``: the bytes it
    took, or the verdict. What the framework's reader opens next goes to ``kept`` as well: a data file's items,
    a whole data file (DCP: its tree is nothing), a raw file (its tree is its bytes)."""
    step_dir, man = ahead.step_dir, ahead.man
    rel, optional = want.relpath, want.optional
    entry = man.files.get(rel)
    if entry is None:
        if optional:
            return 0
        # the step is whole; this job needs a file it never had (another world size or layout)
        return verdicts.incompatible(f"{rel}: needed here, and not part of this checkpoint")
    if not want.whole:
        problems = stepfiles.check_sizes(step_dir, man, [rel])   # items are read at their recorded offsets
        if problems:
            return verdicts.corrupt(problems[0])
        if want.pick is not None:   # a torch.save file: its pickle and the tensors ``pick`` chooses
            read = lambda: torchparts.read(step_dir, rel, man, want.pick, trees, on_bytes)  # noqa: E731
        else:                       # these items only: the framework's reader takes them from the file
            keep = kept.items.setdefault(rel, {}) if kept is not None else None
            read = lambda: (None,) + stepfiles.read_items(step_dir, rel, man, list(want.items or ()),  # noqa: E731
                                                          on_bytes, keep)
        got, verdict = _attempt(rel, read)
        if verdict is None:
            tree, problem, n = got
            verdict = verdicts.corrupt(problem) if problem else None
        if verdict:
            return verdict
        trees[rel] = tree
        return int(n)
    algo = man.algo
    fetched = ahead.take(rel)
    if fetched is not None:
        got, verdict = _attempt(rel, fetched.result)
        if verdict is None and on_bytes is not None:
            on_bytes(len(got[0]))
    else:
        got, verdict = _attempt(rel, lambda: stepfiles.read_entry_hashed(step_dir, rel, algo, on_bytes, entry.size))
    if verdict is None:
        buf, digest = got
        problem = mf.compare(rel, len(buf), lambda: digest, entry, algo)
        verdict = verdicts.corrupt(problem) if problem else None
    if verdict:
        return verdict
    try:
        trees[rel] = codecs.decode(buf, entry.shard_format)
    except Exception as exc:  # noqa: BLE001 - a listed file whose checksum matched and does not decode
        return verdicts.corrupt(f"{rel}: unreadable ({exc})")
    fmt = ShardFormat.parse(entry.shard_format)
    if kept is not None and fmt in (ShardFormat.DCP, ShardFormat.RAW):
        kept.files[rel] = buf if fmt is ShardFormat.DCP else trees[rel]      # (no copy held beside the tree)
    return len(buf)


def _attempt(rel: str, read: Callable[[], Any]) -> Tuple[Any, Optional[Verdict]]:
    """(what ``read`` returned, None), or (None, the verdict): a path that leaves the step or a missing
    file (corrupt: the step's own files), a file the system will not read (unreadable)."""
    try:
        return read(), None
    except ManifestError as exc:
        return None, verdicts.corrupt(str(exc))
    except FileNotFoundError:
        return None, verdicts.corrupt(f"{rel}: missing")
    except OSError as exc:
        return None, verdicts.unreadable(f"{rel}: unreadable ({exc})")
