"""The per-step manifest: every file with its size and a fast checksum. JSON, never pickle.

The manifest is written last; a step directory without a valid manifest is not a checkpoint.
xxh3-64 is an order of magnitude faster than the disks it checks, so checksumming while persisting
costs little; zlib's crc32 is the fallback when xxhash is missing.

This module is the format only (fields, validation, checksums, comparing a file against its entry);
reading a step's manifest and the files it lists is storage/stepfiles.py's.

Trust (docs/reliability.md promise 9, rows 20 and 25): a manifest is data from disk, checked like safetensors checks its
header before anything in it is used: ``validate`` type-checks every field and every file entry and
raises ManifestError naming the field; ``check_relpath`` refuses absolute paths, ``..``, empty, ``.``,
NUL or backslash components in a listed name.
"""
from __future__ import annotations

import time
import zlib
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from easyckpt.errors import CheckpointError, ManifestError, UnsafePath
from easyckpt.formats import paths
from easyckpt.formats.shardformat import NAMES
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


def build(step: int, job_id: str, framework: str, world_size: int, files: Dict[str, Dict[str, Any]],
          extra: Optional[Dict[str, Any]] = None, job_name: Optional[str] = None) -> Dict[str, Any]:
    """``job_id`` names the job where it runs (save dir and job name, hashed); ``job_name`` (the setting,
    "" when unset) is what makes a step this job's wherever the directory is copied or moved to."""
    return {"format_version": FORMAT_VERSION, "step": step, "job_id": job_id, "framework": framework,
            "world_size": world_size, "created": time.time(), "checksum": ALGO,
            **({} if job_name is None else {"job": job_name}),
            "files": dict(sorted(files.items())), **(extra or {})}


def same_job(man: Dict[str, Any], job_id: str, job_name: Optional[str]) -> bool:
    """Whether a (validated) manifest is a step of this job. By job name where both sides know it, so that a
    copied or moved save dir stays the job's own; by job id for manifests written before names were kept."""
    if "job" in man and job_name is not None:
        job: object = man["job"]      # a str in a validated manifest
        return job == job_name
    return man.get("job_id") == job_id


def job_words(man: Dict[str, Any]) -> str:
    """How a console names the job that committed a step."""
    return (f"job_name={man['job']!r}, " if "job" in man else "") + f"job id {man.get('job_id')}"


def run_of(man: Dict[str, Any]) -> float:
    """When the run that committed this step started (its trainers' clock, recorded by the engine); 0 for
    steps committed before runs were recorded. Steps are ordered by (run, step): a new run's commits are newer
    than an older run's higher step numbers."""
    run = (man.get("info") or {}).get("run", 0)
    return float(run) if isinstance(run, (int, float)) and not isinstance(run, bool) and run >= 0 else 0.0


def order_key(step: int, man: Dict[str, Any]) -> Tuple[float, int]:
    return run_of(man), step


def newest_first(steps: Iterable[int], runs: Mapping[int, float]) -> List[int]:
    """The order the loader tries committed steps in, and so the one ``easyckpt ls`` names as its pick:
    newest commit first, by run then step (order_key); a step with no run recorded (a framework's own
    checkpoint, or one committed before runs were recorded) counts as run 0."""
    return sorted(set(steps), key=lambda s: (runs.get(s, 0.0), s), reverse=True)


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


