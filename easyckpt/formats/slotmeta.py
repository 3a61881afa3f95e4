"""The metadata region of a snapshot slot: what a reader (the agent, a loader) accepts from it.

A slot lives in /dev/shm, so its metadata is input: it is parsed as JSON (never unpickled) and every
field is checked before it is used, in the manner of safetensors' validate(): file names are safe
relative paths (paths.py), each file's tensors lie back to back inside the slot's data region, each
tensor's byte count equals its shape times its dtype's size, and each file's skeleton has the form
its format needs. A violation raises BadSlotMeta naming the field.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple

from easyckpt.errors import BadSlotMeta, UnsafePath
from easyckpt.formats.paths import check_relpath
from easyckpt.formats.shardformat import DEFAULT, NAMES, ShardFormat

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}
MAX_DIMS = 64


def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadSlotMeta(f"{what} = {value!r} is not an integer >= {low}")
    return value


class TensorSpan(NamedTuple):
    """One tensor's bytes in the slot: [key, dtype, shape, begin, end] on the wire."""
    key: str
    dtype: str                 # a safetensors dtype name (ITEMSIZE)
    shape: List[int]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class SlotFile:
    """One file of a snapshot: where its tensors lie in the slot, its format and skeleton (the rest of its
    tree, checked by its format's SKELETON_CHECKS), and whether the agent persists it."""
    relpath: str
    persist: bool
    fmt: ShardFormat
    start: int
    end: int
    tensors: Tuple[TensorSpan, ...]
    skeleton: Any

    def ranges(self) -> Dict[str, Tuple[int, int]]:
        """key -> (begin, end) of each tensor in the slot."""
        return {t.key: (t.begin, t.end) for t in self.tensors}


@dataclasses.dataclass(frozen=True)
class SlotMeta:
    """A complete slot's checked metadata."""
    step: int
    files: Tuple[SlotFile, ...]
    info: Mapping[str, Any]            # what the adapter recorded (merged into the manifest's "info")

    @property
    def layout(self) -> Optional[str]:
        """The parallel layout the adapter recorded, if a string (a snapshot of another one is not used)."""
        value = self.info.get("layout")
        return value if isinstance(value, str) else None


