"""Which tensors of a snapshot may be copied while the next forward/backward runs, and the hook that
makes the optimizer wait for that copy.

Rule. A tensor may be copied in the background only if nothing but an optimizer's ``step`` changes it
between two snapshots: the parameters an optimizer updates and its state (moments, step counters).
Those are found by walking the optimizer the adapter hands over (through wrappers: ``.optimizer`` of
Megatron's, DeepSpeed's and accelerate's optimizers, ``.chained_optimizers`` of Megatron's chained
one) down to the ``torch.optim.Optimizer`` objects whose ``step`` really writes them; a step pre-hook
on each of those waits for the copy. Everything else (buffers such as BatchNorm statistics, which the
next forward changes; RNG and scheduler state; tensors an adapter built for the snapshot) is copied
before ``maybe_save`` returns. A tensor is matched by its storage, so ``state_dict()`` views of a
parameter count as the parameter.

Assumption, stated in docs/architecture.md ("How it works"): user code does not change parameters in place between the
snapshot and the next optimizer step (e.g. weight noise before forward). ``snapshot_overlap=False``
turns the overlap off for such loops.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

import torch

from easyckpt.units import human

# Below this many bytes of optimizer-owned host tensors the copy stays synchronous even with a core free: handing
# it to the copy thread (wake-up, version checks, the wait before the optimizer's step) costs the step more than
# the copy. Measured on the 2-core test VM (an MLP with AdamW, 1 torch thread, the step's cost against steps
# without a snapshot, in one process): at 0.4 MB synchronous +0.49 ms against overlapped +0.91 ms, 1.6 MB +0.56
# against +0.86, 6.3 MB +1.58 against +1.36, 25 MB +4.18 against +0.51.
OVERLAP_MIN_BYTES = 4 << 20


def torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer`` (itself included) whose ``step`` updates tensors."""
    seen: Set[int] = set()
    todo: List[Any] = [optimizer]
    while todo:
        opt = todo.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        # a ChainedOptimizer first: with several optimizers (MoE) its .optimizer raises an AssertionError
        chained = getattr(opt, "chained_optimizers", None)
        if chained:
            todo.extend(chained)
            continue
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            todo.append(inner)
        elif isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks"):
            yield opt


def _owned(optimizers: List[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """Every parameter and state tensor of ``optimizers`` (a DTensor as its local shard)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                yield _local(p)
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield _local(value)


def owned_storages(optimizers: List[torch.optim.Optimizer]) -> Set[int]:
    """Storage addresses of every parameter and state tensor of ``optimizers``."""
    return {t.untyped_storage().data_ptr() for t in _owned(optimizers)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2: the wrapper has no storage of its own), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t).__name__ == "DTensor" else t


def auto_overlap(optimizer: Any, ranks_on_node: int) -> Tuple[bool, str]:
    """What ``snapshot_overlap=None`` means: overlap when it is free, with the reason (for the log).

    Device tensors: the copy is DMA on a side stream and the host has nothing else to do. Host tensors:
    the copy thread needs a core of its own; when the training's threads already use every core
    (torch threads x ranks on the node), it competes with them for cores and memory bandwidth and saves
    nothing measurable: in nine runs of bench_checkpoint's loop on a 2-core box the overlapped copy's
    step-time cost was below the synchronous one's five times and above it four times, by 0.1-4.8
    points, 0.1 lower on average. The copy then stays synchronous, whose cost is the copy's and shows in the
    stall it reports. Nor is it worth it for a small state (OVERLAP_MIN_BYTES)."""
    optimizers = list(torch_optimizers(optimizer))
    for opt in optimizers:
        if any(p.is_cuda for group in opt.param_groups for p in group["params"]):
            return True, "the optimizer's tensors are on the GPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = torch.get_num_threads() * ranks_on_node
    if cores <= busy:
        return False, (f"{cores} cores, all computing ({torch.get_num_threads()} torch threads x {ranks_on_node} "
                       f"ranks): a background copy would compete with them for cores, so it stays synchronous")
    held = owned_bytes(optimizers)
    if held < OVERLAP_MIN_BYTES:
        return False, (f"{cores} cores, the training computes on {busy}, but the optimizer's tensors hold "
                       f"{human(held)}, under {human(OVERLAP_MIN_BYTES)}: handing their copy to a thread costs the "
                       f"step more than copying them, so it stays synchronous")
    return True, f"{cores} cores, the training computes on {busy}"


def owned_bytes(optimizers: List[torch.optim.Optimizer]) -> int:
    """Bytes of the host tensors an overlapped copy would take (each storage once): every parameter and state
    tensor of ``optimizers``, as they are now (before the first step, the parameters alone)."""
    sizes: Dict[int, int] = {}
    for t in _owned(optimizers):
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


class OptimizerWatch:
    """The optimizers whose step must wait for a background snapshot copy."""

    def __init__(self, wait: Callable[[], None]):
        self._wait = wait
        self._watched: dict = {}      # id(torch optimizer) -> (optimizer, hook handle)
        self._seen_outer: Set[int] = set()

    def add(self, optimizer: Any) -> None:
        if optimizer is None or id(optimizer) in self._seen_outer:
            return
        self._seen_outer.add(id(optimizer))
        for opt in torch_optimizers(optimizer):
            if id(opt) not in self._watched:
                handle = opt.register_step_pre_hook(lambda *_: self._wait())
                self._watched[id(opt)] = (opt, handle)

    def deferrable(self) -> Callable[[torch.Tensor], bool]:
        owned = owned_storages([opt for opt, _ in self._watched.values()])
        return lambda t: t.untyped_storage().data_ptr() in owned

    def __bool__(self) -> bool:
        return bool(self._watched)

    def close(self) -> None:
        for _, handle in self._watched.values():
            handle.remove()
        self._watched.clear()
        self._seen_outer.clear()
