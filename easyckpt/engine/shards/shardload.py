"""Tensors out of bytes the formats describe: a shard file (formats/shardfile.py) or a snapshot slot's
data region (formats/slotmeta.py). The torch half of those formats, kept on the trainer side so that
nothing under formats/ imports torch.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Iterable, List, Sequence, Tuple, Union

import torch

from easyckpt.errors import CheckpointError
from easyckpt.formats import shardfile

Entry = Tuple[str, str, Sequence[int], int, int]     # key, dtype name, shape, begin, end


@functools.lru_cache(maxsize=None)
def torch_dtype(name: str) -> torch.dtype:
    try:
        return getattr(torch, shardfile.NAME_DTYPES[name])
    except KeyError:
        raise CheckpointError(f"unknown tensor dtype {name!r} in shard") from None


def views(base: torch.Tensor, entries: Iterable[Entry]) -> List[torch.Tensor]:
    """Each entry as a view into the uint8 tensor ``base`` (no copy)."""
    return [base[b:e].view(torch_dtype(dtype)).view(list(shape)) for _key, dtype, shape, b, e in entries]


def decode(buf: Union[bytearray, memoryview]) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """Parse a whole shard held in ``buf``; tensors are views into ``buf`` (no copy)."""
    skeleton, entries = shardfile.parse(buf)
    tensors: Dict[str, torch.Tensor] = {}
    for key, name, shape, begin, end in entries:
        dtype = torch_dtype(name)
        if end == begin:
            tensors[key] = torch.empty(shape, dtype=dtype)
        else:
            tensors[key] = torch.frombuffer(buf, dtype=dtype, offset=begin,
                                            count=(end - begin) // dtype.itemsize).view(shape)
    return skeleton, tensors
