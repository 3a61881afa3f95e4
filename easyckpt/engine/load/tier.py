"""The local tier source: each rank's snapshot on its node's disk (agent/localtier.py), read whenever the tier
holds copies (also when save_local_interval is off now: a state kept), each copy checked against its record."""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, cast

from easyckpt import console
from easyckpt.engine.load.sources import Listing, Loaded, Ranks, by_rank
from easyckpt.engine.save import estimate, snapshot
from easyckpt.storage import tierfiles


class TierSource:
    name = "local"

    def __init__(self, ranks: Ranks, layout: Optional[str]):
        self.ranks = ranks
        cfg, world_size = ranks.cfg, ranks.world_size
        self.copies = {c.step: c for c in tierfiles.listing(tierfiles.directory(cfg.node_dir, cfg.job_id),
                                                             cfg.job_id, ranks.rank, ranks.log)
                       if c.record.world_size == world_size and (layout is None or c.record.layout == layout)}

    def steps(self) -> Listing:
        return {s: None for s in sorted(self.copies)}

    def read(self, step: int) -> Optional[Loaded]:
        """Step ``step`` from every rank's copy, each checked against its record first; None, on every rank, when
        any rank cannot read its copy (kept as it is: storage serves instead)."""
        copy, ranks = self.copies[step], self.ranks
        t0 = time.perf_counter()
        trees, err = None, None
        try:
            # checked against its record in the same mapping the tensors are then copied from (one pass over the disk)
            trees = snapshot.read_slot_file(copy.path, copy.step, lambda mapped: tierfiles.verify(copy, mapped))
        except Exception as exc:  # noqa: BLE001 - any failure means: use storage instead
            err = f"{type(exc).__name__}: {exc}"
        errors = ranks.gather(err)
        if all(v is None for v in errors):
            trees = cast(Dict[str, Any], trees)       # this rank's err is None too: it read its copy
            return Loaded(copy.step, self.name, None, trees, estimate.tensor_bytes(trees), time.perf_counter() - t0)
        bad = by_rank(errors)
        ranks.log.record("warning", step=copy.step, message=f"local tier copy unusable on some rank: {bad}; kept as "
                                                           f"it is, falling back")
        if ranks.rank == 0:
            console.warning(f"step {copy.step} in the local tier is unusable ({bad}): resuming from storage instead")
        return None
