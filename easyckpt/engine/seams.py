"""What the engine is given rather than builds: how it reaches the node's agent (AgentLink), how the ranks
agree (Group) and what time it is (Clock). Production wires a socket client (client.py), torch.distributed
(dist.py) and the system clock; easyckpt/_testing/ wires the real Agent in this process and ranks as
threads, so the engine's behaviours can be tested in one interpreter."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Protocol, Type, TypeVar, Union

from easyckpt.formats.protocol import Message
from easyckpt.formats.replies import Reply, StatusReply

R = TypeVar("R")
Payload = Union[bytearray, memoryview]      # bytes one rank sent another (Group.exchange), this process's own


class AgentLink(Protocol):
    """The trainer's end of the agent protocol (formats/protocol.py, formats/replies.py)."""

    agent_pid: Optional[int]

    def send(self, msg: Message) -> None:
        """One message on this rank's connection; AgentError when it cannot be delivered."""

    def request(self, msg: Message, kind: Type[R], timeout: float) -> R:
        """A message and its reply of type ``kind``; AgentError when none comes within ``timeout``."""

    def side(self, msg: Message, timeout: float = 2.0) -> Optional[Reply]:
        """A message on a connection of its own (threads other than training's); None when no agent answers."""

    def status(self, timeout: float) -> Optional[StatusReply]:
        """The agent's status, checked; None when none answers in ``timeout``."""

    def alive(self) -> bool:
        """Whether the agent this rank attached to still runs (no message)."""

    def reattach(self, why: str) -> None:
        """The agent died: start a new one and attach to it."""

    def close(self) -> None: ...


class Group(Protocol):
    """Where this process sits in the job, and the agreement the engine needs."""

    rank: int
    world_size: int
    local_rank: int

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order; an error (never a hang) when a rank is gone."""

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (this rank's own when no collective can run)."""

    def exchange(self, sends: Dict[int, List[memoryview]], sizes: Dict[int, List[int]]) -> Dict[int, List[Payload]]:
        """Point-to-point messages, a collective of every rank: ``sends`` (destination rank -> its payloads, in
        order), ``sizes`` (source rank -> the byte sizes of what it sends this rank, in order, as every rank's plan
        says); returns what arrived, by source. An error (never a hang) when a rank is gone."""


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
