"""Load: pick the newest state that is complete on every rank, verify it, fall back when damaged.

Order:
  1. every rank opens the six sources (sources.py) and lists what each holds for it: its complete
     shared-memory snapshots, its replicas on peer nodes, its node's snapshots of another world size or
     layout, its local tier copies, the job's committed steps and the framework's own checkpoints;
  2. all ranks exchange those listings (one all_gather of a mapping by source name); agree.py picks what
     every rank can read, in sources.PRIORITY:
  3. a memory snapshot at least as new as the newest committed checkpoint (and the local tier's) wins (it is
     faster); a rank whose node lost its memory (a replacement node) takes that step from a peer node's
     replica of it (engine/link/peers.py), pulled into its own slot first; a step counts as in memory when every
     rank has it on its node or on a peer; then a step of another world size or layout that the nodes'
     memory holds whole (resharded.py: a job restarted on fewer nodes), for an adapter whose restore takes
     it from memory; then the local tier (agent/localtier.py: each rank's snapshot
     on its node's disk) when its newest step every rank has is at least as new as the committed ones,
     each copy checked against its record;
  4. otherwise, newest committed step first (stored.py; the framework's own checkpoints, adopted.py, beside
     them): each rank reads the files it needs and checks sizes and checksums against the manifest; all
     ranks exchange the verdict; any failure anywhere rejects the step for everyone (loudly) and the next
     older one is tried.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional

from easyckpt.engine.link.peers import Remote
from easyckpt.engine.load import agree
from easyckpt.engine.load.adopted import AdoptedSource
from easyckpt.engine.load.memory import MemorySource
from easyckpt.engine.load.peer import PeerSource
from easyckpt.engine.load.reads import Needed
from easyckpt.engine.load.resharded import ReshardSource, Route
from easyckpt.engine.load.sources import Listing, Loaded, Ranks, Source, Tier
from easyckpt.engine.load.stored import StorageSource
from easyckpt.engine.load.tier import TierSource


class Layout(NamedTuple):
    """The adapter's parallel layout now (FrameworkState.layout: None when the world size says it all), and how its
    restore takes a step of another world size or layout from memory (resharded.Route)."""
    now: Optional[str] = None
    reshard: Route = Route()


def load_newest(ranks: Ranks, needed: Needed, remote: Optional[Remote] = None, layout: Optional[Layout] = None,
                on_rejected: Optional[Callable[[int, str], object]] = None) -> Optional[Loaded]:
    """The newest state every rank can restore, or None. ``remote``: this rank's replicas on peer nodes (None:
    replicas are off). ``layout``: the adapter's parallel layout now (e.g. Megatron's TP/PP sizes; a snapshot
    taken on another one is not used by the memory and peer sources) and whether its restore takes a step of
    another layout from memory (the resharded source). ``on_rejected(step, why)``: called on rank 0 for each
    committed step rejected as corrupt."""
    # opened in this order, each saying what it passes over; the peers are asked before the first collective
    now, reshard = layout if layout is not None else Layout()
    memory = MemorySource(ranks, now)
    peer = PeerSource(ranks, remote, now, memory.steps())
    stored = StorageSource(ranks, needed, on_rejected)
    resharded = ReshardSource(ranks, reshard, now)
    opened: Dict[str, Source] = {s.name: s for s in (memory, peer, resharded, stored, AdoptedSource(ranks, needed),
                                                      TierSource(ranks, now))}
    mine = {name: source.steps() for name, source in opened.items()}
    views = ranks.gather(mine)
    agree.say_lost_memory(views, ranks)
    for tier, steps in agree.choose(views, stored.runs):
        for step in steps:
            loaded = _reader(tier, mine, opened, step).read(step)
            if loaded is not None:
                return loaded
    stored.give_up()
    return None


def _reader(tier: Tier, mine: Dict[str, Listing], opened: Dict[str, Source], step: int) -> Source:
    """The first of the tier's sources that holds ``step`` on this rank (the agreement saw it in one of them)."""
    return opened[next((n for n in tier.names if step in mine[n]), tier.names[-1])]
