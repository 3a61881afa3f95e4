"""The per-step manifest: every file with its size and a fast checksum. JSON, never pickle.

The manifest is written last; a step directory without a valid manifest is not a checkpoint.
xxh3-64 is an order of magnitude faster than the disks it checks, so checksumming while persisting
costs little; zlib's crc32 is the fallback when xxhash is missing.

This module is the format only (fields, validation, checksums, comparing a file against its entry);
reading a step's manifest and the files it lists is storage/stepfiles.py's.

The records: ``Manifest`` (a committed step's, or the inventory engine/load/adopt.py makes of a framework's
own step), ``FileEntry`` (one listed file) and ``Item`` (a part of a data file a rank may read alone).
They are frozen and built from JSON in one place, ``Manifest.parse``; every reader uses their fields.

Trust (docs/reliability.md promise 9, rows 20 and 25): a manifest is data from disk, checked like
safetensors checks its header before anything in it is used: ``Manifest.parse`` type-checks every field,
every file entry and every item list, and raises ManifestError naming the field; ``check_relpath``
refuses absolute paths, ``..``, empty, ``.``, NUL or backslash components in a listed name.
"""
from __future__ import annotations

import dataclasses
import json
import time
import zlib
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Set,
    Tuple,
    Union,
)

from easyckpt.errors import CheckpointError, ManifestError, UnsafePath
from easyckpt.formats import paths
from easyckpt.formats.shardformat import DEFAULT, NAMES, ShardFormat
from easyckpt.units import size_and_bytes

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    xxhash = None  # type: ignore[assignment]  # an optional import: checked for None below

MANIFEST_NAME = "easyckpt_manifest.json"
FORMAT_VERSION = 1
ALGO = "xxh3_64" if xxhash is not None else "crc32"
ALGOS = ("xxh3_64", "crc32")
MAX_MANIFEST_BYTES = 256 << 20        # a manifest lists files, it is never this large

_Data = Union[bytes, bytearray, memoryview]   # what a checksum reads (storage.base.Buffer)
_ENTRY_FIELDS = frozenset({"size", "checksum", "format", "items", "derived_by"})
_MANIFEST_FIELDS = frozenset({"format_version", "step", "job_id", "framework", "world_size", "checksum", "files",
                              "created", "job", "info", "adopted", "run_seq"})


class Hasher:
    def __init__(self, algo: str = ALGO):
        self.algo = algo
        if algo == "xxh3_64":
            if xxhash is None:
                raise RuntimeError("this checkpoint uses xxh3_64 checksums: pip install xxhash")
            self._h = xxhash.xxh3_64()
        elif algo == "crc32":
            self._crc = 0
        else:
            raise CheckpointError(f"unknown checksum algorithm {algo!r}")

    def update(self, data: _Data) -> None:
        if self.algo == "xxh3_64":
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self.algo == "xxh3_64" else f"{self._crc:08x}"


def checksum(data: _Data, algo: str = ALGO) -> str:
    h = Hasher(algo)
    h.update(data)
    return h.hexdigest()


