"""The ranks' agreement on what to try: from every rank's listings (a mapping by source name), the steps all
ranks can read, tier by tier in sources.PRIORITY, each with the tier that reads it."""
from __future__ import annotations

from typing import List, Mapping, Sequence, Set, Tuple

from easyckpt.engine.load.sources import PRIORITY, Listing, Ranks, Tier
from easyckpt.formats import manifest as mf
from easyckpt.formats.manifest import RunKey

Views = Sequence[Mapping[str, Listing]]     # every rank's listings, in rank order


def choose(views: Views, runs: Mapping[int, RunKey]) -> List[Tuple[Tier, List[int]]]:
    """The steps to try, in order, each tier with its own: a tier's newest agreed step when it is at least as
    new as every later tier's newest trusted one; the walked tier's every agreed step, newest commit first
    (``runs``, mf.newest_first: a step with no verdict and one with a verdict alike, the latter tried as a last
    resort by what reads it)."""
    ordered = [_order(tier, views, runs) for tier in PRIORITY]
    doubted = [_doubted(tier, views) for tier in PRIORITY]
    # a tier listed anywhere holds steps that may prove partial: it never outranks another
    trusted = [None if tier.anywhere else next((s for s in steps if s not in doubt), None)
               for tier, steps, doubt in zip(PRIORITY, ordered, doubted)]
    plan: List[Tuple[Tier, List[int]]] = []
    for i, (tier, steps) in enumerate(zip(PRIORITY, ordered)):
        due = [s for s in steps if all(later is None or s >= later for later in trusted[i + 1:])]
        if tier.walk:
            plan.append((tier, steps))
        elif tier.anywhere and due:
            plan.append((tier, due))
        elif steps and steps[0] in due:
            plan.append((tier, steps[:1]))
    return plan


def _order(tier: Tier, views: Views, runs: Mapping[int, RunKey]) -> List[int]:
    if tier.anywhere:     # on some rank
        agreed = set().union(*(set(v.get(n, {})) for v in views for n in tier.names))
    elif tier.either:       # in one of the tier's sources on every rank
        agreed = set.intersection(*(set().union(*(v.get(n, {}) for n in tier.names)) for v in views))
    else:                 # in one source on every rank
        agreed = set().union(*(set.intersection(*(set(v.get(n, {})) for v in views)) for n in tier.names))
    return mf.newest_first(agreed, runs) if tier.walk else sorted(agreed, reverse=True)


def _doubted(tier: Tier, views: Views) -> Set[int]:
    """The steps some rank holds with a verdict (tried last-resort only: never preferred over another tier)."""
    return {s for v in views for n in tier.names for s, why in v.get(n, {}).items() if why is not None}


def say_lost_memory(views: Views, ranks: Ranks) -> None:
    """Ranks with no snapshot in memory anywhere, while others have one: their node and every holder of its
    replicas were lost (or replicas are off). Storage serves; said loudly, once."""
    empty = [r for r, v in enumerate(views) if not v["memory"] and not v["peer"]]
    if empty and len(empty) < len(views):
        why = (f"rank(s) {empty} have no snapshot in memory, neither on their node nor on a peer node (their node "
               f"and the holders of its replicas were lost, or replicas are off): resuming from storage, which "
               f"may be older than the other ranks' memory")
        ranks.say(why)