def validate(data: Any) -> Dict[str, Any]:
    """``data`` (a parsed manifest) if every field has its type and range; ManifestError naming the first
    field that does not. Unknown top-level fields (``created``, ``info``, ...) and unknown entry fields
    (``derived_by``) are allowed: newer writers may add some."""
    if not isinstance(data, dict):
        raise ManifestError(f"not a JSON object but {type(data).__name__}")

    def need(key: str, ok: Callable[[Any], bool], what: str) -> Any:
        if key not in data:
            raise ManifestError(f"field {key!r} is missing")
        value = data[key]
        if not ok(value):
            raise ManifestError(f"field {key!r} is {value!r}, expected {what}")
        return value

    need("format_version", lambda v: _is_int(v) and 1 <= v <= FORMAT_VERSION,
         f"an integer from 1 to {FORMAT_VERSION} (this easyckpt reads those)")
    need("step", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    need("job_id", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    need("framework", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    need("world_size", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    need("checksum", lambda v: v in ALGOS, f"one of {', '.join(ALGOS)}")
    files = need("files", lambda v: isinstance(v, dict), "an object of file name -> entry")
    if "created" in data and not (isinstance(data["created"], (int, float)) and not isinstance(data["created"], bool)):
        raise ManifestError(f"field 'created' is {data['created']!r}, expected a number")
    if "job" in data and not isinstance(data["job"], str):
        raise ManifestError(f"field 'job' is {data['job']!r}, expected a string (the job's name)")
    if "info" in data and not isinstance(data["info"], dict):
        raise ManifestError(f"field 'info' is {data['info']!r}, expected an object")
    check_files(files)
    return data


def check_files(files: Dict[str, Any]) -> None:
    """A manifest's (or a rank's marker's) ``files``: each a safe relative path with its size, checksum and
    format; ManifestError names the first bad one."""
    for rel, entry in files.items():
        try:
            check_relpath(rel)
        except ManifestError as exc:
            raise ManifestError(f"files: {exc}") from None
        where = f"files[{rel!r}]"
        if not isinstance(entry, dict):
            raise ManifestError(f"{where} is {entry!r}, expected an object with size and checksum")
        if "size" not in entry:
            raise ManifestError(f"{where}.size is missing")
        if not (_is_int(entry["size"]) and entry["size"] >= 0):
            raise ManifestError(f"{where}.size is {entry['size']!r}, expected an integer >= 0")
        if "checksum" not in entry:
            raise ManifestError(f"{where}.checksum is missing")
        if not (isinstance(entry["checksum"], str) and entry["checksum"]):
            raise ManifestError(f"{where}.checksum is {entry['checksum']!r}, expected a non-empty string")
        if "format" in entry and entry["format"] not in NAMES:
            raise ManifestError(f"{where}.format is {entry['format']!r}, expected one of {', '.join(NAMES)}")


def check_bytes(rel: str, data: _Data, manifest: Dict[str, Any]) -> Optional[str]:
    algo = manifest.get("checksum", ALGO)
    return compare(rel, len(data), lambda: checksum(data, algo), manifest["files"][rel], algo)


def size_problem(rel: str, size: int, recorded: int) -> Optional[str]:
    if size == recorded:
        return None
    diff = recorded - size
    how = (f"{size_and_bytes(diff)} short (truncated?)" if diff > 0
           else f"{size_and_bytes(-diff)} too long (appended to?)")
    return f"{rel}: size {size_and_bytes(size)} on disk, the manifest records {size_and_bytes(recorded)}: {how}"


def compare(rel: str, size: int, digest: Callable[[], str], entry: Dict[str, Any], algo: str = ALGO
             ) -> Optional[str]:
    """The problem of a file of ``size`` bytes against its manifest entry (the digest only when the size
    is right), or None."""
    problem = size_problem(rel, size, entry["size"])
    if problem:
        return problem
    got = digest()
    if got != entry["checksum"]:
        return (f"{rel}: checksum {got} on disk, the manifest records {entry['checksum']} ({algo}; the size, "
                f"{size_and_bytes(size)}, matches: corrupted)")
    return None


def check_items(rel: str, entry: Dict[str, Any]) -> List[List[Any]]:
    """A data file's ``items`` (distcp: [offset, length, checksum, id], written by the agent): in file order,
    apart, inside the file, each id [name, offsets, sizes] or [name, None, None]; ManifestError if not."""
    from easyckpt.formats.slotmeta import item_id_ok

    items, end = entry.get("items"), 0
    if not isinstance(items, list):
        raise ManifestError(f"files[{rel!r}].items is not a list")
    for n, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 4 and _is_int(item[0]) and _is_int(item[1])
                and item[0] >= end and item[1] >= 0 and isinstance(item[2], str)
                and (item[3] is None or item_id_ok(item[3]))):
            raise ManifestError(f"files[{rel!r}].items[{n}] is not [offset, length, checksum, id] after the "
                                f"previous item")
        end = item[0] + item[1]
    if end > entry["size"]:
        raise ManifestError(f"files[{rel!r}].items end at byte {end}, past the file's {entry['size']}")
    return items
