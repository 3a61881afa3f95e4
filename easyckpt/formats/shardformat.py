"""The shard formats: the one place their names are written (slot metadata's ``fmt``, the manifest's
``format``) and where a file's format is told from its name.

    SAFETENSORS  easyckpt's own shard file (formats/shardfile.py): a safetensors file carrying the skeleton
    TORCH        a framework-native torch.save file (Megatron's and DeepSpeed's layouts), assembled by the
                 agent from the trainer's pickle and the slot's bytes (formats/torchzip.py)
    RAW          bytes written as they are (JSON state, small files)
    DCP          a torch.distributed.checkpoint data file: its items back to back, each its own torch.save
                 archive or bytes (Megatron's torch_dist layout)

Each format has three halves, each a table keyed by this enum, in the process that runs it: the check of
a slot's skeleton (formats/slotmeta.py, both processes), the write of its file (storage/nativefiles.py: the agent's
persist, and a trainer writing a resharded step out of memory) and the trainer's flatten and decode
(engine/shards/codecs.py, where torch is). tests/test_formats.py checks that every table has every member, so a
new format is one member here plus its halves, and nothing else dispatches on a name.
"""
from __future__ import annotations

import enum
from typing import Tuple

_TORCH_SUFFIXES: Tuple[str, ...] = (".pt", ".pth", ".bin")


class ShardFormat(str, enum.Enum):
    SAFETENSORS = "safetensors"
    TORCH = "torch"
    RAW = "raw"
    DCP = "dcp"

    @classmethod
    def parse(cls, value: object) -> "ShardFormat":
        """The member a wire or file value names; ValueError (naming the choices) for anything else."""
        if type(value) is cls:      # a member already (every shard of every snapshot): no search
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        raise ValueError(f"{str(value)[:40]!r} is not one of {', '.join(m.value for m in cls)}")

    @classmethod
    def of_filename(cls, rel: str) -> "ShardFormat":
        """The format a file of a framework's own step (no easyckpt manifest) has, by its name."""
        if rel.endswith(".safetensors"):
            return cls.SAFETENSORS
        if rel.endswith(_TORCH_SUFFIXES):
            return cls.TORCH
        return cls.RAW

    def __str__(self) -> str:
        return self.value


NAMES: Tuple[str, ...] = tuple(m.value for m in ShardFormat)
DEFAULT = ShardFormat.SAFETENSORS
