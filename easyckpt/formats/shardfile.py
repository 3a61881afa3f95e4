"""The shard file format: a valid safetensors file whose metadata carries the JSON skeleton.

Any safetensors tool reads the tensors; easyckpt's loader also rebuilds the exact state tree from
the skeleton. The format suits the persist path: after a small JSON header, the tensor bytes are
one contiguous run, copied straight from the snapshot slot to the file by the kernel.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from easyckpt.errors import CheckpointError

SKELETON_KEY = "easyckpt.skeleton"

# safetensors dtype names by torch dtype name: this module never imports torch (the agent only copies
# bytes); the trainer maps names back to torch dtypes in engine/shards/shardload.py
DTYPE_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
NAME_DTYPES = {sname: tname for tname, sname in DTYPE_NAMES.items()}

BLOCK = 4096            # a multiple of every logical block size in use (512 and 4096): shard data and
                        # torch.save records start on it so the agent can write them with O_DIRECT


def dtype_name(dtype: object) -> str:
    try:
        return DTYPE_NAMES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise TypeError(f"easyckpt cannot store tensors of dtype {dtype}") from None


def encode_header(entries: Sequence[Tuple[str, str, Sequence[int], int, int]], skeleton: Any,
                  data_phase: Optional[int] = None) -> bytes:
    """``entries``: (key, dtype name, shape, begin, end) with offsets relative to the data start,
    back to back in file order (safetensors rejects gaps).

    ``data_phase``: where the data section starts modulo the block size (4096), a multiple of 8. The persist path
    passes the data's offset in the snapshot slot, so that file and slot agree modulo the block size
    and the tensor bytes go from the slot to the disk without a copy (storage/direct.py). The header
    JSON is padded with spaces to get there, which safetensors allows."""
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", SKELETON_KEY: json.dumps(skeleton)}}
    for key, dtype, shape, begin, end in entries:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    # the data section stays 8-byte aligned for zero-copy readers
    phase, modulus = (0, 8) if data_phase is None else (data_phase % BLOCK, BLOCK)
    assert phase % 8 == 0, data_phase
    raw += b" " * ((phase - 8 - len(raw)) % modulus)
    return struct.pack("<Q", len(raw)) + raw


def parse(buf: Union[bytes, bytearray, memoryview]) -> Tuple[Any, List[Tuple[str, str, List[int], int, int]]]:
    """The skeleton and the tensor entries (key, dtype name, shape, begin, end; offsets into ``buf``) of
    a whole shard held in ``buf``. Every range is checked to lie inside ``buf``; turning entries into
    tensors is the trainer's part (engine/shards/shardload.py)."""
    if len(buf) < 8:
        raise CheckpointError("shard is shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > len(buf) - 8:
        raise CheckpointError(f"shard header length {n} exceeds the file size {len(buf)}")
    header = json.loads(bytes(buf[8:8 + n]))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    entries = []
    for key, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in NAME_DTYPES:
            raise CheckpointError(f"unknown tensor dtype {info['dtype']!r} in shard")
        if base + end > len(buf) or begin > end:
            raise CheckpointError(f"tensor {key} lies outside the shard")
        entries.append((key, info["dtype"], info["shape"], base + begin, base + end))
    skeleton = json.loads(meta[SKELETON_KEY]) if SKELETON_KEY in meta else {k: {"__t": k} for k in header}
    return skeleton, entries


def file_entries(tensors: Sequence[Tuple[str, str, List[int], int, int]], region_start: int
                 ) -> List[Tuple[str, str, List[int], int, int]]:
    """Translate slot offsets to offsets relative to the file's data section."""
    return [(k, d, s, b - region_start, e - region_start) for k, d, s, b, e in tensors]
