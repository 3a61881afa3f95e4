"""What ``easyckpt report`` draws (report.py), built from the checked events of an audit log (auditread.py): the
stall of each snapshot step, the skipped snapshots, each persist and commit, and the events worth a label.

A run begins at each rank-0 ``load`` event (every start loads, or says it found nothing), so the steps a resume
does again are drawn again, as the new run's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from easyckpt.cli import auditread

LOAD_SOURCES = ("none", "memory", "peer", "local", "storage")


@dataclass
class Mark:
    step: int
    kind: str          # start, resume, sigterm, lost, error
    label: str


@dataclass
class Timeline:
    """What the report draws; every figure comes from one checked line of the audit log."""

    log: str
    stalls: List[Tuple[int, int, float]] = field(default_factory=list)      # run, step, ms (slowest rank)
    skips: List[Tuple[int, int]] = field(default_factory=list)              # run, step
    persists: List[Tuple[int, float]] = field(default_factory=list)         # step, ms (slowest rank)
    commits: List[Tuple[int, float]] = field(default_factory=list)          # step, ms
    marks: List[Mark] = field(default_factory=list)
    runs: List[str] = field(default_factory=list)                           # how each run began
    skipped_lines: int = 0
    why_skipped: List[str] = field(default_factory=list)

    def steps(self) -> Tuple[int, int]:
        every = [s for _, s, _ in self.stalls] + [s for _, s in self.skips] + [s for s, _ in self.persists] + \
            [s for s, _ in self.commits] + [m.step for m in self.marks]
        return (min(every), max(every)) if every else (0, 1)


def build(read: auditread.AuditRead) -> Timeline:
    """The timeline of the checked events, in the log's order."""
    tl = Timeline(read.path, skipped_lines=read.skipped, why_skipped=list(read.why))
    stall: Dict[Tuple[int, int], float] = {}
    persist: Dict[int, float] = {}
    run, last_step = -1, 0
    for e in read.events:
        if e.step is not None and e.event in ("snapshot", "skip", "persist", "commit", "sigterm_save"):
            last_step = e.step
        if e.event == "load" and e.rank in (0, None) and e.source in LOAD_SOURCES:
            run += 1
            start = e.step or 0
            said = f"resumed step {start} from {e.source}" if e.source != "none" else "start (no checkpoint)"
            tl.runs.append(said)
            tl.marks.append(Mark(start, "resume" if e.source != "none" else "start", said))
            last_step = start
        elif e.event == "snapshot" and e.step is not None and e.seconds is not None:
            key = (max(run, 0), e.step)
            stall[key] = max(stall.get(key, 0.0), 1e3 * e.seconds)
        elif e.event == "skip" and e.step is not None:
            tl.skips.append((max(run, 0), e.step))
        elif e.event == "persist" and e.step is not None and e.seconds is not None:
            persist[e.step] = max(persist.get(e.step, 0.0), 1e3 * e.seconds)
        elif e.event == "commit" and e.step is not None and e.seconds is not None:
            tl.commits.append((e.step, 1e3 * e.seconds))
        elif e.event == "sigterm_save" and e.step is not None and e.rank in (0, None):
            tl.marks.append(Mark(e.step, "sigterm", f"SIGTERM save of step {e.step}"))
        elif e.event == "trainer_lost":
            who = "trainer" if e.rank is None else f"trainer rank {e.rank}"
            tl.marks.append(Mark(last_step, "lost", f"{who} lost (newest step logged: {last_step})"))
        elif e.event == "error" and e.step is not None:
            tl.marks.append(Mark(e.step, "error", f"error at step {e.step}: {e.text[:80]}"))
    if run < 0 and stall:
        tl.runs.append("the log holds no start")
    tl.stalls = [(r, s, ms) for (r, s), ms in stall.items()]
    tl.persists = sorted(persist.items())
    return tl
