"""The per-step manifest: every file with its size and a fast checksum. JSON, never pickle.

The manifest is written last; a step directory without a valid manifest is not a checkpoint.
xxh3-64 runs at ~25 GB/s here (the disk writes at ~1.5 GB/s), so checksumming while persisting
costs nothing noticeable; zlib's crc32 is the fallback when xxhash is missing.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    xxhash = None

MANIFEST_NAME = "easyckpt_manifest.json"
FORMAT_VERSION = 1
ALGO = "xxh3_64" if xxhash is not None else "crc32"


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
            raise ValueError(f"unknown checksum algorithm {algo!r}")

    def update(self, data) -> None:
        if self.algo == "xxh3_64":
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self.algo == "xxh3_64" else f"{self._crc:08x}"


def checksum(data, algo: str = ALGO) -> str:
    h = Hasher(algo)
    h.update(data)
    return h.hexdigest()


def build(step: int, job_id: str, framework: str, world_size: int, files: Dict[str, Dict[str, Any]],
          extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "step": step, "job_id": job_id, "framework": framework,
            "world_size": world_size, "created": time.time(), "checksum": ALGO,
            "files": dict(sorted(files.items())), **(extra or {})}


def read(step_dir: str) -> Optional[Dict[str, Any]]:
    """The manifest of ``step_dir``, or None when it is missing or unreadable (not a checkpoint)."""
    try:
        with open(os.path.join(step_dir, MANIFEST_NAME), "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or "step" not in data:
        return None
    return data


def check_sizes(step_dir: str, manifest: Dict[str, Any], relpaths: Optional[Iterable[str]] = None) -> List[str]:
    """Cheap check: every listed file exists with its recorded size. Returns the problems found."""
    problems = []
    for rel in (manifest["files"] if relpaths is None else relpaths):
        entry = manifest["files"].get(rel)
        if entry is None:
            problems.append(f"{rel}: not in the manifest")
            continue
        try:
            size = os.path.getsize(os.path.join(step_dir, rel))
        except OSError:
            problems.append(f"{rel}: missing")
            continue
        if size != entry["size"]:
            problems.append(f"{rel}: size {size} != {entry['size']} in the manifest (truncated?)")
    return problems


def read_verified(step_dir: str, rel: str, manifest: Dict[str, Any]) -> bytes:
    """The bytes of one listed file, after checking its size and checksum; ValueError if damaged."""
    with open(os.path.join(step_dir, rel), "rb") as f:
        data = f.read()
    problem = check_bytes(rel, data, manifest)
    if problem:
        raise ValueError(problem)
    return data


def verify_file(step_dir: str, rel: str, manifest: Dict[str, Any],
                on_bytes: Optional[Callable[[int], None]] = None, chunk: int = 16 << 20) -> Optional[str]:
    """Size and checksum of one listed file, read in chunks (memory stays flat for large shards);
    the problem found, or None. ``on_bytes`` hears of every chunk (a progress bar)."""
    entry = manifest["files"][rel]
    path = os.path.join(step_dir, rel)
    h = Hasher(manifest.get("checksum", ALGO))
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while True:
                data = f.read(chunk)
                if not data:
                    break
                h.update(data)
                size += len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
    except FileNotFoundError:
        return f"{rel}: missing"
    except OSError as exc:
        return f"{rel}: unreadable ({exc.strerror})"
    return _compare(rel, size, h.hexdigest, entry)


def check_bytes(rel: str, data, manifest: Dict[str, Any]) -> Optional[str]:
    return _compare(rel, len(data), lambda: checksum(data, manifest.get("checksum", ALGO)), manifest["files"][rel])


def _compare(rel: str, size: int, digest: Callable[[], str], entry: Dict[str, Any]) -> Optional[str]:
    """The problem of a file of ``size`` bytes against its manifest entry (the digest only when the size
    is right), or None."""
    if size != entry["size"]:
        return f"{rel}: size {size} != {entry['size']} in the manifest (truncated?)"
    got = digest()
    if got != entry["checksum"]:
        return f"{rel}: checksum {got} != {entry['checksum']} in the manifest (corrupted)"
    return None
