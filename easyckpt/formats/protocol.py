"""Trainer ↔ agent protocol: JSON lines over an abstract Unix socket (no file on disk; the name is
free again the moment the agent dies, which also makes it the agent's single-instance lock).

Who may talk (docs/reliability.md promise 9). The name of an abstract socket is public (/proc/net/unix) and carries no
file permissions, so both ends check the other: the agent accepts a connection only from a process of
its own user (SO_PEERCRED), and the first message of every connection must carry the job's key — 32
random bytes in a 0600 file in /dev/shm that only the job's user can read (jobkey.py). A trainer, in
turn, talks only to an agent of its own user, so a squatter on the name gets nothing. Every line is
turned into a typed message by ``parse`` (the one place that validates); a bad one gets an ``error``
reply naming the bad field, and the agent lives on.

The seven operations, in the order a trainer sends them (the agent answers only hello, flush, status;
its replies are the typed records of formats/replies.py):

  1. hello     Hello(rank, world_size, local_rank, pid)   → {ok, agent_pid} or {ok: false, error}
  2. persist   Persist(rank, slot, generation, step)       after each snapshot on a storage step
  3. flush     Flush(rank, step, slot, generation)         → {ok, step, error} once the rank's shard of
                                                             ``step`` is durable (or failed); persists it
                                                             first if this agent never heard of it
  4. bye       Bye(rank)                                   the trainer is done; its slots go with it
Side channels, each on a connection of its own whose one message carries ``key`` (client.one_shot):
  5. term      Term(rank, at)          a SIGTERM arrived at wall time ``at``: the grace clock starts
  6. term_step TermStep(rank, step)    the step the trainers agreed to save for it
  7. damaged   Damaged(step, reason)   the loader rejected a committed step as corrupt
  +  quarantine Quarantine(step, reason) a fresh start was allowed over a step no rank could restore: set
                                       it aside, kept whole (SaveDir.quarantine)
  +  status    Status()                → the agent's state (a query, not a command)
Peer replicas (agent/replicas.py), on the trainer's own connection, after hello:
  listen        Listen(addr)                          → {ok, port}: the agent's TCP endpoint for its peers
  peers         Peers(node, nnodes, ranks_per_node, secret, endpoints)   → {ok}: where every agent is
  replica_list  ReplicaList(rank)                     → {ok, steps: [[step, world_size, node]]} held by peers
  replica_fetch ReplicaFetch(rank, step)              → {ok, slot, bytes, seconds, node}: pulled into the
                                                        rank's own slot on this node
A connection that closes without bye is a trainer that died: the agent persists the newest complete
snapshot of its dead ranks, keeps the slots for agent_idle_timeout so a restart can resume from
memory, then removes them and exits.

On the wire a message is one JSON object ``{"op": <op>, <field>: <value>, ...}`` (plus ``"key"`` in a
connection's first message); fields the receiver does not know are ignored, so both ends may be of
different versions as long as the fields below stay.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import typing
from typing import (
    Any,
    ClassVar,
    Dict,
    NamedTuple,
    Optional,
    Tuple,
    Type,
    Union,
)

from easyckpt.errors import BadMessage

MAX_LINE = 1 << 16          # no valid message comes close; a longer line is an attack or a bug
MAX_INT = 2 ** 62
MAX_TEXT = 4096


@dataclasses.dataclass(frozen=True)
class _Message:
    op: ClassVar[str]

    def __post_init__(self) -> None:
        for name, kind in _types(type(self)).items():
            object.__setattr__(self, name, _field(self.op, name, kind, getattr(self, name)))
        self._check()

    def _check(self) -> None:
        """Rules across fields (each message class adds its own)."""

    def to_wire(self) -> Dict[str, Any]:
        return {"op": self.op, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Hello(_Message):
    op: ClassVar[str] = "hello"
    rank: int
    world_size: int
    local_rank: int
    pid: int

    def _check(self) -> None:
        if self.world_size < 1 or self.rank >= self.world_size:
            raise BadMessage(f"hello: rank {self.rank} is not below world_size {self.world_size}")


def _slot_is_0_or_1(msg: Union["Persist", "Flush"]) -> None:
    if msg.slot not in (0, 1):
        raise BadMessage(f"{msg.op}: field 'slot' = {msg.slot} must be 0 or 1")


@dataclasses.dataclass(frozen=True)
class Persist(_Message):
    op: ClassVar[str] = "persist"
    rank: int
    slot: int
    generation: int
    step: int

    def _check(self) -> None:
        _slot_is_0_or_1(self)


@dataclasses.dataclass(frozen=True)
class Flush(_Message):
    op: ClassVar[str] = "flush"
    rank: int
    step: int
    slot: int
    generation: int

    def _check(self) -> None:
        _slot_is_0_or_1(self)


@dataclasses.dataclass(frozen=True)
class Bye(_Message):
    op: ClassVar[str] = "bye"
    rank: int


@dataclasses.dataclass(frozen=True)
class Term(_Message):
    op: ClassVar[str] = "term"
    rank: int
    at: float


@dataclasses.dataclass(frozen=True)
class TermStep(_Message):
    op: ClassVar[str] = "term_step"
    rank: int
    step: int


@dataclasses.dataclass(frozen=True)
class Damaged(_Message):
    op: ClassVar[str] = "damaged"
    step: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Quarantine(_Message):
    op: ClassVar[str] = "quarantine"
    step: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Status(_Message):
    op: ClassVar[str] = "status"


@dataclasses.dataclass(frozen=True)
class Listen(_Message):
    op: ClassVar[str] = "listen"
    addr: str

    def _check(self) -> None:
        try:
            ipaddress.ip_address(self.addr)
        except ValueError:
            raise BadMessage(f"listen: field 'addr' = {self.addr[:60]!r} is not an IP address") from None


_ENDPOINT = re.compile(r"^(\d{1,7})=([0-9a-fA-F.:]{2,45})@(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class Peers(_Message):
    op: ClassVar[str] = "peers"
    node: int
    nnodes: int
    ranks_per_node: int
    secret: str
    endpoints: str       # "node=addr@port,..." for every node

    def _check(self) -> None:
        if not 0 <= self.node < self.nnodes or self.ranks_per_node < 1:
            raise BadMessage(f"peers: node {self.node} of {self.nnodes}, {self.ranks_per_node} ranks per node")
        if not re.fullmatch(r"[0-9a-f]{32,128}", self.secret):
            raise BadMessage("peers: field 'secret' must be 32 to 128 hex digits")
        self.table()

    def table(self) -> Dict[int, Tuple[str, int]]:
        """node -> (address, port), checked: every node once, real addresses, ports in range."""
        out: Dict[int, Tuple[str, int]] = {}
        for item in self.endpoints.split(","):
            m = _ENDPOINT.match(item)
            if not m or int(m.group(1)) >= self.nnodes or int(m.group(1)) in out or not 0 < int(m.group(3)) < 65536:
                raise BadMessage(f"peers: endpoint {item[:60]!r} is not node=address@port of a node below {self.nnodes}")
            try:
                ipaddress.ip_address(m.group(2))
            except ValueError:
                raise BadMessage(f"peers: {m.group(2)!r} is not an IP address") from None
            out[int(m.group(1))] = (m.group(2), int(m.group(3)))
        return out


@dataclasses.dataclass(frozen=True)
class ReplicaList(_Message):
    op: ClassVar[str] = "replica_list"
    rank: int


@dataclasses.dataclass(frozen=True)
class ReplicaFetch(_Message):
    op: ClassVar[str] = "replica_fetch"
    rank: int
    step: int


Message = Union[Hello, Persist, Flush, Bye, Term, TermStep, Damaged, Quarantine, Status, Listen, Peers, ReplicaList, ReplicaFetch]
OPS: Dict[str, Type[_Message]] = {cls.op: cls for cls in (Hello, Persist, Flush, Bye, Term, TermStep, Damaged, Quarantine,
                                                          Status, Listen, Peers, ReplicaList, ReplicaFetch)}
_TYPES: Dict[type, Dict[str, type]] = {}


def _field(op: str, name: str, kind: type, value: Any) -> Any:
    """``value`` checked as field ``name`` of ``op`` (ints are non-negative; a float may come as an int)."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadMessage(f"{op}: field {name!r} must be {kind.__name__}, got {str(value)[:40]!r}")
    # value is an instance of kind by now; the isinstance checks only tell the type checker so
    if kind is int and isinstance(value, int) and not 0 <= value < MAX_INT:
        raise BadMessage(f"{op}: field {name!r} = {value} is out of range")
    if kind is str and isinstance(value, str) and len(value) > MAX_TEXT:
        raise BadMessage(f"{op}: field {name!r} is too long")
    return value


