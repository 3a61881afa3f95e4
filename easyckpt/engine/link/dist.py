"""Where this process sits in the job, and the one collective the engine needs (agreement)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List

import torch.distributed as dist

from easyckpt.errors import EasyCkptError
from easyckpt.engine.seams import Payload


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int


def placement() -> Placement:
    """From torch.distributed when initialised, else from torchrun's environment, else a single process."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return Placement(rank, world, int(os.environ.get("LOCAL_RANK", rank if world == 1 else 0)))


def all_gather(obj: Any, world_size: int) -> List[Any]:
    """Every rank's ``obj``. Bounded by the process group's timeout, so a dead rank is an error, not a hang."""
    if world_size == 1:
        return [obj]
    if not (dist.is_available() and dist.is_initialized()):
        raise EasyCkptError(f"WORLD_SIZE={world_size} but torch.distributed is not initialised: call "
                            f"torch.distributed.init_process_group() before load_checkpoint so that all "
                            f"ranks can agree on the step to resume from")
    out: List[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, world_size: int) -> bool:
    """True when ``flag`` is true on some rank. Without a process group (single process, or after it was
    destroyed) only this rank's answer is known, and no collective could run anyway."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return flag
    return any(all_gather(bool(flag), world_size))


def exchange(sends: Dict[int, List[memoryview]], sizes: Dict[int, List[int]]) -> Dict[int, List[Payload]]:
    """Group.exchange over the job's process group: one batch of sends and receives, bounded by its timeout. On
    NCCL the bytes travel through this rank's GPU (NCCL moves nothing else); on gloo straight from memory."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    ops, arrived = [], {}
    for dst, payloads in sorted(sends.items()):
        for tag, data in enumerate(payloads):
            if len(data):
                # gloo reads the buffer in place; the payload outlives the batch (the caller holds it)
                tensor = torch.frombuffer(data, dtype=torch.uint8)
                ops.append(dist.P2POp(dist.isend, tensor.to(device) if device else tensor, dst, tag=tag))
    landed: Dict[int, List[bytearray]] = {}
    for src, lengths in sorted(sizes.items()):
        # received into memory Python owns (a bytearray), which outlives any tensor made over it
        landed[src] = [bytearray(n) for n in lengths]
        arrived[src] = [torch.frombuffer(b, dtype=torch.uint8) if len(b) else torch.empty(0, dtype=torch.uint8)
                        for b in landed[src]]
        if device is not None:
            arrived[src] = [t.to(device) for t in arrived[src]]
        ops.extend(dist.P2POp(dist.irecv, t, src, tag=tag) for tag, t in enumerate(arrived[src]) if t.numel())
    for req in (dist.batch_isend_irecv(ops) if ops else []):
        req.wait()
    if device is not None:      # (NCCL: the one copy back from the GPU)
        for src, got in arrived.items():
            for b, t in zip(landed[src], got):
                if len(b):
                    torch.frombuffer(b, dtype=torch.uint8).copy_(t.cpu())
    return {src: list(bufs) for src, bufs in landed.items()}


class TorchGroup:
    """The production Group (seams.py): this process's place from torch.distributed or torchrun's
    environment, and its collectives."""

    def __init__(self) -> None:
        where = placement()
        self.rank, self.world_size, self.local_rank = where.rank, where.world_size, where.local_rank

    def all_gather(self, obj: Any) -> List[Any]:
        return all_gather(obj, self.world_size)

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag, self.world_size)

    def exchange(self, sends: Dict[int, List[memoryview]], sizes: Dict[int, List[int]]) -> Dict[int, List[Payload]]:
        return exchange(sends, sizes) if self.world_size > 1 else {}
