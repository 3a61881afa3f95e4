"""The resharded source: a step written by another world size or layout, read from the memory of the nodes that
run this job now (their own slots and the replicas they hold of lost nodes), without reading storage.

A job restarted on fewer nodes (or another data-parallel size) finds its last run's snapshots still in the
surviving nodes' memory: each is one old rank's shard of the old layout. Together they are the step as storage
would hold it. A slot a node lacks is sent by a node that holds it over the job's process group
(Group.exchange), read under its seqlock with a checksum (held.slot_bytes) and checked on arrival. Two routes,
by what the adapter's restore takes (``Route``):

  trees   its restore takes the files it names (FrameworkState.needed_in_memory) from memory, decoded: each rank
          receives only the slots that hold them (plain PyTorch; FSDP2, whose DCP planner reshards in memory);
  render  its restore reads a step directory: the node's first rank writes the step out as storage would
          (render.py) into its node's /dev/shm, from the slots of every old rank, and every rank of the node
          reads it with the adapter's own ``needed``, as a committed step (Megatron, DeepSpeed).

Order of a read (every rank, together):
  1. every rank gathers (its node, what that node holds: held.py); reshardplan.whole picks the earlier run whose
     snapshots of the step the nodes hold whole, else the step is not used (said, and the next source serves);
  2. the ranks gather the old ranks whose slots each reads; reshardplan.moves says which slot goes to which rank;
  3. slots go over, each rank decodes (or its node writes out) what it reads, and the ranks exchange one verdict
     each: every rank restores the step, or none does.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, cast

from easyckpt.engine.load import held as heldmod
from easyckpt.engine.load import render, reshardplan
from easyckpt.engine.load.reads import Needed, Read
from easyckpt.engine.load.sources import Listing, Loaded, Ranks, by_rank
from easyckpt.engine.load.stepread import read_step
from easyckpt.engine.save import estimate
from easyckpt.engine.save.snapshot import read_slot_file
from easyckpt.engine.seams import Payload
from easyckpt.formats.manifest import Manifest
from easyckpt.units import human


class Route(NamedTuple):
    """How the adapter restores a step of another world size or layout from memory: the files it takes decoded
    (``trees``: FrameworkState.needed_in_memory), else a step directory read with ``needed`` (``render``)."""
    trees: Optional[Callable[[Manifest], Sequence[Any]]] = None
    render: Optional[Needed] = None
    room: float = 1.0      # the /dev/shm the render route takes, in times the step's bytes (FrameworkState.render_room)


class ReshardSource:
    name = "resharded"

    def __init__(self, ranks: Ranks, route: Route, layout: Optional[str]):
        """``route``: neither (nothing listed) where the adapter restores such a step from storage only, or no
        exchange between ranks is wired."""
        self.ranks, self.route, self.now = ranks, route, layout
        self.rendered: Optional[str] = None       # the directory this node's step was written out to (render route)
        self.here = heldmod.node_key()
        usable = (route.trees or route.render) is not None and ranks.exchange is not None
        self.held = heldmod.held_here(ranks.cfg.job_id, ranks.world_size, layout) if usable else []
        if self.held and route.trees is None:
            render.remove_stale(ranks.cfg.job_id)

    def steps(self) -> Listing:
        return {h.step: None for h in self.held}

    def read(self, step: int) -> Optional[Loaded]:
        ranks = self.ranks
        t0 = time.perf_counter()
        views = ranks.gather((self.here, [h for h in self.held if h.step == step]))
        plan = reshardplan.whole(step, views)
        if isinstance(plan, str):
            ranks.say(f"step {step} is in memory only in part, so it is not resharded from memory ({plan}): "
                      f"the next candidate serves")
            return None
        man = plan.manifest(ranks.cfg.job_id, ranks.cfg.naming.framework)
        wanted, err = self._wanted(man, plan)
        olds = reshardplan.olds_for(plan, wanted) if self.route.trees else \
            (sorted(plan.holders) if ranks.rank == _leader(views, self.here) else [])
        moves = reshardplan.moves(plan, views, ranks.gather(olds))
        moved, move_err = self._move(moves)
        out: Optional[Loaded] = None
        err = err or move_err
        try:
            if self.route.trees is None:        # a collective: every rank goes in, failed or not
                out = self._render(plan, views, moved, err)
            elif err is None:
                out = self._trees(plan, olds, moved, wanted, man)
        except Exception as exc:  # noqa: BLE001 - any failure means: the next source serves
            err = err or f"{type(exc).__name__}: {exc}"
        errors = ranks.gather(err)
        if any(e is not None for e in errors) or out is None:
            ranks.say(f"step {step} could not be resharded from memory ({by_rank(errors)}): the next candidate "
                      f"serves")
            render.remove(self.rendered, ranks.cfg.job_id)
            return None
        own, replicas = plan.nodes()
        held_by = f" and {_n(replicas, 'replica')} held by peers" if replicas else ""
        change = f"{plan.world_size} → {ranks.world_size} ranks" if plan.world_size != ranks.world_size else \
            f"layout {plan.layout} → {self.now}"       # (the same world size: the layout is what changed)
        out.detail = (f"resharded {change}: the slots of {_n(own, 'node')}"
                      f"{held_by}; {human(sum(m.held.nbytes for m in moves))} moved between nodes, 0 bytes read "
                      f"from storage")
        out.moved, out.seconds = sum(m.held.nbytes for m in moves if m.receiver == ranks.rank), time.perf_counter() - t0
        return out

    def _wanted(self, man: Manifest, plan: reshardplan.Whole) -> Tuple[Set[str], Optional[str]]:
        """The files this rank's trees route takes (none on the render route: its node writes them all)."""
        if self.route.trees is None:
            return set(), None
        try:
            asked = [Read.of(w) for w in self.route.trees(man)]
        except ValueError as exc:        # the adapter cannot restore this step here
            return set(), f"{type(exc).__name__}: {exc}"
        absent = [w.relpath for w in asked if not w.optional and w.relpath not in plan.files]
        if absent:
            return set(), f"{', '.join(absent)} not in the snapshots"
        return {w.relpath for w in asked if w.relpath in plan.files}, None

    def _move(self, moves: List[reshardplan.Move]) -> Tuple[Dict[int, Payload], Optional[str]]:
        """Send the slots this rank sends, receive those it reads: {old rank: bytes}. The sizes were gathered, so
        a sender whose slot changed meanwhile still sends that many bytes (zeros) and the receiver's checksum fails."""
        me = self.ranks.rank
        sends: Dict[int, List[memoryview]] = {}
        sizes: Dict[int, List[int]] = {}
        err = None
        for m in moves:
            if m.sender == me:
                try:
                    data = heldmod.slot_bytes(m.held)
                except Exception as exc:  # noqa: BLE001 - said by the verdict; the receiver's check fails
                    err = f"sending rank {m.old}'s slot: {type(exc).__name__}: {exc}"
                    data = bytearray(m.held.nbytes + heldmod.DIGEST_BYTES)
                sends.setdefault(m.receiver, []).append(memoryview(data))
            if m.receiver == me:
                sizes.setdefault(m.sender, []).append(m.held.nbytes + heldmod.DIGEST_BYTES)
        if not moves:        # (every rank has the same plan: all skip the exchange, or none does)
            return {}, None
        assert self.ranks.exchange is not None      # nothing is listed without it
        arrived = self.ranks.exchange(sends, sizes)
        mine = [m for m in moves if m.receiver == me]
        got: Dict[int, Payload] = {}
        for sender in sorted({m.sender for m in mine}):
            for m, payload in zip([m for m in mine if m.sender == sender], arrived.get(sender, [])):
                got[m.old] = payload
        return got, err

    def _trees(self, plan: reshardplan.Whole, olds: List[int], moved: Dict[int, Payload], wanted: Set[str],
               man: Manifest) -> Loaded:
        step = plan.step
        trees: Dict[str, Any] = {}
        for old in olds:
            held = reshardplan.local(plan, self.here, old)
            files = read_slot_file(held.path, step) if held is not None else \
                heldmod.read_moved(moved[old], plan.holders[old][0][1], f"rank {old}'s slot of step {step}")
            trees.update({rel: tree for rel, tree in files.items() if plan.files.get(rel) == old and rel in wanted})
        return Loaded(step, self.name, None, trees, estimate.tensor_bytes(trees), 0.0, man)

    def _render(self, plan: reshardplan.Whole, views: Any, moved: Dict[int, Payload], failed: Optional[str]) -> Loaded:
        """The node's first rank writes the step out (unless it ``failed`` already); every rank of the node reads it
        as a committed step."""
        ranks, cfg = self.ranks, self.ranks.cfg
        leader = _leader(views, self.here)
        made, why = None, failed
        if ranks.rank == leader and failed is None:
            try:
                made = render.write(plan, self.here, moved, cfg.job_id, cfg.naming.framework, self.route.room)
            except Exception as exc:  # noqa: BLE001 - said by the verdict
                why = f"writing the step out: {type(exc).__name__}: {exc}"
        self.rendered, why = ranks.gather((made, why))[leader]
        if self.rendered is None:
            raise ValueError(why or "the step was not written out")
        assert self.route.render is not None
        trees, verdict, nbytes, man = read_step(self.rendered, self.route.render)
        if verdict is not None:
            raise ValueError(verdict.reason)
        return Loaded(plan.step, self.name, self.rendered, cast(Dict[str, Any], trees), nbytes, 0.0, man,
                      node_first=ranks.rank == leader)

def _leader(views: Any, here: str) -> int:
    """The first rank of this node in the gather: it writes the node's copy of a rendered step."""
    return next(r for r, (key, _) in enumerate(views) if key == here)


def _n(count: int, what: str) -> str:
    return f"{count} {what}" + ("" if count == 1 else "s")
