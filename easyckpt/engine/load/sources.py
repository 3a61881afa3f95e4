"""Where a state can come from: the Source protocol, the priority list, and what a load returns.

A source is one place that may hold a step of this job for this rank. The loader asks every source for its
steps (``steps``), the ranks exchange those listings (one all_gather of a mapping keyed by source name),
agree.py picks the steps every rank can try, in PRIORITY order, and each is read (``read``) until one is
restored. The six sources, each in the module of its name:

    memory    memory.py   this node's complete snapshots in shared memory
    peer      peer.py     this rank's replicas on peer nodes, pulled into a slot of its own first
    resharded resharded.py  a step of another world size or layout, whole across the nodes' memory
    local     tier.py     the local tier: each rank's snapshot on its node's disk (agent/localtier.py)
    storage   stored.py   this job's committed steps in the save dir, verified against their manifests
    adopted   adopted.py  the framework's own checkpoints (no manifest: adopt.py's rules)

Order of calls a source sees (the same on every rank):
  1. it is opened: it lists what it holds (said in the audit log where something is passed over);
  2. ``steps()``: this rank's steps, each with its verdict (None: trusted);
  3. ``read(step)``, zero or more times, newest first: a collective. Every rank calls it for the same step at
     the same time (the sources of one tier of PRIORITY share its agreement, so one rank may read from
     memory while another pulls the same step from a peer); it returns the state on every rank, or None on
     every rank when some rank cannot restore it (said, loudly), and the next candidate is tried.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from easyckpt import console
from easyckpt.config import Config
from easyckpt.engine.load.reads import Fetched
from easyckpt.engine.seams import Payload
from easyckpt.formats.manifest import Manifest
from easyckpt.storage.auditlog import AuditLog


@dataclass
class Loaded:
    step: int
    source: str               # the Source's name: "memory", "peer" (a replica on another node), "local" (the local
                              # tier: a snapshot on this node's disk), "storage" or "adopted" (the framework's own
                              # checkpoint, adopt.py); path is None for the snapshots (memory, peer, local)
    path: Optional[str]
    trees: Dict[str, Any]
    nbytes: int
    seconds: float
    manifest: Optional[Manifest] = None   # the committed step's manifest, or an adopted one's inventory
    from_peers: Tuple[int, ...] = ()            # the ranks that pulled the step from a peer's replica
    fetched: Fetched = field(default_factory=Fetched)   # from an object store: for the reader's copy (reads.py)
    detail: str = ""          # how a resharded step was put together (resharded.py), for the resume line
    moved: int = 0            # the bytes this rank received from other nodes' memory (resharded.py)
    node_first: bool = False  # a step written out in the node's memory (resharded.py): this rank wrote it, the one
                              # rank of its node that writes beside it (render.beside)


# (destination -> payloads to send, source -> sizes to receive) -> what arrived by source: Group.exchange (seams.py)
Exchange = Callable[[Dict[int, List[memoryview]], Dict[int, List[int]]], Dict[int, List[Payload]]]

# this rank's steps of this job in one source: step -> None (trusted), or why it is tried only as a last resort
Listing = Dict[int, Optional[str]]


class Source(Protocol):
    name: str

    def steps(self) -> Listing:
        """This rank's steps of this job here, each with its verdict; no collective."""

    def read(self, step: int) -> Optional[Loaded]:
        """Step ``step`` restored on every rank, or None on every rank (a collective, see the module's order)."""


@dataclass(frozen=True)
class Tier:
    """Sources tried as one: a rank reads a step from the first of ``names`` that lists it."""
    names: Tuple[str, ...]
    either: bool     # a step counts when every rank lists it in one of the sources (else: every rank in one source)
    walk: bool       # every agreed step is tried, newest commit first (else: only its newest, when it is due)
    anywhere: bool = False   # a step counts when some rank lists it (its read checks that it is whole); every such
                             # step not older than the later tiers' newest is tried, and none holds an earlier tier back


# The priority list. A tier's newest agreed step is tried when it is at least as new as every later tier's
# newest trusted one (memory is faster than the disk, the disk than storage); the last tier is then walked.
PRIORITY: Tuple[Tier, ...] = (
    Tier(("memory", "peer"), either=True, walk=False),
    Tier(("resharded",), either=False, walk=False, anywhere=True),
    Tier(("local",), either=False, walk=False),
    Tier(("storage", "adopted"), either=False, walk=True),
)


@dataclass(frozen=True)
class Ranks:
    """This rank among the job's ranks, as every source needs it."""
    cfg: Config
    rank: int
    world_size: int
    log: AuditLog
    gather: Callable[[Any], List[Any]]     # this rank's object -> every rank's, in order (the engine's Group)
    exchange: Optional[Exchange] = None    # point-to-point messages between ranks (the engine's Group.exchange)

    def say(self, text: str, event: str = "warning") -> None:
        """The audit log on every rank, the console once (rank 0): the ranks agree, so one line says it."""
        self.log.record(event, message=text)
        if self.rank == 0:
            console.warning(text)


def by_rank(errors: List[Optional[str]]) -> str:
    """Each rank's error, named by its rank, in one line (ranks with none left out)."""
    return "; ".join(f"rank {r}: {v}" for r, v in enumerate(errors) if v is not None)
