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
from typing import Any, Callable, Iterator, List, Set, Tuple

import torch


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


def owned_storages(optimizers: List[torch.optim.Optimizer]) -> Set[int]:
    """Storage addresses of every parameter and state tensor of ``optimizers``."""
    owned: Set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                owned.add(_local(p).untyped_storage().data_ptr())
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    owned.add(_local(value).untyped_storage().data_ptr())
    return owned


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
    stall it reports."""
    for opt in torch_optimizers(optimizer):
        if any(p.is_cuda for group in opt.param_groups for p in group["params"]):
            return True, "the optimizer's tensors are on the GPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = torch.get_num_threads() * ranks_on_node
    if cores > busy:
        return True, f"{cores} cores, the training computes on {busy}"
    return False, (f"{cores} cores, all computing ({torch.get_num_threads()} torch threads x {ranks_on_node} "
                   f"ranks): a background copy would compete with them for cores, so it stays synchronous")


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