def _types(cls: type) -> Dict[str, type]:
    if cls not in _TYPES:   # annotations are strings here (postponed evaluation): resolve them once
        hints = typing.get_type_hints(cls)
        _TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _TYPES[cls]


class Received(NamedTuple):
    message: Message
    key: Optional[str]     # the job's key, as the connection's first message carries it


def encode(msg: Message, key: Optional[str] = None) -> bytes:
    """One request line; ``key`` for the first message of a connection."""
    wire = msg.to_wire()
    if key is not None:
        wire["key"] = key
    return (json.dumps(wire) + "\n").encode()


def from_wire(obj: Any) -> Message:
    """The typed message of a decoded JSON value; BadMessage names the first bad field."""
    if not isinstance(obj, dict):
        raise BadMessage("a message is a JSON object")
    op = obj.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise BadMessage(f"unknown op {str(op)[:40]!r}")
    cls = OPS[op]
    values = {}
    for name, kind in _types(cls).items():     # in field order: the first bad field is the one named
        if name not in obj:
            raise BadMessage(f"{op}: field {name!r} is missing")
        values[name] = _field(op, name, kind, obj[name])
    return cls(**values)   # type: ignore[return-value]


def parse(line: bytes) -> Received:
    """One checked message from one line, with the key it carries (None when it carries none)."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise BadMessage(f"not JSON: {line[:80]!r}") from None
    msg = from_wire(obj)
    key = obj.get("key")
    return Received(msg, key if isinstance(key, str) else None)


__all__ = ["BadMessage", "Bye", "Damaged", "Flush", "Hello", "Listen", "Message", "OPS", "Peers", "Quarantine", "Persist", "Received", "ReplicaFetch", "ReplicaList", "Status", "Term", "TermStep", "encode", "from_wire", "parse"]
