"""The part of a snapshot copied while the next forward/backward runs (overlap.py says which tensors),
and the copy primitives the synchronous snapshot shares.

A background copy is checked against the rule overlap.py states (nothing but the optimizer's step changes
those tensors before it waits for the copy): every source tensor's version counter (bumped by each
in-place change) is read when the snapshot starts, again when the copy ends and again when the trainer
settles it. A tensor changed in between (weight noise, a manual ``fill_``) would have given a snapshot
that mixes two states: it is never published, or unpublished before anything asked to persist it
(TornSnapshot), and the engine turns the overlap off for the rest of the run.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeVar,
)

import torch

from easyckpt import _faults as faults
from easyckpt.engine.save import copythreads
from easyckpt.errors import TornSnapshot


class _Result(Protocol):
    """What this module reads of snapshot.SnapshotResult."""

    step: int
    seconds: float


# what the snapshot that started the copy returns once it is published (snapshot.SnapshotResult); generic,
# so that this module, which snapshot.py uses, never imports it back
R = TypeVar("R", bound=_Result)


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    event = _copy_async(dsts, srcs)
    if event is not None:
        event.synchronize()


def _copy_async(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]):
    """Copy host tensors now; start device tensors' copies on a side stream, after everything queued
    so far on the current stream (the values of this step), and return the event that marks their end
    (None when there are none). The side stream keeps the copies out of the way of the compute queued
    next; record_stream keeps the caching allocator from reusing a source before its copy ran."""
    side = None
    host: List[Tuple[torch.Tensor, torch.Tensor]] = []
    device: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for pair in zip(dsts, srcs):
        (device if pair[1].is_cuda else host).append(pair)
    if host:
        # one call for every host tensor: a copy_ per tensor paid the dispatcher for each (a tiny state's
        # 19 tensors: 71 us against 42 on the test VM)
        torch._foreach_copy_([d for d, _ in host], [s for _, s in host])
    for d, s in device:
        if side is None:
            side = _side_stream(s.device)
            side.wait_stream(torch.cuda.current_stream(s.device))
        with torch.cuda.stream(side):
            d.copy_(s, non_blocking=True)
        s.record_stream(side)
    if side is None:
        return None
    event = torch.cuda.Event()
    event.record(side)
    return event


def _copy_single_threaded(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A copy on this thread alone, with the GIL released. torch's copy_ would start an OpenMP team
    for this thread, whose workers spin after each copy and take the cores the training's own
    team computes on, slowing every step while the background copy runs."""
    if src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and src.device.type == "cpu":
        n = src.numel() * src.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)


# A background copy of device tensors is fed to the side stream in pieces of this size, each copy call made once the
# piece before it has ended (IN_FLIGHT pieces queued beyond the one running) and the first once this step's kernels
# have ended: a GPU has one copy engine per direction, so a device-to-host copy the training issues meanwhile
# (``loss.item()``, a metric) queues behind whatever of the snapshot is already queued, and on an H200 a copy call
# into the registered slot made while its stream still waited for other work held the training thread's own calls.
# Queued whole, a 4 GB snapshot held each ``loss.item()`` for the whole copy (72 ms) and the overlap hid 13% of it;
# two pieces in flight, fed at once, still hid none of it when the loop read its loss (x1.454 a step); fed as each
# becomes runnable, all of it (x1.002; bench_gpu.py measures it, benchmarks/results/gpu.txt).
PIECE_BYTES = 64 << 20
IN_FLIGHT = 0

