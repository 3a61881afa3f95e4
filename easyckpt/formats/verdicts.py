"""What the loader may conclude about a committed step, as typed values (docs/reliability.md promise 12).

    CORRUPT        the step's own bytes fail: a checksum, a size, a listed file missing, a manifest or a
                   file that does not decode. Only this marks a step damaged (retention may then remove it
                   once a newer verified step exists).
    INCOMPATIBLE   this job cannot restore it here: another layout or world size, another model, another
                   framework, another job. The step is fine; it is kept, never marked, never pruned for it.
    UNREADABLE     the file system refused (permission, I/O error): maybe passing, maybe a disk to replace;
                   not a judgement on the step's bytes, so it is not marked either.
    UNTRUSTED      a file of the step (or the step directory) belongs to another user or is writable by
                   others: it may have been planted or re-sealed. Refused, never marked, never deleted.

Verdicts cross ranks as these objects (one all_gather), never as joined strings; ``combine`` turns the
ranks' verdicts on one step into the step's: corrupt on any rank makes the step corrupt.
Torch-free and I/O-free: the loader, the agent's messages and the operator tools share it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence


class Kind(str, enum.Enum):
    CORRUPT = "corrupt"
    INCOMPATIBLE = "incompatible"
    UNREADABLE = "unreadable"
    UNTRUSTED = "untrusted"


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    reason: str
    step: Optional[int] = None
    path: Optional[str] = None
    ranks: Sequence[int] = ()

    @property
    def corrupt(self) -> bool:
        return self.kind is Kind.CORRUPT

    def words(self) -> str:
        """One line for a console or an error: the step, the verdict and why."""
        who = "" if not self.ranks else f" (rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))})"
        where = f" {self.path}" if self.path else ""
        return f"step {self.step}{where}: {self.kind.value}{who}: {self.reason}"


def corrupt(reason: str) -> Verdict:
    return Verdict(Kind.CORRUPT, reason)


def incompatible(reason: str) -> Verdict:
    return Verdict(Kind.INCOMPATIBLE, reason)


def unreadable(reason: str) -> Verdict:
    return Verdict(Kind.UNREADABLE, reason)


def untrusted(reason: str) -> Verdict:
    return Verdict(Kind.UNTRUSTED, reason)


def combine(step: int, path: Optional[str], per_rank: Sequence[Optional[Verdict]]) -> Optional[Verdict]:
    """The step's verdict from every rank's (None: that rank restored it): None when every rank could; else
    the gravest kind any rank found (corrupt, untrusted, unreadable, incompatible), with every rank's reason."""
    bad = [(r, v) for r, v in enumerate(per_rank) if v is not None]
    if not bad:
        return None
    order = [Kind.CORRUPT, Kind.UNTRUSTED, Kind.UNREADABLE, Kind.INCOMPATIBLE]
    kind = min((v.kind for _, v in bad), key=order.index)
    reasons: List[str] = []
    for r, v in bad:
        line = v.reason if len(per_rank) == 1 else f"rank {r}: {v.reason}"
        if v.kind is kind and line not in reasons:
            reasons.append(line)
    return Verdict(kind, "; ".join(reasons), step, path, tuple(r for r, v in bad if v.kind is kind))
