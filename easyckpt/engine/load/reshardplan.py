"""The plan of a memory-backed reshard (resharded.py), computed alike on every rank from what every rank gathered:
which run's snapshots make step S whole across the nodes' memory, the manifest its files would have had in
storage, and which slot each rank reads on its node or receives from another node.

Pure functions of gathered values (no I/O, no collective), so every rank reaches the same plan and the rules
are tested alone (tests/test_reshard_plan.py). A step is whole when, for one earlier run (its world size, layout
and run token, which its ranks agree on at their load: session.py), every one of its ranks' snapshots *of that
step* is held by some node: a slot of another step, or of the same step of another run (a job that redid it
after a restart), never joins the plan, so a mix of two states cannot be built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

from easyckpt.engine.load.held import Held
from easyckpt.formats import manifest as mf
from easyckpt.formats.manifest import Manifest

View = Tuple[str, Sequence[Held]]     # one rank's node key and what that node holds


@dataclass(frozen=True)
class Whole:
    """Step ``step`` of the run of ``world_size`` ranks (``layout``), held whole by the nodes' memory."""
    step: int
    world_size: int
    layout: Optional[str]
    holders: Dict[int, List[Tuple[str, Held]]]      # that run's rank -> (node key, its slot there), own slots first
    owner: Dict[str, int]                           # each persisted file -> the rank whose slot holds it
    files: Dict[str, int]        # those, and each memory-only file no other rank's slot names (a rank's own)

    def manifest(self, job_id: str, framework: str) -> Manifest:
        """The manifest this step would have in storage, as far as a restore's ``needed`` reads it: its files, the
        world size that wrote it, the adapters' info (rank 0's wins, as the commit merges it). No sizes or
        checksums: the bytes are checked as slots (their seqlock, the checksum of a move), not as files."""
        files = {rel: mf.FileEntry(0) for rel in self.owner}
        return mf.build(self.step, job_id, framework, self.world_size, files, self.info())

    def info(self) -> Dict[str, object]:
        """The adapters' info of the step, merged as the commit merges it: rank 0's wins."""
        info: Dict[str, object] = {}
        for rank in sorted(self.holders, reverse=True):
            info.update(dict(self.holders[rank][0][1].info))
        return info

    def nodes(self) -> Tuple[int, int]:
        """(nodes whose own slots serve, replicas that serve): for the console's line."""
        first = [self.holders[r][0] for r in self.holders]
        return len({key for key, h in first if not h.replica}), sum(1 for _, h in first if h.replica)


def whole(step: int, views: Sequence[View]) -> Union[Whole, str]:
    """The run whose snapshots of ``step`` the nodes hold whole, or why none does."""
    runs: Dict[Tuple[int, str, str], Dict[int, List[Tuple[str, Held]]]] = {}
    for key, held in _per_node(views).items():
        for h in held:
            if h.step == step:
                run = (h.world_size, h.layout or "", str(dict(h.info).get("run_id", "")))
                runs.setdefault(run, {}).setdefault(h.rank, []).append((key, h))
    missing: List[str] = []
    for (world, layout, _), holders in sorted(runs.items()):
        absent = sorted(set(range(world)) - set(holders))
        if absent or set(holders) - set(range(world)):
            missing.append(f"rank(s) {absent} of its {world}-rank run are in no node's memory")
            continue
        owner, clash = _owners(holders)
        if clash:
            missing.append(clash)
            continue
        ordered = {r: sorted(hs, key=lambda kh: (kh[1].replica, kh[0])) for r, hs in sorted(holders.items())}
        return Whole(step, world, layout or None, ordered, owner, {**_memory_only(holders, owner), **owner})
    return "; ".join(missing) or "no node holds it"


def _per_node(views: Sequence[View]) -> Dict[str, Sequence[Held]]:
    """Each node's holdings once (every rank of a node lists the same slots)."""
    out: Dict[str, Sequence[Held]] = {}
    for key, held in views:
        out.setdefault(key, held)
    return out


def _owners(holders: Dict[int, List[Tuple[str, Held]]]) -> Tuple[Dict[str, int], Optional[str]]:
    owner: Dict[str, int] = {}
    for rank in sorted(holders):
        for rel, persist in holders[rank][0][1].files:
            if not persist:
                continue
            if rel in owner:
                return {}, f"{rel} is persisted by both rank {owner[rel]} and rank {rank}: not one run's snapshot"
            owner[rel] = rank
    return owner, None


def _memory_only(holders: Dict[int, List[Tuple[str, Held]]], owner: Dict[str, int]) -> Dict[str, int]:
    """Files a rank keeps in memory only (not persisted) under a name no other rank's slot uses: its own."""
    named: Dict[str, List[int]] = {}
    for rank in sorted(holders):
        for rel, _ in holders[rank][0][1].files:
            named.setdefault(rel, []).append(rank)
    return {rel: ranks[0] for rel, ranks in named.items() if len(ranks) == 1 and rel not in owner}


@dataclass(frozen=True)
class Move:
    """Rank ``sender`` sends the slot of the old run's rank ``old`` (its bytes, ``held``) to rank ``receiver``."""
    old: int
    sender: int
    receiver: int
    held: Held


def moves(plan: Whole, views: Sequence[View], wants: Sequence[Sequence[int]]) -> List[Move]:
    """Every slot a rank reads that its node does not hold, each sent by the lowest rank of the first node that
    holds it (its own slot before a replica): ``wants`` is every rank's old ranks to read, in rank order."""
    first_rank: Dict[str, int] = {}
    for rank, (key, _) in enumerate(views):
        first_rank.setdefault(key, rank)
    out = []
    for receiver, olds in enumerate(wants):
        here = views[receiver][0]
        for old in sorted(set(olds)):
            holders = plan.holders[old]
            if any(key == here for key, _ in holders):
                continue
            key, held = holders[0]
            out.append(Move(old, first_rank[key], receiver, held))
    return out


def local(plan: Whole, here: str, old: int) -> Optional[Held]:
    """This node's slot of the old run's rank ``old`` (own before replica), or None when it comes by a Move."""
    return next((h for key, h in plan.holders[old] if key == here), None)


def olds_for(plan: Whole, relpaths: Set[str]) -> List[int]:
    """The old run's ranks whose slots hold ``relpaths`` (the caller's ``needed`` says whether one absent is
    allowed)."""
    return sorted({plan.files[rel] for rel in relpaths if rel in plan.files})
