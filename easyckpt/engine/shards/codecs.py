"""The trainer's halves of each shard format (formats/shardformat.py): how a shard's tree becomes a
skeleton and tensors for the slot (flatten), and how a verified file's bytes become a tree again (decode).
Here because both need torch; the slot check and the agent's write are keyed by the same enum."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from easyckpt.engine.shards import shardload
from easyckpt.engine.shards.safeload import safe_torch_load
from easyckpt.engine.shards.torchpickle import flatten_pickled
from easyckpt.engine.shards.tree import Tensors, flatten, flatten_dcp, flatten_raw, unflatten
from easyckpt.formats.shardformat import ShardFormat

Flatten = Callable[[Any], Tuple[Any, Tensors]]

FLATTEN: Dict[ShardFormat, Flatten] = {
    ShardFormat.SAFETENSORS: flatten, ShardFormat.TORCH: flatten_pickled, ShardFormat.RAW: flatten_raw,
    ShardFormat.DCP: flatten_dcp,
}


def _decode_safetensors(buf: Any) -> Any:
    skeleton, tensors = shardload.decode(buf)
    return unflatten(skeleton, tensors)


DECODE: Dict[ShardFormat, Callable[[Any], Any]] = {
    ShardFormat.SAFETENSORS: _decode_safetensors,
    ShardFormat.TORCH: safe_torch_load,
    ShardFormat.RAW: bytes,
    ShardFormat.DCP: lambda buf: None,   # checked; the framework's own reader takes the items it needs
}


def decode(buf: Any, fmt: object) -> Any:
    """The tree of one verified file of format ``fmt`` (a manifest's ``format`` value or a member)."""
    return DECODE[ShardFormat.parse(fmt)](buf)
