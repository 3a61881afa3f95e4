"""The storage source: this job's committed steps in the save dir, each read and verified against its manifest.

The tracker file is ignored: manifests are the truth (a tracker can be stale, empty or garbage). Only this job's
committed steps are listed (SaveDir.owns: by job name, so a copied directory stays the job's own); another job's
steps are named on the console, never loaded. A step whose manifest is invalid (not JSON, a field missing or of
the wrong type, a file named outside the step) is not listed: it is logged as rejected, with the reason. Only
files the manifest lists are read, each through manifest.read_entry (inside the step, no symlink out).

Each rank's verdict on a step is a formats/verdicts.Verdict: only a CORRUPT one (the step's own bytes fail) is
reported to the agent as damaged; an INCOMPATIBLE or UNREADABLE one leaves the step as it is. When this job's
committed steps exist and none can be restored, NoValidCheckpoint lists each with its verdict (``give_up``): the
engine stops there unless ``on_no_valid_checkpoint="start_fresh"`` (docs/reliability.md promise 12).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, cast

from easyckpt import console
from easyckpt.engine.load.reads import Fetched, Needed
from easyckpt.engine.load.sources import Listing, Loaded, Ranks
from easyckpt.engine.load.stepread import read_step
from easyckpt.errors import NoValidCheckpoint
from easyckpt.formats import manifest as mf
from easyckpt.formats import verdicts
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.verdicts import Verdict
from easyckpt.storage import stepfiles
from easyckpt.storage.resolve import storage_for
from easyckpt.storage.savedir import SaveDir


class StorageSource:
    name = "storage"

    def __init__(self, ranks: Ranks, needed: Needed, on_rejected: Optional[Callable[[int, str], object]]):
        """``on_rejected(step, why)``: called on rank 0 for each committed step rejected as corrupt."""
        self.ranks, self.needed, self.on_rejected = ranks, needed, on_rejected
        sd = SaveDir.of(ranks.cfg)
        every = sd.committed_manifests()
        ours = [e for e in every if sd.owns(e[2])]
        self.paths = {s: p for s, p, _ in ours}
        self.runs = {s: man.run_key for s, _, man in ours}       # the newest-first order (mf.newest_first)
        self.known = {s: man for s, _, man in ours}      # read and validated by the listing: not read again
        self.rejected: List[Verdict] = []
        _say_other_jobs([e for e in every if not sd.owns(e[2])], ranks)
        _log_invalid_manifests(sd, {s for s, _, _ in every}, ranks)

    def steps(self) -> Listing:
        # a step another user owns or may write is tried last-resort only (stepread refuses it, naming the owner):
        # it never outranks the job's own memory or tier, or a planted step_99999990 would send every resume to
        # storage
        return {s: stepfiles.owner_problem(p) for s, p in self.paths.items()}

    def read(self, step: int) -> Optional[Loaded]:
        """The committed step ``step``, verified on every rank; None when some rank's verdict rejects it (said, and
        a corrupt one reported through ``on_rejected``)."""
        ranks, path = self.ranks, self.paths[step]
        t0 = time.perf_counter()
        kept = None if storage_for(path).local else Fetched()
        trees, mine, nbytes, man = read_step(path, self.needed, progress=ranks.rank == 0, listed=self.known.get(step),
                                             kept=kept)
        verdict = verdicts.combine(step, path, ranks.gather(mine))
        if verdict is None:
            # no verdict on this rank either: read_step returned its trees
            return Loaded(step, self.name, path, cast(Dict[str, Any], trees), nbytes, time.perf_counter() - t0, man,
                          fetched=kept or Fetched())
        self.rejected.append(verdict)
        ranks.log.record("error" if verdict.corrupt else "warning", step=step, path=path,
                         verdict=verdict.kind.value, message=f"checkpoint rejected: {verdict.reason}")
        if ranks.rank == 0:
            console.warning(f"{verdict.words()}: " + ("marked damaged, " if verdict.corrupt else "kept as it is, ")
                            + "trying the previous checkpoint")
        if verdict.corrupt and self.on_rejected is not None and ranks.rank == 0:
            self.on_rejected(step, verdict.reason)
        return None

    def give_up(self) -> None:
        """Every candidate was tried: NoValidCheckpoint when this job's steps exist and none restored (never a
        silent fresh start over them)."""
        if self.rejected:
            raise NoValidCheckpoint(_none_restorable(self.ranks.cfg.save_dir, self.rejected), self.rejected)


def _none_restorable(save_dir: str, rejected: List[Verdict]) -> str:
    lines = "\n".join(f"  {v.words()}" for v in rejected)
    return (f"{len(rejected)} committed checkpoint(s) of this job in {save_dir}, and none can be restored "
            f"here:\n{lines}\nNothing was deleted. Fix what the verdicts name (a corrupt step: restore its files "
            f"from a copy; an incompatible one: relaunch with the layout, model or settings it was saved with), "
            f"or set on_no_valid_checkpoint=\"start_fresh\" to train from the beginning: these steps are then set "
            f"aside as quarantined-<name>-<stamp>, kept whole, and their names never reused")


def _say_other_jobs(others: List[Tuple[int, str, Manifest]], ranks: Ranks) -> None:
    """Committed steps of other jobs in the save dir: never resumed, said once (docs/reliability.md promise 12)."""
    if not others:
        return
    names = sorted({man.job_words() for _, _, man in others})
    text = (f"{len(others)} committed step(s) in this save dir belong to another job ({'; '.join(names)}): "
            f"{', '.join(os.path.basename(p) for _, p, _ in others[:8])}{' ...' if len(others) > 8 else ''}; "
            f"not resumed (a job resumes only its own; set job_name to the job's name to resume them)")
    ranks.say(text, "not_ours")


def _log_invalid_manifests(sd: SaveDir, valid: Set[int], ranks: Ranks) -> None:
    """Step directories that hold a manifest the loader cannot trust: each one said in the audit log (they
    are skipped, not fatal: an older intact step still serves)."""
    for step, path in sd.step_dirs():
        if step in valid or not sd.storage.exists(os.path.join(path, mf.MANIFEST_NAME)):
            continue          # no manifest at all: an interrupted save or a framework's own, not damage
        _man, reason = stepfiles.judge(path, step)
        if reason is None:
            continue      # valid, e.g. committed by another job: not ours to judge here
        ranks.log.emit("error", step=step, path=path, message=f"checkpoint rejected: {reason}; it is skipped")
