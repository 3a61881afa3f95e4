"""The peer source: this rank's replicas on peer nodes (engine/link/peers.py), for a rank whose node lost its memory
(a replacement node). A step is pulled into this rank's own slot first, then read as memory is (memory.agree)."""
from __future__ import annotations

from typing import Any, Dict, Optional, cast

from easyckpt.engine.link.peers import Remote
from easyckpt.engine.load import memory
from easyckpt.engine.load.sources import Listing, Loaded, Ranks
from easyckpt.engine.save import snapshot


class PeerSource:
    name = "peer"

    def __init__(self, ranks: Ranks, remote: Optional[Remote], layout: Optional[str], besides: Listing):
        """``remote``: this rank's replicas on peer nodes (None: replicas are off); asked before the ranks'
        first collective. ``besides``: the steps in this node's memory (not pulled)."""
        self.ranks, self.remote, self.layout = ranks, remote, layout
        self.listed = sorted({s for s, w, _ in (remote.steps() if remote else []) if w == ranks.world_size}
                             - set(besides))

    def steps(self) -> Listing:
        return {s: None for s in self.listed}

    def read(self, step: int) -> Optional[Loaded]:
        return memory.agree(self.ranks, step, self.name, lambda: self._pull(step))

    def _pull(self, step: int) -> Dict[str, Any]:
        assert self.remote is not None
        job, rank, layout = self.ranks.cfg.job_id, self.ranks.rank, self.layout
        # fetch raises for a reply that names no slot
        slot = cast(int, self.remote.fetch(step).slot)
        pulled = next((s for s in snapshot.complete_snapshots(job, rank) if s.slot == slot), None)
        if layout is not None and (pulled is None or pulled.layout != layout):
            # a peer lists replicas by world size alone: one taken on another layout serves nobody
            raise ValueError(f"the replica of step {step} pulled from a peer was taken on layout "
                             f"{pulled.layout if pulled else 'unknown'}, this run is {layout}")
        return snapshot.read_snapshot(job, rank, slot, step)
