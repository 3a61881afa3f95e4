"""The memory source: this node's complete snapshots in shared memory, and the agreement of the snapshot tier.

A snapshot taken with another world size or layout holds another layout's shards: it is not listed (storage
serves that). The memory and peer sources share one agreement (``agree``): a step counts as in memory when
every rank has it on its node or on a peer, and the ranks exchange one verdict each whichever they read.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, cast

from easyckpt import console
from easyckpt.engine.load.sources import Listing, Loaded, Ranks, by_rank
from easyckpt.engine.save import estimate, snapshot


class MemorySource:
    name = "memory"

    def __init__(self, ranks: Ranks, layout: Optional[str]):
        self.ranks = ranks
        cfg, rank, world_size = ranks.cfg, ranks.rank, ranks.world_size
        self.held = [s for s in snapshot.complete_snapshots(cfg.job_id, rank)
                     if s.world_size == world_size and (layout is None or s.layout == layout)]

    def steps(self) -> Listing:
        return {s.step: None for s in self.held}

    def read(self, step: int) -> Optional[Loaded]:
        slot = next(s.slot for s in self.held if s.step == step)
        return agree(self.ranks, step, self.name,
                     lambda: snapshot.read_snapshot(self.ranks.cfg.job_id, self.ranks.rank, slot, step))


def agree(ranks: Ranks, step: int, source: str, take: Callable[[], Dict[str, Any]]) -> Optional[Loaded]:
    """Step ``step`` read by ``take`` from this node's memory (or pulled from a peer's); None, on every rank, when
    any rank cannot read it (storage serves instead)."""
    t0 = time.perf_counter()
    trees, err = None, None
    try:
        trees = take()
    except Exception as exc:  # noqa: BLE001 - any failure means: use storage instead
        err = f"{type(exc).__name__}: {exc}"
    gathered = ranks.gather((err, source))
    errors = [v for v, _ in gathered]
    if all(v is None for v in errors):
        nbytes = estimate.tensor_bytes(trees)
        pulled_by = tuple(r for r, (_, where) in enumerate(gathered) if where == "peer")
        # this rank's err is None too: take returned its trees
        return Loaded(step, source, None, cast(Dict[str, Any], trees), nbytes, time.perf_counter() - t0,
                      from_peers=pulled_by)
    bad = by_rank(errors)
    ranks.log.record("warning", step=step,
                     message=f"memory snapshot unusable on some rank: {bad}; falling back to storage")
    if ranks.rank == 0:
        console.warning(f"step {step} in memory is unusable ({bad}): resuming from storage instead")
    return None
