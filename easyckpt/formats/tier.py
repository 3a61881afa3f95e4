"""The local tier's names and records: a rank's snapshot written to this node's disk (agent/localtier.py writes
it, storage/tierfiles.py lists, checks and prunes it, the loader reads it back as it reads a slot).

A tier copy is the rank's whole slot file (header, tensors, metadata: ipc/shm.py's layout) under the job's tier
directory ``.easyckpt-local-<job id>`` in node_dir, as ``s<step>-r<rank>.slot``, and beside it its record
``s<step>-r<rank>.json``: this module's TierRecord, written last (atomically), with the copy's size and checksum.
A copy without its record is unfinished and never read. The record is input like any file (node_dir may be
shared): parsed whole, every field checked, and a record of another job, step or rank than its name says is
refused.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional, Tuple

from easyckpt.errors import ManifestError
from easyckpt.formats.manifest import ALGOS

TIER_PREFIX = ".easyckpt-local-"
MAX_RECORD_BYTES = 4096
_NAME = re.compile(r"s(\d{12})-r(\d{5})\.(slot|json)")
_JOB = re.compile(r"[0-9a-f]{12}")


def dir_name(job_id: str) -> str:
    """The job's tier directory in node_dir (named after the job: two jobs on one node never share one)."""
    if not _JOB.fullmatch(job_id):
        raise ValueError(f"not a job id: {job_id!r}")
    return f"{TIER_PREFIX}{job_id}"


def copy_name(step: int, rank: int) -> str:
    return f"s{step:012d}-r{rank:05d}.slot"


def record_name(step: int, rank: int) -> str:
    return f"s{step:012d}-r{rank:05d}.json"


def parse_name(name: str) -> Optional[Tuple[int, int, str]]:
    """(step, rank, "slot" or "json") of a tier file name of ours, else None."""
    m = _NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


@dataclasses.dataclass(frozen=True)
class TierRecord:
    job_id: str
    step: int
    rank: int
    world_size: int
    layout: str          # the adapter's parallel layout when the snapshot was taken ("" when it has none)
    size: int            # bytes of the copy
    checksum: str
    algo: str

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, job_id: str, step: int, rank: int) -> "TierRecord":
        """The record these bytes hold, for the copy its file name says (``job_id``, ``step``, ``rank``);
        ManifestError (a ValueError) names what is wrong."""
        if len(data) > MAX_RECORD_BYTES:
            raise ManifestError(f"a local tier record of {len(data)} bytes (at most {MAX_RECORD_BYTES})")
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ManifestError("a local tier record that is not JSON") from None
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(obj, dict) or sorted(obj) != sorted(names):
            raise ManifestError(f"a local tier record without exactly the fields {names}")
        for key in ("step", "rank", "world_size", "size"):
            value = obj[key]
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ManifestError(f"a local tier record's {key} is {str(value)[:40]!r}, expected an integer >= 0")
        for key in ("job_id", "layout", "checksum", "algo"):
            if not isinstance(obj[key], str) or len(obj[key]) > 256:
                raise ManifestError(f"a local tier record's {key} is not a short string")
        if obj["algo"] not in ALGOS:
            raise ManifestError(f"a local tier record's checksum algorithm {obj['algo']!r} is unknown")
        record = cls(**obj)
        if (record.job_id, record.step, record.rank) != (job_id, step, rank):
            raise ManifestError(f"a local tier record of job {record.job_id} step {record.step} rank {record.rank} "
                                f"under the name of job {job_id} step {step} rank {rank}")
        if record.rank >= record.world_size:
            raise ManifestError(f"a local tier record of rank {record.rank} in a world of {record.world_size}")
        return record
