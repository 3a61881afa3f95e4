"""The agent's replies (formats/protocol.py has the requests): frozen records, each checked field by field
once, where it is parsed, so that nothing downstream re-validates a dict.

    hello          HelloReply(ok, agent_pid, error)
    flush          FlushReply(ok, step, error)          the rank's shard of ``step`` is durable, or why not
    status         StatusReply(...)                     the agent's state (``easyckpt status``, the console)
    listen         ListenReply(ok, port, error)
    peers          PeersReply(ok, error)
    replica_list   ReplicaListReply(ok, steps, problems, error)
    replica_fetch  ReplicaFetchReply(ok, slot, bytes, seconds, node, error)
    error          ErrorReply(error)                    a request the agent refused (a bad field, no key)

On the wire each is one JSON object with ``op`` (the request's op, or "error") and ``ok``. A reply read
from the socket is untrusted: ``parse_reply`` raises BadMessage naming the first bad field, and the
trainer treats that as no answer.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type, Union

from easyckpt.errors import BadMessage

MAX_INT = 2 ** 62
MAX_TEXT = 8192
MAX_ITEMS = 4096


def _check(where: str, hint: Any, value: Any, lenient: bool = False) -> Any:
    """``value`` as the type ``hint`` says (int, float, str, bool, Any, Optional, List, Tuple, Dict with
    str or int keys, a reply record); JSON gives dict keys as strings, an int key is converted.
    ``lenient``: the items of a list or dict that fail are dropped instead (see StatusReply)."""
    if hint is int or hint is str or hint is bool or hint is float:
        return _scalar(where, hint, value)
    if hint is Any:
        return value
    origin, args = _shape(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(where, inner[0], value, lenient)
    if origin in (list, List):
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            raise BadMessage(f"{where} must be a list, got {str(value)[:40]!r}")
        items = [_try(f"{where}[{i}]", args[0], v, lenient) for i, v in enumerate(value)]
        return [v for v in items if v is not _BAD]
    if origin in (tuple, Tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise BadMessage(f"{where} must be {len(args)} values, got {str(value)[:40]!r}")
        return tuple(_check(f"{where}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    if origin in (dict, Dict):
        if not isinstance(value, dict) or len(value) > MAX_ITEMS:
            raise BadMessage(f"{where} must be an object, got {str(value)[:40]!r}")
        out = {}
        for k, v in value.items():
            try:
                key = _key(where, args[0], k)
            except BadMessage:
                if not lenient:
                    raise
                continue
            checked = _try(f"{where}[{k!r}]", args[1], v, lenient)
            if checked is not _BAD:
                out[key] = checked
        return out
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _record(hint, value, where, lenient)
    return _scalar(where, hint, value)


_SCALARS = (int, float, str, bool)
_SHAPES: Dict[int, Tuple[Any, Any, Tuple[Any, ...]]] = {}


def _shape(hint: Any) -> Tuple[Any, Tuple[Any, ...]]:
    """``hint``'s origin and arguments, worked out once per hint (a status reply checks about 80 values, each
    reply; typing's look-ups and its generics' hashing were half of the 0.45 ms a reply took to parse). Keyed
    by identity: the hints are the records' annotations, which live as long as the module (and are kept)."""
    got = _SHAPES.get(id(hint))
    if got is None or got[0] is not hint:
        got = _SHAPES[id(hint)] = (hint, typing.get_origin(hint), typing.get_args(hint))
    return got[1], got[2]


def _scalar(where: str, hint: Any, value: Any) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (isinstance(value, bool) and hint is not bool):
        raise BadMessage(f"{where} must be {getattr(hint, '__name__', hint)}, got {str(value)[:40]!r}")
    if hint is int and not 0 <= value < MAX_INT:      # pids, steps, ranks, bytes, ports: none is negative
        raise BadMessage(f"{where} = {value} is out of range")
    if hint is str and len(value) > MAX_TEXT:
        raise BadMessage(f"{where} is too long")
    return value


