"""DCP's StorageReader over one rank's FSDP2 snapshot in memory (easyckpt/dtensor.py's restore without a
committed step): DCP's own load then reshards nothing and reads only what this rank held. A module of its own
because defining it imports torch.distributed.checkpoint (most of a second in a worker), which a job that
never restores a DTensor model from memory should not pay at import."""
from __future__ import annotations

import io
import re
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from easyckpt.engine.load.dcp import data_file
from easyckpt.errors import CheckpointError


def _ranks_held(trees: Dict[str, Any], local: str, prefix: str) -> List[int]:
    """The ranks whose LOCAL file (``local``, a format of the rank) is in ``trees``."""
    pattern = re.compile(re.escape(prefix + local).replace(r"\{:05d\}", r"(\d{5})") + "$")
    return sorted(int(m.group(1)) for m in map(pattern.match, trees) if m)


class MemoryReader(StorageReader):
    """DCP's StorageReader over memory snapshots: every item each snapshot in ``trees`` held (what its rank
    wrote and what it kept in LOCAL). This rank's own snapshot: the same layout as now, nothing resharded. The
    snapshots of every rank of a run of another world size (engine/load/resharded.py): the reader's metadata
    lists every chunk they hold, and DCP's planner reshards from them as from a committed step."""

    def __init__(self, trees: Dict[str, Any], rank: int, local: str, prefix: str = ""):
        super().__init__()
        self.items: Dict[Tuple[str, Tuple[int, ...]], Any] = {}
        self.sizes: Dict[str, List[int]] = {}
        held = _ranks_held(trees, local, prefix) or [rank]
        for r in held:
            mine = trees[prefix + local.format(r)]
            pools = {"d": trees[prefix + data_file(r)], "l": mine["local"]}
            for fqn, offsets, kind, pos, size in mine["index"]:
                pool = pools.get(kind)
                if pool is None or type(pos) is not int or not 0 <= pos < len(pool):
                    raise CheckpointError(f"the snapshot's index places {fqn} at {kind!r} {pos!r}, which it does "
                                          f"not hold")
                # a chunk more than one rank held (a replicated one) is the same on each: the first serves
                self.items.setdefault((fqn, tuple(offsets or ())), pool[pos])
                if size is not None:
                    self.sizes[fqn] = size

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        md: Dict[str, Any] = {}
        for (fqn, offsets), value in self.items.items():
            if not isinstance(value, torch.Tensor):
                md[fqn] = BytesStorageMetadata()
                continue
            entry = md.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=value.dtype),
                                                             torch.Size(self.sizes.get(fqn, value.shape)), []))
            entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), value.shape))
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: Any) -> Any:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        for ri in plan.items:
            value = self.items.get((ri.storage_index.fqn, tuple(ri.storage_index.offset or ())))
            if value is None:
                raise CheckpointError(f"the snapshot in memory has no {ri.storage_index.fqn} at "
                                      f"{list(ri.storage_index.offset or ())}: it was taken on another layout")
            if ri.type == LoadItemType.BYTE_IO:
                planner.load_bytes(ri, io.BytesIO(bytes(value)))
                continue
            source = value
            for dim, (offset, length) in enumerate(zip(ri.storage_offsets, ri.lengths)):
                source = source.narrow(dim, offset, length)
            target = planner.resolve_tensor(ri).detach()
            target.copy_(source)
            planner.commit_tensor(ri, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
