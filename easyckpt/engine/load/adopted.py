"""The adopted source: the framework's own checkpoints (no manifest), weighed beside the committed steps with
the rules of adopt.py (the framework's tracker bounds them; no checksums exist to check)."""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, cast

from easyckpt import console
from easyckpt.engine.load import adopt
from easyckpt.engine.load.reads import Needed
from easyckpt.engine.load.sources import Listing, Loaded, Ranks


class AdoptedSource:
    name = "adopted"

    def __init__(self, ranks: Ranks, needed: Needed):
        self.ranks, self.needed = ranks, needed
        # what the loader passed over of the framework's own checkpoints, and why: said once
        native = adopt.candidates(ranks.cfg.save_dir, ranks.cfg.naming, lambda text: ranks.say(text, "not_adopted"))
        self.found = {c.step: c for c in native}

    def steps(self) -> Listing:
        return {s: None for s in self.found}

    def read(self, step: int) -> Optional[Loaded]:
        """Load a checkpoint the framework wrote itself, or None (all ranks agree) when it is incomplete."""
        cand, ranks = self.found[step], self.ranks
        t0 = time.perf_counter()
        what = adopt.describe(ranks.cfg.naming, cand.path)
        trees, problem, nbytes, inv = adopt.read_candidate(cand, self.needed, progress=ranks.rank == 0)
        problems = ranks.gather(problem)
        bad = [(r, v) for r, v in enumerate(problems) if v is not None]
        if bad:
            message = "; ".join(f"rank {r}: {v}" for r, v in bad)
            ranks.log.record("error", step=cand.step, path=cand.path, message=f"{what} not adopted: {message}")
            if ranks.rank == 0:    # the same verdicts on every rank: one console line
                console.warning(f"{what} is incomplete or unreadable ({message}): trying the previous checkpoint")
            return None
        ranks.log.emit("adopt", step=cand.step, rank=ranks.rank, path=cand.path, bytes=nbytes,
                       message=f"{what}: no easyckpt manifest, so no checksums to verify; every file this rank needs "
                               f"exists with its size on disk and loads")
        console.info(f"resuming from {what} (no easyckpt manifest)")
        # no problem on this rank either: read_candidate returned its trees
        return Loaded(cand.step, self.name, cand.path, cast(Dict[str, Any], trees), nbytes, time.perf_counter() - t0,
                      inv)
