"""Part of a torch.save file easyckpt's agent wrote, read from a step directory: its pickle, then only the
storages a caller picks (a reshard of Megatron's torch layout needs a few of every old rank's tensors).

The agent lists such a file's items in the manifest (agent/stepwriter.py): first the head (every record
before the first storage's bytes, the pickle among them), then each storage's bytes. The head is read and
checked, its pickle loaded through the weights-only unpickler with every storage on the meta device; the
caller's ``pick`` is asked about each tensor (its path in the tree); the storages of the picked ones are
read and checked, and the tree is loaded again with them. Tensors not picked stay meta tensors: they
hold no bytes, and a caller that copies from one fails instead of reading zeros.
"""
from __future__ import annotations

import io
import pickle
import struct
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from easyckpt.engine.shards.safeload import weights_only_load
from easyckpt.errors import CheckpointError
from easyckpt.formats import torchzip
from easyckpt.formats.manifest import Item, Manifest
from easyckpt.storage import stepfiles

# (a tensor's path in the file's tree, the tree, the trees of files read before this one) -> read it?
Pick = Callable[[Tuple[Any, ...], Any, Dict[str, Any]], bool]
_LOCAL = struct.Struct("<IHHHHHIIIHH")


def read(step_dir: str, rel: str, manifest: Manifest, pick: Pick, trees: Dict[str, Any],
         on_bytes: Optional[Callable[[int], None]] = None) -> Tuple[Any, Optional[str], int]:
    """(the tree with the picked tensors, the first problem or None, bytes read)."""
    items = manifest.entry(rel).items or ()
    if not items or items[0].offset != 0 or not items[0].ident or items[0].ident[0] != torchzip.HEAD:
        return None, f"{rel}: its manifest items do not begin with the file's head ({torchzip.HEAD})", 0
    storages = items[1:]
    got: Dict[int, bytearray] = {}
    problem, nbytes = stepfiles.read_items(step_dir, rel, manifest, [0], on_bytes, keep=got)
    if problem:
        return None, problem, nbytes
    try:
        pkl = _pickle_of(got.pop(0), rel)
        index: Dict[int, int] = {}       # a meta storage's identity -> its record

        def meta(pid: Any) -> Any:
            dtype, i, nbytes_ = _record(pid, storages, rel)
            us = torch.UntypedStorage(nbytes_, device="meta")
            index[us._cdata] = i
            return torch.storage.TypedStorage(wrap_storage=us, dtype=dtype, _internal=True)

        tree = weights_only_load(io.BytesIO(pkl), meta)
        wanted = sorted({index[t.untyped_storage()._cdata] for path, t in _tensors(tree, ())
                         if pick(path, tree, trees)})
    except CheckpointError as exc:
        return None, str(exc), nbytes
    except (pickle.UnpicklingError, EOFError, struct.error) as exc:    # a pickle that matched its checksum
        return None, f"{rel}: unreadable ({exc})", nbytes
    problem, n = stepfiles.read_items(step_dir, rel, manifest, [1 + i for i in wanted], on_bytes, keep=got)
    nbytes += n
    if problem:
        return None, problem, nbytes

    def storage(pid: Any) -> Any:
        dtype, i, nbytes_ = _record(pid, storages, rel)
        buf = got.get(1 + i)
        us = torch.UntypedStorage(nbytes_, device="meta") if buf is None else \
            torch.frombuffer(buf, dtype=torch.uint8).untyped_storage() if nbytes_ else torch.UntypedStorage(0)
        return torch.storage.TypedStorage(wrap_storage=us, dtype=dtype, _internal=True)

    try:
        return weights_only_load(io.BytesIO(pkl), storage), None, nbytes
    except (CheckpointError, pickle.UnpicklingError, EOFError) as exc:
        return None, str(exc), nbytes


def _pickle_of(head: bytearray, rel: str) -> bytes:
    """The pickle in the head item: the archive's first record, stored (not compressed)."""
    if len(head) < _LOCAL.size:
        raise CheckpointError(f"{rel}: its head item is too short for a zip record")
    sig, _ver, _flags, method, _t, _d, _crc, size, usize, nlen, xlen = _LOCAL.unpack_from(head, 0)
    start = _LOCAL.size + nlen + xlen
    name = bytes(head[_LOCAL.size:_LOCAL.size + nlen])
    if sig != 0x04034B50 or method != 0 or size != usize or name != torchzip.HEAD.encode() \
            or start + size > len(head):
        raise CheckpointError(f"{rel}: its head item does not begin with a stored {torchzip.HEAD} record")
    return bytes(head[start:start + size])


def _record(pid: Any, storages: Sequence[Item], rel: str) -> Tuple[torch.dtype, int, int]:
    """A persistent id ("storage", storage type, record number, location, elements): (dtype, record,
    bytes), the record's item of the size the pickle says."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)
            and pid[2].isdigit() and type(pid[4]) is int and pid[4] >= 0):
        raise CheckpointError(f"{rel}: a storage reference of the pickle is malformed")
    dtype = getattr(pid[1], "dtype", None) if not isinstance(pid[1], torch.dtype) else pid[1]
    i = int(pid[2])
    if not isinstance(dtype, torch.dtype) or i >= len(storages):
        raise CheckpointError(f"{rel}: the pickle refers to storage {pid[2]}, which its items do not list")
    nbytes = pid[4] * torch.empty((), dtype=dtype).element_size()
    if storages[i].length != nbytes:
        raise CheckpointError(f"{rel}: storage {i} is {storages[i].length} bytes in the manifest, the pickle says "
                              f"{nbytes}")
    return dtype, i, nbytes


def _tensors(obj: Any, path: Tuple[Any, ...]) -> Iterator[Tuple[Tuple[Any, ...], torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from _tensors(v, path + (k,))
