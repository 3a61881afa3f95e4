"""Ranks as threads of one process: an engine/seams.py Group whose all_gather meets at a barrier, and a
runner that gives each rank its thread and re-raises what any of them raised."""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, TypeVar

from easyckpt.engine.seams import Payload

T = TypeVar("T")
WAIT = 60.0      # seconds a rank waits for the others at a collective before it is an error


class _Meeting:
    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size, timeout=WAIT)
        self.values: List[Any] = [None] * world_size


class ThreadGroup:
    def __init__(self, meeting: _Meeting, rank: int, world_size: int, local_rank: Optional[int] = None):
        self._meeting, self.rank, self.world_size = meeting, rank, world_size
        self.local_rank = rank if local_rank is None else local_rank

    def all_gather(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        m = self._meeting
        m.barrier.wait()           # nobody still reads the previous round
        m.values[self.rank] = obj
        m.barrier.wait()           # every rank wrote this round
        return list(m.values)

    def any_rank(self, flag: bool) -> bool:
        return any(self.all_gather(bool(flag)))

    def exchange(self, sends: Dict[int, List[memoryview]], sizes: Dict[int, List[int]]) -> Dict[int, List[Payload]]:
        posted = self.all_gather({dst: [bytearray(p) for p in payloads] for dst, payloads in sends.items()})
        got = {src: posted[src].get(self.rank, []) for src in sizes}
        for src, lengths in sizes.items():
            if [len(p) for p in got[src]] != lengths:
                raise RuntimeError(f"rank {self.rank}: rank {src} sent {[len(p) for p in got[src]]} bytes, "
                                   f"expected {lengths}")
        return got


def groups(world_size: int) -> List[ThreadGroup]:
    meeting = _Meeting(world_size)
    return [ThreadGroup(meeting, r, world_size) for r in range(world_size)]


def run_ranks(world_size: int, body: Callable[[ThreadGroup], T], timeout: float = 120.0) -> List[T]:
    """``body(group)`` on one thread per rank; their results in rank order. The first exception any rank
    raised is raised here (the others are released from their barrier)."""
    gs = groups(world_size)
    results: List[Any] = [None] * world_size
    errors: List[BaseException] = []

    def run(g: ThreadGroup) -> None:
        try:
            results[g.rank] = body(g)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
            g._meeting.barrier.abort()

    threads = [threading.Thread(target=run, args=(g,), name=f"rank{g.rank}", daemon=True) for g in gs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{t.name} did not finish within {timeout:g}s")
    if errors:
        raise errors[0]
    return results