_BAD = object()


def _try(where: str, hint: Any, value: Any, lenient: bool) -> Any:
    try:
        return _check(where, hint, value, lenient)
    except BadMessage:
        if lenient:
            return _BAD
        raise


def _key(where: str, hint: Any, key: Any) -> Any:
    if hint is int:
        if isinstance(key, str) and key.isdigit() and len(key) < 19:
            return int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            return key
        raise BadMessage(f"{where}: key {str(key)[:20]!r} is not a number")
    if not isinstance(key, str):
        raise BadMessage(f"{where}: key {str(key)[:20]!r} is not a string")
    return key


_HINTS: Dict[type, Dict[str, Any]] = {}


def _hints(cls: type) -> Dict[str, Any]:
    if cls not in _HINTS:     # annotations are strings here (postponed evaluation): resolved once
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


R = typing.TypeVar("R")


def _record(cls: Type[R], obj: Any, where: str, lenient: bool = False) -> R:
    """A record from a JSON object, every field checked. ``lenient`` (a StatusReply: what the console
    shows, never what training depends on): a missing or bad field takes its default, a bad item of a
    list or dict is dropped, so one odd field does not hide the rest."""
    lenient = lenient or bool(getattr(cls, "LENIENT", False))
    if not isinstance(obj, dict):
        raise BadMessage(f"{where} must be an object")
    values = {}
    for f in dataclasses.fields(cls):      # type: ignore[arg-type]
        if f.name in obj:
            checked = _try(f"{where}.{f.name}", _hints(cls)[f.name], obj[f.name], lenient)
            if checked is not _BAD:
                values[f.name] = checked
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise BadMessage(f"{where}: field {f.name!r} is missing")
    return cls(**values)