class Item(NamedTuple):
    """One item of a data file (distcp, torch; written by the agent): where it lies and its checksum, so a
    rank reads and checks only the items it needs (storage/stepfiles.read_items)."""
    offset: int
    length: int
    checksum: str
    ident: Optional[List[Any]]   # [name, offsets, sizes] of a tensor chunk, [name, None, None] of an object


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A listed file. ``checksum`` is None only in an adopted inventory (a framework's own files carry none);
    ``format`` None in manifests written before formats were recorded (they are DEFAULT's)."""
    size: int
    checksum: Optional[str] = None
    format: Optional[ShardFormat] = None
    items: Optional[Tuple[Item, ...]] = None
    derived_by: Optional[str] = None        # the converter that added it to a committed step (cli/outputs.py)
    # fields a newer writer added: kept when the manifest is rewritten
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def shard_format(self) -> ShardFormat:
        return self.format or DEFAULT

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {**self.extra, "size": self.size}
        if self.checksum is not None:
            out["checksum"] = self.checksum
        if self.format is not None:
            out["format"] = self.format.value
        if self.items is not None:
            out["items"] = [list(item) for item in self.items]
        if self.derived_by is not None:
            out["derived_by"] = self.derived_by
        return out

    @classmethod
    def parse(cls, rel: str, entry: Any) -> FileEntry:
        """The entry of listed file ``rel`` (a manifest's or a done-marker's); ManifestError names the field."""
        where = f"files[{rel!r}]"
        if not isinstance(entry, dict):
            raise ManifestError(f"{where} is {entry!r}, expected an object with size and checksum")
        if "size" not in entry:
            raise ManifestError(f"{where}.size is missing")
        size = entry["size"]
        if not (_is_int(size) and size >= 0):
            raise ManifestError(f"{where}.size is {size!r}, expected an integer >= 0")
        if "checksum" not in entry:
            raise ManifestError(f"{where}.checksum is missing")
        digest = entry["checksum"]
        if not (isinstance(digest, str) and digest):
            raise ManifestError(f"{where}.checksum is {digest!r}, expected a non-empty string")
        fmt = None
        if "format" in entry:
            try:
                fmt = ShardFormat.parse(entry["format"])
            except ValueError:
                raise ManifestError(f"{where}.format is {entry['format']!r}, expected one of {', '.join(NAMES)}"
                                    ) from None
        derived = entry.get("derived_by")
        if derived is not None and not isinstance(derived, str):
            raise ManifestError(f"{where}.derived_by is {derived!r}, expected a string")
        items = _parse_items(rel, entry["items"], size) if "items" in entry else None
        extra = {k: v for k, v in entry.items() if k not in _ENTRY_FIELDS}
        return cls(size, digest, fmt, items, derived, extra)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A step's manifest, checked whole when parsed (``parse``), or the inventory engine/load/adopt.py builds of a
    framework's own step (``adopted``: no job, no world size, no checksums)."""
    step: int
    framework: str
    files: Mapping[str, FileEntry]
    job_id: str = ""
    world_size: Optional[int] = None
    checksum: Optional[str] = ALGO           # the algorithm of every entry's checksum
    created: float = 0.0
    job: Optional[str] = None                # the job's name (the setting), where one was given
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # what the adapters recorded (layout, run...)
    adopted: bool = False
    format_version: int = FORMAT_VERSION
    # the number of the run that committed it, decided by the commit under the job's lock (storage/savedir.py SaveDir.run_seq);
    # 0: committed before runs were numbered (its order is then its "run" stamp's, see run_key)
    run_seq: int = 0
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # fields a newer writer added: kept

    @property
    def algo(self) -> str:
        return self.checksum or ALGO

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.files.values())

    @property
    def run(self) -> float:
        """When the run that committed this step started, by its rank 0's wall clock (recorded by the engine; 0
        for steps committed before runs were recorded): a time for people to read, and the order of the steps
        committed before runs were numbered (run_seq 0), never of the others."""
        run = self.info.get("run", 0)
        return float(run) if isinstance(run, (int, float)) and not isinstance(run, bool) and run >= 0 else 0.0

    @property
    def run_id(self) -> Optional[str]:
        """The identity of the engine run that committed this step (a random token its rank 0 drew at start),
        or None (written before runs carried one)."""
        value = self.info.get("run_id")
        return value if isinstance(value, str) and value else None

    @property
    def run_key(self) -> Tuple[int, float]:
        """What orders this job's runs: the run number (run_seq), then, for steps committed before runs were
        numbered (run_seq 0, all older than every numbered run: easyckpt is upgraded forward), their start
        stamp as before. Steps are ordered by (run_key, step), so a run that started later is later whatever
        the clocks said, and its commits are newer than an older run's higher step numbers."""
        return (self.run_seq, self.run if self.run_seq == 0 else 0.0)

    @property
    def layout(self) -> Optional[str]:
        """The parallel layout the adapter recorded (e.g. Megatron's "tp2 pp1 ..."), or None."""
        value = self.info.get("layout")
        return value if isinstance(value, str) else None

    @property
    def protect(self) -> Set[int]:
        """The steps the adapter asked retention to keep beside this one (the Trainer's best model)."""
        value = self.info.get("protect", [])
        return {s for s in value if _is_int(s)} if isinstance(value, list) else set()

    def entry(self, rel: str) -> FileEntry:
        """The entry of listed file ``rel``; CheckpointError when the manifest does not list it."""
        try:
            return self.files[rel]
        except KeyError:
            raise CheckpointError(f"{rel}: not in the manifest; refusing to read a file that is not part of "
                                  f"the checkpoint") from None

    def with_files(self, entries: Mapping[str, FileEntry], drop: Iterable[str] = ()) -> Manifest:
        """This manifest with ``entries`` added (or replaced) and ``drop`` no longer listed: a converter's
        outputs in a committed step."""
        gone = set(drop)
        files = {rel: e for rel, e in self.files.items() if rel not in gone}
        files.update(entries)
        return dataclasses.replace(self, files=dict(sorted(files.items())))

    def same_job(self, job_id: str, job_name: Optional[str]) -> bool:
        """Whether this step is this job's. By job name where both sides know it, so that a copied or moved
        save dir stays the job's own; by job id for manifests written before names were kept."""
        if self.job is not None and job_name is not None:
            return self.job == job_name
        return self.job_id == job_id

    def job_words(self) -> str:
        """How a console names the job that committed the step."""
        return (f"job_name={self.job!r}, " if self.job is not None else "") + f"job id {self.job_id}"

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {**self.extra, "format_version": self.format_version, "step": self.step,
                               "job_id": self.job_id, "framework": self.framework,
                               "world_size": self.world_size, "created": self.created,
                               "checksum": self.checksum}
        if self.job is not None:
            out["job"] = self.job
        out["files"] = {rel: e.to_json() for rel, e in sorted(self.files.items())}
        out["info"] = dict(self.info)
        if self.adopted:
            out["adopted"] = True
        if self.run_seq:
            out["run_seq"] = self.run_seq
        return out

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode()

    @classmethod
    def parse(cls, data: Any) -> Manifest:
        """The manifest a parsed JSON value holds, if every field has its type and range; ManifestError naming
        the first field that does not. Unknown top-level fields and unknown entry fields are kept: newer
        writers may add some."""
        return _parse(data)


def build(step: int, job_id: str, framework: str, world_size: int, files: Mapping[str, FileEntry],
          info: Optional[Mapping[str, Any]] = None, job_name: Optional[str] = None, run_seq: int = 0) -> Manifest:
    """``job_id`` names the job where it runs (save dir and job name, hashed); ``job_name`` (the setting,
    "" when unset) is what makes a step this job's wherever the directory is copied or moved to; ``run_seq``
    the committing run's number (Manifest.run_seq)."""
    return Manifest(step=step, framework=framework, files=dict(sorted(files.items())), job_id=job_id,
                    world_size=world_size, checksum=ALGO, created=time.time(), job=job_name,
                    info=dict(info or {}), run_seq=run_seq)


RunKey = Tuple[int, float]      # Manifest.run_key


def newest_first(steps: Iterable[int], runs: Mapping[int, RunKey]) -> List[int]:
    """The order the loader tries committed steps in, and so the one ``easyckpt ls`` names as its pick:
    newest commit first, by run then step (Manifest.run_key); a step with no run recorded (a framework's own
    checkpoint, or one committed before runs were recorded) counts as run (0, 0.0)."""
    return sorted(set(steps), key=lambda s: (runs.get(s, (0, 0.0)), s), reverse=True)


# ---- validation ---------------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_relpath(rel: Any) -> str:
    """``rel`` as a manifest may name a file (paths.check_relpath); ManifestError otherwise (the path
    could name a file outside the step)."""
    try:
        return paths.check_relpath(rel)
    except UnsafePath as exc:
        raise ManifestError(f"{exc}; a manifest lists plain paths inside its step directory") from None


def validate(data: Any) -> Manifest:
    """``data`` (a parsed manifest) as a Manifest; ManifestError naming the first bad field."""
    return Manifest.parse(data)


def _parse(data: Any) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"not a JSON object but {type(data).__name__}")

    def need(key: str, ok: Callable[[Any], bool], what: str) -> Any:
        if key not in data:
            raise ManifestError(f"field {key!r} is missing")
        value = data[key]
        if not ok(value):
            raise ManifestError(f"field {key!r} is {value!r}, expected {what}")
        return value

    version = need("format_version", lambda v: _is_int(v) and 1 <= v <= FORMAT_VERSION,
                   f"an integer from 1 to {FORMAT_VERSION} (this easyckpt reads those)")
    step = need("step", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    job_id = need("job_id", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    framework = need("framework", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    world_size = need("world_size", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    algo = need("checksum", lambda v: v in ALGOS, f"one of {', '.join(ALGOS)}")
    files = need("files", lambda v: isinstance(v, dict), "an object of file name -> entry")
    created = data.get("created", 0.0)
    if not (isinstance(created, (int, float)) and not isinstance(created, bool)):
        raise ManifestError(f"field 'created' is {created!r}, expected a number")
    job = data.get("job")
    if "job" in data and not isinstance(job, str):
        raise ManifestError(f"field 'job' is {job!r}, expected a string (the job's name)")
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise ManifestError(f"field 'info' is {info!r}, expected an object")
    # optional, so format_version stays 1: an older reader keeps it as an unknown field and orders by "run"
    run_seq = data.get("run_seq", 0)
    if not (_is_int(run_seq) and run_seq >= 0):
        raise ManifestError(f"field 'run_seq' is {run_seq!r}, expected an integer >= 0 (the run's number)")
    extra = {k: v for k, v in data.items() if k not in _MANIFEST_FIELDS}
    return Manifest(step=step, framework=framework, files=parse_files(files), job_id=job_id,
                    world_size=world_size, checksum=algo, created=float(created), job=job, info=info,
                    format_version=version, extra=extra, run_seq=run_seq)


def parse_files(files: Dict[str, Any]) -> Dict[str, FileEntry]:
    """A manifest's (or a rank's marker's) ``files``: each a safe relative path with its size, checksum and
    format; ManifestError names the first bad one."""
    out: Dict[str, FileEntry] = {}
    for rel, entry in files.items():
        try:
            check_relpath(rel)
        except ManifestError as exc:
            raise ManifestError(f"files: {exc}") from None
        out[rel] = FileEntry.parse(rel, entry)
    return out


def _parse_items(rel: str, items: Any, size: int) -> Tuple[Item, ...]:
    """A data file's ``items``: in file order, apart, inside the file, each id [name, offsets, sizes] or
    [name, None, None]; ManifestError if not."""
    from easyckpt.formats.slotmeta import item_id_ok

    if not isinstance(items, list):
        raise ManifestError(f"files[{rel!r}].items is not a list")
    out, end = [], 0
    for n, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 4 and _is_int(item[0]) and _is_int(item[1])
                and item[0] >= end and item[1] >= 0 and isinstance(item[2], str)
                and (item[3] is None or item_id_ok(item[3]))):
            raise ManifestError(f"files[{rel!r}].items[{n}] is not [offset, length, checksum, id] after the "
                                f"previous item")
        end = item[0] + item[1]
        out.append(Item(item[0], item[1], item[2], item[3]))
    if end > size:
        raise ManifestError(f"files[{rel!r}].items end at byte {end}, past the file's {size}")
    return tuple(out)


def size_problem(rel: str, size: int, recorded: int) -> Optional[str]:
    if size == recorded:
        return None
    diff = recorded - size
    how = (f"{size_and_bytes(diff)} short (truncated?)" if diff > 0
           else f"{size_and_bytes(-diff)} too long (appended to?)")
    return f"{rel}: size {size_and_bytes(size)} on disk, the manifest records {size_and_bytes(recorded)}: {how}"


def require_size(rel: str, size: int, recorded: Optional[int]) -> None:
    """ManifestError when a file reported as ``size`` bytes is not the ``recorded`` size (None: nothing to
    compare with): said before a buffer is allocated for it, as the reported size is not to be trusted with memory."""
    problem = None if recorded is None else size_problem(rel, size, recorded)
    if problem:
        raise ManifestError(problem)


def compare(rel: str, size: int, digest: Callable[[], str], entry: FileEntry, algo: str = ALGO) -> Optional[str]:
    """The problem of a file of ``size`` bytes against its manifest entry (the digest only when the size
    is right), or None."""
    problem = size_problem(rel, size, entry.size)
    if problem:
        return problem
    got = digest()
    if got != entry.checksum:
        return (f"{rel}: checksum {got} on disk, the manifest records {entry.checksum} ({algo}; the size, "
                f"{size_and_bytes(size)}, matches: corrupted)")
    return None
