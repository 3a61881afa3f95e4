"""torch.distributed.checkpoint's (DCP's) file layout, as easyckpt writes it for Megatron's torch_dist
(megatron/torchdist.py) and for models whose state is DTensors (dtensor.py): one ``__{rank}_0.distcp`` per
rank holding its items back to back (the agent writes them: agent/stepwriter.py), and ``.metadata``, DCP's
pickled Metadata, written by rank 0 from every rank's item list. DCP's own FileSystemReader (and Megatron's
loader, which uses it) reads the result.

An item list ("described") is, per item in file order: ``["t", key, global offsets, sizes, dtype, global
shape, bytes]`` for a tensor chunk, ``["o", key, bytes]`` for an object (a torch.save archive).
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Collection, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from easyckpt.errors import CheckpointError

DCP_METADATA = ".metadata"


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def data_files(listed: Iterable[str]) -> List[str]:
    """The data files among a step's listed names (``__{rank}_0.distcp``), in order."""
    return sorted(rel for rel in listed if rel.startswith("__") and rel.endswith("_0.distcp")
                  and rel[2:-len("_0.distcp")].isdigit())


def checked_by(listed: Iterable[str], rank: int, world_size: int) -> List[str]:
    """The data files rank ``rank`` checks in full before DCP's reader takes what it needs from them: those
    whose number is ``rank`` modulo the world size, so that each is checked once, on any world size."""
    return [rel for rel in data_files(listed) if int(rel[2:-len("_0.distcp")]) % world_size == rank]


def reader_files(prefix: str = "", extra: Collection[str] = ()) -> Callable[[str], bool]:
    """Whether DCP's reader opens a step's listed file ``rel`` when it loads the checkpoint under ``prefix``:
    ``.metadata`` and the data files there, and ``extra`` (Megatron's loader also reads common.pt and
    metadata.json)."""
    def opened(rel: str) -> bool:
        if rel in extra:
            return True
        name = rel[len(prefix):] if rel.startswith(prefix) else None
        return name is not None and (name == DCP_METADATA or bool(data_files([name])))
    return opened


# per key, the (global offsets, sizes) of the chunks a load asks for
Boxes = Dict[str, List[Tuple[List[int], List[int]]]]
# whether a load reads a saved item of a data file, given its manifest identity (wanted_items)
Wanted = Callable[[Optional[Sequence[Any]]], bool]


def boxes_of(chunks: Iterable[Tuple[str, Sequence[int], Sequence[int]]]) -> Boxes:
    by_key: Boxes = {}
    for key, offsets, sizes in chunks:
        by_key.setdefault(key, []).append((list(offsets), list(sizes)))
    return by_key


def wanted_items(boxes: Boxes, objects: Optional[Collection[str]]) -> Wanted:
    """Whether a load that asks for the tensor chunks ``boxes`` and the objects named ``objects`` (None: every
    object) reads a saved item, given its manifest identity ``[key, offsets, sizes]`` (``[key, None, None]``
    for an object): a chunk of the same key that overlaps one of the boxes, as DCP's planner matches them. An
    item of unknown identity is taken."""
    def wanted(ident: Optional[Sequence[Any]]) -> bool:
        if ident is None:
            return True
        if ident[1] is None:
            return objects is None or ident[0] in objects
        return any(len(o) == len(ident[1]) and all(a < b + m and b < a + n
                                                   for a, n, b, m in zip(ident[1], ident[2], o, s))
                   for o, s in boxes.get(ident[0], []))
    return wanted


def gather_to_zero(described: List[List[Any]]) -> Optional[List[List[List[Any]]]]:
    """Every rank's item list, on rank 0 (None elsewhere): the checkpoint's metadata names them all."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [described]
    rank = torch.distributed.get_rank()
    out: Optional[List[Any]] = [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object(described, out, dst=0)
    return out


def metadata(per_rank: List[List[List[Any]]]) -> bytes:
    """torch.distributed.checkpoint's Metadata for the items of every rank's ``__{r}_0.distcp``, pickled."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    tensors: Dict[str, Any] = {}
    storage: Dict[Any, Any] = {}
    for rank, described in enumerate(per_rank):
        offset = 0
        for d in described:
            if d[0] == "t":
                _, key, offsets, sizes, dtype, shape, n = d
                md = tensors.get(key)
                if md is None:
                    md = tensors[key] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, dtype)),
                                                              torch.Size(shape), [])
                elif list(md.size) != shape:
                    raise CheckpointError(f"{key}: rank {rank} saves global shape {shape}, another {list(md.size)}")
                md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                storage[MetadataIndex(key, offsets)] = _StorageInfo(data_file(rank), offset, n)
            else:
                _, key, n = d
                tensors[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = _StorageInfo(data_file(rank), offset, n)
            offset += n
    # DCP's reader (and Megatron's) leaves what no chunk covers as it was (garbage): never commit such a checkpoint
    for key, md in tensors.items():
        if isinstance(md, TensorStorageMetadata):
            covered = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
            if covered != md.size.numel():
                raise CheckpointError(f"{key}: the ranks' chunks hold {covered} of its {md.size.numel()} "
                                      f"elements; a DCP checkpoint must cover every tensor once")
    return pickle.dumps(Metadata(state_dict_metadata=tensors, planner_data=None, storage_data=storage))
