"""What a rank reads to restore a checkpoint: the typed answer of an adapter's ``needed`` (the
FrameworkState protocol, checkpointer.py), read by the load sources and adopt.py."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

from easyckpt.formats.manifest import Manifest

# a torch.save file read in part (engine/load/torchparts.py): given the file's pickled tree, which storages to read
Pick = Callable[..., Any]


@dataclass(frozen=True)
class Read:
    relpath: str                             # as the manifest lists it
    optional: bool = False                   # absent from the checkpoint: skipped, not an incompatibility
    items: Optional[Tuple[int, ...]] = None  # only these items of the file (manifest "items"; distcp data)
    pick: Optional[Pick] = None              # a torch.save file: its pickle, then the storages ``pick`` names

    @property
    def whole(self) -> bool:
        return self.items is None and self.pick is None

    @classmethod
    def of(cls, want: Union["Read", Sequence[Any]]) -> "Read":
        """An adapter's entry as a Read: a Read, or the tuple form (relpath, optional[, items or pick])."""
        if isinstance(want, Read):
            return want
        rel, optional = str(want[0]), bool(want[1])
        if len(want) > 2:
            third = want[2]
            if callable(third):
                return cls(rel, optional, pick=third)
            return cls(rel, optional, items=tuple(third))
        return cls(rel, optional)


Needed = Callable[[Manifest], Sequence[Union[Read, Sequence[Any]]]]


@dataclass
class Fetched:
    """What a rank's load fetched and checked of a committed step in an object store that the framework's own
    reader opens next (DCP's, Megatron's: a data file's items, a whole data file, a small raw file), kept for
    the local copy that reader is given (engine/scratch.py): the rank's share crosses the network once, not
    once to be checked and again to be read. Each entry is taken (removed) by the copy that uses it."""
    files: Dict[str, Any] = field(default_factory=dict)               # relpath -> the whole file's bytes
    items: Dict[str, Dict[int, Any]] = field(default_factory=dict)    # relpath -> item index -> its bytes
    reused: int = 0          # the bytes copies took from here instead of the store (the audit log's ``staged``)

    def take(self, rel: str) -> Tuple[Optional[Any], Dict[int, Any]]:
        """(the whole file or None, its items by index) kept for ``rel``, given up here."""
        return self.files.pop(rel, None), self.items.pop(rel, {})


def reads(needed: Needed, manifest: Manifest) -> List[Read]:
    """``needed(manifest)`` as Reads (a ValueError from the adapter goes to the caller: incompatible)."""
    return [Read.of(w) for w in needed(manifest)]


S = TypeVar("S")


def as_reads(needed_method: Callable[[S, Manifest], Sequence[Any]]) -> Callable[[S, Manifest], List[Read]]:
    """An adapter's ``needed`` written with the tuple form, typed at the protocol: it returns Reads."""
    @functools.wraps(needed_method)
    def needed(self: S, manifest: Manifest) -> List[Read]:
        return [Read.of(w) for w in needed_method(self, manifest)]
    return needed