_SIDE_STREAMS: Dict[Any, Any] = {}


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``dst.copy_(src)`` as copies of at most PIECE_BYTES each (a non-contiguous pair: one copy)."""
    n = src.numel()
    step = max(1, PIECE_BYTES // max(1, src.element_size()))
    if n <= step or not (src.is_contiguous() and dst.is_contiguous() and dst.dtype == src.dtype):
        return [(dst, src)]
    d, s = dst.view(-1), src.view(-1)
    return [(d[i:i + step], s[i:i + step]) for i in range(0, n, step)]


class _PacedDeviceCopy:
    """Device tensors copied to the host by the background thread, one piece at a time (PIECE_BYTES, IN_FLIGHT):
    ordered after this step's kernels (the side stream waits for the current stream when the
    snapshot starts, on the training thread), fed while the next forward/backward runs. ``event`` marks the
    end of the last piece once ``submitted`` is set."""

    def __init__(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]):
        self.pairs = pairs
        self.device = pairs[0][1].device
        self.side = _side_stream(self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        # the feeding thread sleeps on this before its first copy call (see PIECE_BYTES): no call waits inside CUDA
        self.ready = torch.cuda.Event(blocking=True)
        self.ready.record(torch.cuda.current_stream(self.device))
        self.submitted = threading.Event()
        self.event: Optional[Any] = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        """On a background thread: feed every piece, then wait for the last (the GIL is released meanwhile).
        ``submitted`` is set whatever happens; ``event`` stays None if feeding failed (``error``)."""
        window: List[Any] = []
        try:
            self.ready.synchronize()
            with torch.cuda.device(self.device), torch.cuda.stream(self.side):
                for dst, src in self.pairs:
                    for d, s in _pieces(dst, src):
                        d.copy_(s, non_blocking=True)
                        done = torch.cuda.Event(blocking=True)     # waited on by sleeping, not spinning
                        done.record(self.side)
                        window.append(done)
                        if len(window) > IN_FLIGHT:
                            window.pop(0).synchronize()
                    src.record_stream(self.side)    # the allocator keeps the source until the copy ran
            last = torch.cuda.Event(blocking=True)
            last.record(self.side)
            self.event = last
        except BaseException as exc:     # noqa: BLE001 - reported by the snapshot's wait()
            self.error = exc
        finally:
            self.submitted.set()
        if self.event is not None:
            self.event.synchronize()


class PendingSnapshot(Generic[R]):
    """A snapshot whose optimizer-owned tensors are still being copied by a background thread.

    The thread publishes the slot's header as soon as its copy ends, so the agent can persist the
    snapshot even if the trainer never waits for it. ``wait`` is what the optimizer's step pre-hook
    calls; when every deferred tensor is on the device it calls ``order_on_device`` instead, which makes the
    current stream wait for the copy (the host waits only until the last pieces are fed)."""

    def __init__(self, result: R, pairs: List[Tuple[torch.Tensor, torch.Tensor]],
                 publish: Callable[[], None], unpublish: Callable[[], None], t0: float, rank: int):
        self.result, self._publish, self._unpublish, self.rank = result, publish, unpublish, rank
        self._versions = [(s, s._version) for _, s in pairs]
        self.sync_seconds = time.perf_counter() - t0     # what maybe_save stalled for
        self.copy_seconds = 0.0
        self.waited = 0.0
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        self._device: Optional[_PacedDeviceCopy] = None
        if any(s.is_cuda for _, s in pairs):
            # the side stream waits for this step's kernels now, from the training thread: the copies' order
            # relative to them is fixed, whenever the background thread feeds the pieces
            self._device = _PacedDeviceCopy([(d, s) for d, s in pairs if s.is_cuda])
            pairs = [(d, s) for d, s in pairs if not s.is_cuda]
        self._host_pairs = bool(pairs)
        # on the process's copy thread, which the interpreter lets finish at exit: a trainer that ends (or dies
        # of an exception) right after maybe_save still completes the snapshot, and no copy is cut off inside
        # torch (a daemon thread stopped inside a C++ frame at shutdown aborts the process)
        self._future = copythreads.start("snapshot", lambda: self._run(pairs))

    def _run(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        t = time.perf_counter()
        try:
            faults.inject("trainer.background_copy", self.rank)
            feeder = None
            if self._device is not None:     # fed beside the host copies: the DMA and the memmove overlap
                feeder = copythreads.start("snapshot-d2h", self._device.run)
            for d, s in pairs:
                _copy_single_threaded(d, s)
            if feeder is not None:
                feeder.result()
                if self._device is not None and self._device.error is not None:
                    raise self._device.error
            self.copy_seconds = time.perf_counter() - t
            self._check_unchanged()
            self._publish()
        except BaseException as exc:   # reported by wait(); the slot stays unpublished (never half-valid)
            self.error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def order_on_device(self) -> bool:
        """Before the optimizer changes what is being copied: when every deferred tensor is on the
        device, make the current stream wait for the copies (no host stall) and return True; else the
        caller must ``wait``."""
        device = self._device
        if device is None or self._host_pairs:
            return False
        # the last pieces are fed about when the copy ends: until then the host waits (the GPU is still
        # busy with the forward/backward queued before this optimizer step)
        t = time.perf_counter()
        device.submitted.wait()
        self.waited += time.perf_counter() - t
        if device.event is None:        # feeding failed: wait() reports it
            return False
        torch.cuda.current_stream(device.device).wait_event(device.event)
        return True

    def wait(self) -> R:
        if not self._done.is_set():
            t = time.perf_counter()
            self._done.wait()
            self.waited += time.perf_counter() - t
        self._future.result()
        if self.error is None:
            try:
                # a change whose version bump came after the thread's check: the training thread has
                # finished it now; nothing asked the agent to persist this slot yet (the engine does next)
                self._check_unchanged()
            except TornSnapshot as exc:
                self._unpublish()
                self.error = exc
        if self.error is not None:
            raise self.error
        self.result.seconds = self.sync_seconds + self.waited
        return self.result

    def _check_unchanged(self) -> None:
        changed = [s for s, version in self._versions if s._version != version]
        if changed:
            shapes = ", ".join(str(tuple(s.shape)) for s in changed[:3])
            raise TornSnapshot(
                f"rank {self.rank}: {len(changed)} tensor(s) being copied in the background for the snapshot of "
                f"step {self.result.step} (shapes {shapes}{', ...' if len(changed) > 3 else ''}) were changed in "
                f"place before the copy ended, not by the optimizer's step: that snapshot is dropped (the "
                f"previous one stays the newest), and snapshot_overlap is off from now on. Set "
                f"snapshot_overlap=False if the loop changes parameters in place between the save and the next "
                f"optimizer step")