def _wire(value: Any) -> Any:
    """A record's JSON form: records become objects, tuples lists, int keys strings."""
    if value is None or type(value) in _SCALARS:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_wire(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class _Reply:
    op: ClassVar[str]

    def to_wire(self) -> Dict[str, Any]:
        return {"op": self.op, **_wire(self)}


@dataclasses.dataclass(frozen=True)
class HelloReply(_Reply):
    op: ClassVar[str] = "hello"
    ok: bool
    agent_pid: Optional[int] = None
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class FlushReply(_Reply):
    op: ClassVar[str] = "flush"
    ok: bool
    step: int
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ListenReply(_Reply):
    op: ClassVar[str] = "listen"
    ok: bool
    port: Optional[int] = None
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class PeersReply(_Reply):
    op: ClassVar[str] = "peers"
    ok: bool
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ReplicaListReply(_Reply):
    """Lenient (_record): a step entry of the wrong shape is dropped, the others still serve."""
    op: ClassVar[str] = "replica_list"
    LENIENT: ClassVar[bool] = True
    ok: bool
    steps: List[Tuple[int, int, int]] = dataclasses.field(default_factory=list)   # [step, world_size, node]
    problems: List[str] = dataclasses.field(default_factory=list)
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ReplicaFetchReply(_Reply):
    op: ClassVar[str] = "replica_fetch"
    ok: bool
    slot: Optional[int] = None
    bytes: Optional[int] = None
    seconds: Optional[float] = None
    node: Optional[int] = None
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ErrorReply(_Reply):
    op: ClassVar[str] = "error"
    error: str
    ok: bool = False


@dataclasses.dataclass(frozen=True)
class SigtermStatus:
    seconds_ago: float = 0.0
    agreed_step: Optional[int] = None
    deadline_in: float = 0.0
    fallback_done: bool = False


@dataclasses.dataclass(frozen=True)
class ReplicaSent:
    step: int
    bytes: int
    seconds: float
    ranks: List[int]


@dataclasses.dataclass(frozen=True)
class ReplicaHeld:
    rank: int
    step: int
    bytes: int
    from_node: Optional[int]


@dataclasses.dataclass(frozen=True)
class ReplicaStatus:
    node: Optional[int] = None
    nnodes: Optional[int] = None
    factor: int = 1
    listening: Optional[str] = None
    targets: Dict[int, str] = dataclasses.field(default_factory=dict)        # holder node -> "address:port"
    sent: Dict[int, ReplicaSent] = dataclasses.field(default_factory=dict)   # holder node -> last step it got
    holds: List[ReplicaHeld] = dataclasses.field(default_factory=list)       # other nodes' replicas kept here
    every: int = 1
    errors: List[str] = dataclasses.field(default_factory=list)
    starved: Dict[int, str] = dataclasses.field(default_factory=dict)   # holder node -> why none reached it


@dataclasses.dataclass(frozen=True)
class StatusReply(_Reply):
    """The agent's state. Parsed leniently (_record): it feeds the console and ``easyckpt status``, and a
    field of the wrong shape must cost that field, never the rest nor an exception in training."""
    op: ClassVar[str] = "status"
    LENIENT: ClassVar[bool] = True
    ok: bool = True
    agent_pid: int = 0
    job_id: str = ""
    save_dir: str = ""
    world_size: Optional[int] = None
    coordinator: bool = False                  # this agent serves rank 0: it commits
    connected: List[int] = dataclasses.field(default_factory=list)
    dead_ranks: List[int] = dataclasses.field(default_factory=list)
    pending_commits: List[int] = dataclasses.field(default_factory=list)
    outstanding: int = 0
    last_error: Optional[str] = None
    leaving: bool = False
    failed_steps: Dict[int, str] = dataclasses.field(default_factory=dict)   # step -> why not committed
    # step -> why it is gone after its commit (this agent's retention deleted it): a trainer waiting for it stops
    deleted_steps: Dict[int, str] = dataclasses.field(default_factory=dict)
    refused: int = 0                           # hellos refused so far; the last few, said:
    last_refused: List[str] = dataclasses.field(default_factory=list)
    notices: int = 0                           # things rank 0's console must hear (a save dir replaced); the last few:
    last_notices: List[str] = dataclasses.field(default_factory=list)
    sigterm: Optional[SigtermStatus] = None
    commits: List[Tuple[int, int, float]] = dataclasses.field(default_factory=list)  # step, bytes, seconds
    replicas: ReplicaStatus = dataclasses.field(default_factory=ReplicaStatus)


Reply = Union[HelloReply, FlushReply, ListenReply, PeersReply, ReplicaListReply, ReplicaFetchReply, ErrorReply,
              StatusReply]
REPLIES: Dict[str, Type[_Reply]] = {cls.op: cls for cls in (HelloReply, FlushReply, ListenReply, PeersReply,
                                                            ReplicaListReply, ReplicaFetchReply, ErrorReply,
                                                            StatusReply)}


def encode_reply(reply: _Reply) -> bytes:
    """One line of the agent's answer."""
    return (json.dumps(reply.to_wire()) + "\n").encode()


def reply_from_wire(obj: Any) -> Reply:
    """The typed reply of a decoded JSON value; BadMessage names the first bad field."""
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str) or obj["op"] not in REPLIES:
        raise BadMessage(f"not a reply of the agent: {str(obj)[:80]!r}")
    return typing.cast(Reply, _record(REPLIES[obj["op"]], obj, obj["op"]))


def status_from_wire(obj: Any) -> StatusReply:
    """A status reply from its JSON object (the ``op`` may be left out)."""
    return _record(StatusReply, obj, "status")


def parse_reply(line: bytes) -> Reply:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise BadMessage(f"the agent's reply is not JSON: {line[:80]!r}") from None
    return reply_from_wire(obj)


def expect(reply: Optional[Reply], kind: Type[R]) -> R:
    """``reply`` as the record its request gets; an error reply (or another kind) becomes the BadMessage
    the caller reports."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, ErrorReply):
        raise BadMessage(reply.error)
    raise BadMessage(f"expected a {getattr(kind, 'op', kind)} reply, got {reply!r:.80}")
