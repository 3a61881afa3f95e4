"""The JSON metadata of a snapshot slot (formats/slotmeta.py reads it back), written at every snapshot.

Its cost is part of every snapshot's fixed cost, so what does not change from one snapshot to the next (a
shard's skeleton: the model's never changes, an optimizer's changes with its learning rate) is encoded once.
"""
from __future__ import annotations

import functools
import json
import marshal
from typing import Any, Dict, Optional, Tuple

from easyckpt.engine.shards.treeplan import ConstantSkeleton

# made once: json.dumps with any option builds a new encoder at each call (a few us of every snapshot)
_COMPACT = json.JSONEncoder(separators=(",", ":"))

# relpath -> (marshal of the skeleton, its JSON, the skeleton): see _skeleton_json
SkeletonCache = Dict[str, Tuple[bytes, str, Any]]
_INFO = "\0info"


def encode_meta(layout_json: bytes, step: int, skeletons: Dict[str, Any], info: Dict[str, Any],
                cache: Optional[SkeletonCache] = None) -> bytes:
    """The slot's metadata: ``{"files": layout_json, "step", "skeletons", "info"}``. ``cache``: each shard's skeleton
    JSON kept from the snapshot before while the skeleton is the same (a model's never changes; an optimizer's
    changes with its learning rate)."""
    shards = ",".join(_name_json(relpath) + ":" + _skeleton_json(relpath, skeleton, cache)
                      for relpath, skeleton in skeletons.items())
    # the info (the run's, the budget's) changes seldom too; NUL is in no relpath, so its entry is its own
    tail = f'"step":{int(step)},"skeletons":{{{shards}}},"info":{_skeleton_json(_INFO, info, cache)}}}'
    return b'{"files":' + layout_json + b"," + tail.encode()


@functools.lru_cache(maxsize=4096)
def _name_json(relpath: str) -> str:
    """``relpath`` as a JSON string: the same few at every snapshot."""
    return _COMPACT.encode(relpath)


# a skeleton dict of at most this many entries, one of them a plain int (a step, an iteration), is encoded
# entry by entry where the cache is a KeptJson: the rank state's iteration changed at every snapshot, and its
# whole JSON was made again (the call: 7.7-8.2 us, kept entry by entry 5.0-5.3 us; timeit on the test VM)
_SPLIT_MAX = 8
_ENTRIES_MAX = 256


class KeptJson(dict):
    """A SkeletonCache (relpath -> (marshal, JSON)) that also keeps the JSON of the entries of small skeleton
    dicts holding an int, in ``entries`` (named ``relpath NUL key``; were two names ever the same, the kept
    marshal still tells their skeletons apart, so the text stays right)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: SkeletonCache = {}


def _skeleton_json(relpath: str, skeleton: Any, cache: Optional[SkeletonCache]) -> str:
    """JSON of one skeleton (or the info), from ``cache`` when its marshal is the one kept. Marshal, not ``==``: it is many
    times cheaper than the JSON of the floats an optimizer holds, and it tells 1, 1.0 and True apart, which
    ``==`` does not (version 2: no back-references, so the same skeleton always gives the same bytes)."""
    if cache is None:
        return _COMPACT.encode(skeleton)
    if isinstance(cache, KeptJson) and type(skeleton) is dict and len(skeleton) <= _SPLIT_MAX \
            and any(type(v) is int for v in skeleton.values()) and all(type(k) is str for k in skeleton):
        entries = cache.entries
        if len(entries) >= _ENTRIES_MAX:     # keys that keep changing: kept from now on, not forever
            entries.clear()
        # the same text as the whole dict's JSON: compact separators, keys as _name_json writes them, an int as
        # json writes it (int.__repr__), None as null
        return "{" + ",".join(_name_json(k) + ":" + (int.__repr__(v) if type(v) is int else "null" if v is None
                                                      else _skeleton_json(f"{relpath}\0{k}", v, entries))
                              for k, v in skeleton.items()) + "}"
    kept = cache.get(relpath)
    if type(skeleton) is ConstantSkeleton:      # a plan's skeleton that never changes: its JSON kept with it
        if kept is None or kept[2] is not skeleton:
            kept = cache[relpath] = (b"", _COMPACT.encode(skeleton), skeleton)
        return kept[1]
    try:
        key = marshal.dumps(skeleton, 2)
    except ValueError:           # a str or int subclass among the leaves: encoded each time
        return _COMPACT.encode(skeleton)
    if kept is not None and kept[0] == key:
        return kept[1]
    text = _COMPACT.encode(skeleton)
    cache[relpath] = (key, text, None)
    return text