def parse(raw: bytes, step: int, data_begin: int, data_end: int) -> SlotMeta:
    """The checked metadata of a slot whose header says ``step`` and whose data region is
    [data_begin, data_end)."""
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadSlotMeta(f"metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise BadSlotMeta("metadata is not a JSON object")
    if meta.get("step") != step:
        raise BadSlotMeta(f"metadata step {meta.get('step')!r} != header step {step}")
    files, skeletons = meta.get("files"), meta.get("skeletons")
    if not isinstance(files, list) or not isinstance(skeletons, dict):
        raise BadSlotMeta("metadata lacks a 'files' list or a 'skeletons' object")
    info = meta.get("info", {})
    if not isinstance(info, dict):
        raise BadSlotMeta("metadata 'info' is not an object")
    seen = set()
    out = []
    for n, f in enumerate(files):
        checked = _check_file(f, n, skeletons, data_begin, data_end)
        if checked.relpath in seen:
            raise BadSlotMeta(f"file {checked.relpath!r} appears twice")
        seen.add(checked.relpath)
        out.append(checked)
    return SlotMeta(step, tuple(out), info)


def _check_file(f: Any, n: int, skeletons: Dict[str, Any], data_begin: int, data_end: int) -> SlotFile:
    if not isinstance(f, dict):
        raise BadSlotMeta(f"files[{n}] is not an object")
    try:
        rel = check_relpath(f.get("relpath"))
    except UnsafePath as exc:
        raise BadSlotMeta(f"files[{n}]: {exc}") from None
    if not isinstance(f.get("persist"), bool) or f.get("fmt", DEFAULT.value) not in NAMES:
        raise BadSlotMeta(f"{rel}: 'persist' is not a boolean or 'fmt' is not one of {NAMES}")
    fmt = ShardFormat.parse(f.get("fmt", DEFAULT.value))
    start, end = _int(f.get("start"), f"{rel}: start"), _int(f.get("end"), f"{rel}: end")
    if not data_begin <= start <= end <= data_end:
        raise BadSlotMeta(f"{rel}: bytes [{start}, {end}) lie outside the data region [{data_begin}, {data_end})")
    tensors = f.get("tensors")
    if not isinstance(tensors, list):
        raise BadSlotMeta(f"{rel}: 'tensors' is not a list")
    pos: int = start
    keys: Set[str] = set()
    spans: List[TensorSpan] = []
    for t in tensors:
        if not (isinstance(t, list) and len(t) == 5 and isinstance(t[0], str) and t[1] in ITEMSIZE
                and isinstance(t[2], list) and len(t[2]) <= MAX_DIMS):
            raise BadSlotMeta(f"{rel}: tensor entry {str(t)[:120]} is not [key, dtype, shape, begin, end]")
        key, dtype, shape, b, e = t
        numel = 1
        for d in shape:
            numel *= _int(d, f"{rel}: {key} dimension")
        if b != pos or _int(e, f"{rel}: {key} end") - _int(b, f"{rel}: {key} begin") != numel * ITEMSIZE[dtype]:
            raise BadSlotMeta(f"{rel}: tensor {key} at [{b}, {e}) is not {numel} x {ITEMSIZE[dtype]} bytes "
                              f"right after the previous one (at {pos})")
        pos = e
        keys.add(key)
        spans.append(TensorSpan(key, dtype, list(shape), b, e))
    if pos != end:
        raise BadSlotMeta(f"{rel}: tensors end at {pos}, the file's region at {end}")
    SKELETON_CHECKS[fmt](rel, skeletons.get(rel), keys, tensors, rel in skeletons)
    return SlotFile(rel, f["persist"], fmt, start, end, tuple(spans), skeletons.get(rel))


def _check_torch(rel: str, skeleton: Any, keys: Set[str], tensors: List[Any], present: bool) -> None:
    if not (isinstance(skeleton, dict) and isinstance(skeleton.get("__torchzip"), str)
            and isinstance(skeleton.get("storages"), list)):
        raise BadSlotMeta(f"{rel}: a torch shard's skeleton lacks its pickle or storage list")
    _b64(skeleton["__torchzip"], rel)
    if any(k not in keys for k in skeleton["storages"]):
        raise BadSlotMeta(f"{rel}: the skeleton names a storage that is not among the file's tensors")


def _check_raw(rel: str, skeleton: Any, keys: Set[str], tensors: List[Any], present: bool) -> None:
    if not (isinstance(skeleton, dict) and isinstance(skeleton.get("__raw"), str)) or tensors:
        raise BadSlotMeta(f"{rel}: a raw shard's skeleton is not {{'__raw': base64}}")
    _b64(skeleton["__raw"], rel)


def _check_dcp(rel: str, skeleton: Any, keys: Set[str], tensors: List[Any], present: bool) -> None:
    entries = skeleton.get("__dcp") if isinstance(skeleton, dict) else None
    if not isinstance(entries, list):
        raise BadSlotMeta(f"{rel}: a distcp shard's skeleton lacks its item list")
    for e in entries:
        if isinstance(e, dict) and "id" in e:
            e = dict(e)
            ident = e.pop("id")
            if not item_id_ok(ident):
                raise BadSlotMeta(f"{rel}: distcp item id {str(ident)[:120]} is not [name, offsets, sizes]")
        if isinstance(e, dict) and set(e) == {"b"} and isinstance(e["b"], str):
            _b64(e["b"], rel)
        elif (isinstance(e, dict) and set(e) == {"t", "pkl", "n"} and e["t"] in keys
              and isinstance(e["pkl"], str) and type(e["n"]) is int and e["n"] > 0):
            _b64(e["pkl"], rel)
        else:
            raise BadSlotMeta(f"{rel}: distcp item {str(e)[:120]} is not {{'b': data}} or "
                              f"{{'t': tensor, 'pkl': pickle, 'n': size}}")


def _check_safetensors(rel: str, skeleton: Any, keys: Set[str], tensors: List[Any], present: bool) -> None:
    if not present:
        raise BadSlotMeta(f"{rel}: no skeleton")


# the slot-side half of each shard format (formats/shardformat.py): what its skeleton must hold
SkeletonCheck = Callable[[str, Any, Set[str], List[Any], bool], None]
SKELETON_CHECKS: Dict[ShardFormat, SkeletonCheck] = {
    ShardFormat.SAFETENSORS: _check_safetensors, ShardFormat.TORCH: _check_torch, ShardFormat.RAW: _check_raw,
    ShardFormat.DCP: _check_dcp,
}


def _b64(text: str, rel: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadSlotMeta(f"{rel}: skeleton data is not base64") from None


def item_id_ok(ident: Any) -> bool:
    """A distcp item's identity: [name, global offsets, sizes] of a tensor chunk, [name, None, None] of an
    object (what a rank's load request is matched against, formats/manifest items)."""
    if not (isinstance(ident, list) and len(ident) == 3 and isinstance(ident[0], str)):
        return False
    offsets, sizes = ident[1], ident[2]
    if offsets is None and sizes is None:
        return True
    return (isinstance(offsets, list) and isinstance(sizes, list) and len(offsets) == len(sizes)
            and all(type(v) is int and v >= 0 for v in offsets + sizes))
