"""torch.load with weights_only=True and easyckpt's allow-list: how every torch.save file and snapshot pickle
is read back (docs/reliability.md promise 7): argparse.Namespace, the known frameworks' enums and a few plain
data classes are allowed, their modules imported from the installed packages, never from the file; anything
else is refused by name.
"""
from __future__ import annotations

import io
from typing import Any, Iterable, List

import torch

from easyckpt.errors import CheckpointError


def weights_only_load(pkl_file: Any, persistent_load: Any) -> Any:
    """A pickle through torch's weights-only unpickler with the allow-list below, its storages from
    ``persistent_load`` (a snapshot's tensors, or a file's storages read one by one)."""
    from torch import _weights_only_unpickler as wo

    names = wo.get_globals_in_pkl(pkl_file)
    pkl_file.seek(0)
    known = set(wo._get_allowed_globals())
    with torch.serialization.safe_globals(_allow(n for n in names if n not in known)):
        unpickler = wo.Unpickler(pkl_file, encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]  # torch's Unpickler hook
        return unpickler.load()


SAFE_MODULE_PREFIXES = ("torch.", "megatron.", "deepspeed.", "transformers.", "numpy.")
# Plain data classes the frameworks put into their own checkpoint files, rebuilt from their fields only
# (no __reduce__ calls into arbitrary code): DeepSpeed's loss scaler and ZeRO fragment addresses, and
# numpy arrays (RNG states of numpy, saved by Megatron and the HF Trainer).
SAFE_CLASSES = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
}


def _allowed(name: str) -> Any:
    import argparse
    import enum
    import importlib

    if name == "argparse.Namespace":
        return argparse.Namespace
    if name == "signal.Signals":     # Megatron-LM's args.exit_signal: an IntEnum rebuilt from its number
        import signal
        return signal.Signals
    module, _, qual = name.rpartition(".")
    if not (module + ".").startswith(SAFE_MODULE_PREFIXES):
        return None
    try:
        obj = getattr(importlib.import_module(module), qual)
    except (ImportError, AttributeError):
        return None
    if name == "numpy.dtype":     # a dtype unpickles into an instance of its numpy.dtypes class
        import numpy.dtypes
        return [obj] + [c for c in vars(numpy.dtypes).values() if isinstance(c, type)]
    if name in SAFE_CLASSES:
        return obj
    return obj if isinstance(obj, type) and issubclass(obj, enum.Enum) else None


def _allow(names: Iterable[str]) -> List[Any]:
    """The classes behind ``names`` if every one is on the allow-list; ValueError naming the first that
    is not."""
    allowed: List[Any] = []
    for name in names:
        obj = _allowed(name)
        if obj is None:
            raise CheckpointError(f"refusing to load: the file references {name}, which is not on easyckpt's "
                                  f"allow-list (tensors, containers, argparse.Namespace, framework enums and "
                                  f"signal.Signals, "
                                  f"DeepSpeed's loss scaler and fragment addresses, numpy arrays)")
        allowed.extend(obj if isinstance(obj, list) else [obj])
    return allowed


class _MemoryFile(io.RawIOBase):
    """A read-only file over bytes already in memory, without copying them (torch.load reads records
    out of it one by one)."""

    def __init__(self, data: Any):
        self._view, self._pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def safe_torch_load(data: Any) -> Any:
    """torch.load with weights_only=True, allowing argparse.Namespace, Enum classes of the known
    frameworks and the few data classes in SAFE_CLASSES (their modules are imported from the installed
    packages, never from the file). ``data``: the file's bytes (any buffer; not copied)."""
    allowed = _allow(torch.serialization.get_unsafe_globals_in_checkpoint(io.BufferedReader(_MemoryFile(data))))
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BufferedReader(_MemoryFile(data)), weights_only=True, map_location="cpu")
