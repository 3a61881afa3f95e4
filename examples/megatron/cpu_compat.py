"""Make megatron-core run on a CPU-only machine (gloo), for examples and tests.

megatron-core assumes CUDA in a handful of places: it allocates buffers with
``device=torch.cuda.current_device()`` or ``device="cuda"``, moves tensors with ``.cuda()``, seeds and
swaps the CUDA RNG for its model-parallel RNG tracker, calls ``torch.cuda.synchronize()``, and the
optimizers assert ``param.type() == "torch.cuda.FloatTensor"``. This module redirects all of that to
the CPU. It is a switch for examples and tests only: it never belongs in a GPU code path.

Usage (before any megatron object is built; importing megatron first is fine)::

    import cpu_compat
    cpu_compat.enable()

Then run the script under ``torchrun`` with the gloo backend. ``enable()`` is idempotent.

The device rewriting is done by a ``torch.overrides.TorchFunctionMode``. Torch function modes live on
a per-thread stack, so a thread started after ``enable()`` that runs megatron code (or torch code on
tensors megatron will later use with "cuda" devices) must enter the mode itself: call
``enter_mode_in_this_thread()`` at the start of the thread, or wrap its target with
``in_cpu_mode(fn)``.

Consequences worth knowing:
- The "CUDA" RNG and the CPU RNG become one generator. Megatron's RNG tracker forks/restores the
  "CUDA" state around tensor-parallel regions, which now swaps the CPU generator's state; keep
  dropout at 0 if runs must be compared with different layouts. Megatron logs "CPU RNG state changed
  within GPU RNG context" when something draws random numbers inside such a fork.
- ``torch.cuda.is_available()`` still says False; code that branches on it takes its CPU branch.
- Every torch call goes through the mode's Python handler: a little overhead per op, and warnings that
  torch raises inside an op are reported at this file's ``return func(*args, **kwargs)`` line rather
  than at the caller (and, deduplicated by location, show only once).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")

# (module, attribute) -> original value, so that disable() can undo enable().
_saved: Dict[tuple, Any] = {}
_enabled = False
_lock = threading.Lock()


def _is_cuda_device(dev: Any) -> bool:
    """True for the ways megatron names a CUDA device: "cuda", "cuda:N", torch.device("cuda", N).

    A bare int is deliberately left alone: ``torch.cuda.current_device()`` returns the CPU device once
    enabled, so megatron no longer produces ints, and ints also appear as non-device arguments.
    """
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Intercepts every torch function / Tensor method call in the threads where it is entered.

    Inside ``__torch_function__`` torch disables the mode for the duration of the handler, so calling
    ``func`` here does not recurse into the mode.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        # Tensor.cuda() / Tensor.cuda(device) / Module.cuda() (which calls Tensor.cuda per tensor):
        # the tensor already lives where it should, on the CPU.
        if func is torch.Tensor.cuda:
            return args[0]

        # Tensor.type() with no target reports the tensor type name. Megatron's optimizers assert that
        # parameters are 'torch.cuda.FloatTensor' / 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor'
        # (Float16OptimizerWithFloat16Params, DistributedOptimizer, clip_grads), so report the CUDA name.
        # Tensor.type(target) converts; a 'torch.cuda.*' target is mapped back to its CPU type name.
        if func is torch.Tensor.type:
            if len(args) == 1 and "dtype" not in kwargs:
                name = func(*args, **kwargs)
                if name.startswith("torch.") and not name.startswith("torch.cuda."):
                    name = "torch.cuda." + name[len("torch."):]
                return name
            if len(args) > 1 and isinstance(args[1], str) and args[1].startswith("torch.cuda."):
                args = (args[0], "torch." + args[1][len("torch.cuda."):]) + tuple(args[2:])
            return func(*args, **kwargs)

        # device="cuda" in factories (torch.empty/zeros/ones/tensor/arange/...) and in Tensor.to(...).
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        # Tensor.to("cuda") / Tensor.to(torch.device("cuda", i)) pass the device positionally.
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


_mode = CudaToCpuMode()
# Whether the mode has been pushed in a thread: thread-local like the torch function mode stack itself
# (not a set of thread ids: ids are reused once a thread ends).
_tls = threading.local()


def enter_mode_in_this_thread() -> None:
    """Push the CUDA→CPU torch function mode in the calling thread (no-op if already there).

    The mode is left on the stack for the thread's lifetime (it is never exited), which is what makes
    it "global" for that thread.
    """
    if getattr(_tls, "entered", False):
        return
    _mode.__enter__()
    _tls.entered = True


def in_cpu_mode(fn: Callable) -> Callable:
    """Decorator for a thread target (or any callable run in another thread): enters the mode first."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        enter_mode_in_this_thread()
        return fn(*args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------------------------------
# torch.cuda replacements
# ----------------------------------------------------------------------------------------------------

def _current_device() -> torch.device:
    # Megatron passes this straight to device=..., .cuda(...), .to(...): the CPU device works for all.
    return _CPU


def _synchronize(device: Any = None) -> None:
    # CPU ops are synchronous; nothing to wait for.
    return None


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    # The "CUDA" generator is the CPU default generator.
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _get_rng_state_all() -> list:
    return [_get_rng_state()]


def _set_rng_state_all(new_states) -> None:
    for state in new_states:
        _set_rng_state(state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that one also calls torch.cuda.manual_seed_all, which (patched) would come
    # back here, and it would re-seed the CPU generator in a roundabout way. Seed the generator itself.
    torch.default_generator.manual_seed(int(seed))


def _seed() -> None:
    torch.default_generator.seed()


def _initial_seed() -> int:
    return torch.default_generator.initial_seed()


# Megatron's own helpers in megatron.core.tensor_parallel.random go to torch.cuda.default_generators /
# torch.cuda._lazy_call, which do not work without CUDA; give them the same CPU semantics.
def _megatron_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    # graph_safe (CUDA graphs) is meaningless on the CPU; always return a state tensor (a copy).
    return torch.default_generator.get_state()


def _megatron_set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    torch.default_generator.set_state(new_state)


class _HostStream:
    """What ``torch.cuda.current_stream()`` gives on the CPU: work is already ordered, so waiting and
    recording are no-ops (megatron-core 0.19's grad-sync waits on CUDA-graph events through it)."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event

    def synchronize(self) -> None:
        pass


def _current_stream(device: Any = None) -> _HostStream:
    return _HostStream()


def _patch(obj: Any, name: str, value: Any) -> None:
    key = (obj, name)
    if key not in _saved:
        _saved[key] = getattr(obj, name)
    setattr(obj, name, value)


def moe_without_te() -> None:
    """megatron-core 0.16's MoE router tests ``te_general_gemm is not None``, a name moe_utils binds only when
    Transformer Engine imports: without TE it is unbound (NameError). Bind it to None (= no TE). Call it
    after megatron's modules are imported (not from enable(), which may run while they are being imported)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def enable() -> None:
    """Install the CPU switches (idempotent) and enter the torch function mode in this thread."""
    global _enabled
    with _lock:
        if not _enabled:
            import torch.cuda.random as cuda_random

            _patch(torch.cuda, "current_device", _current_device)
            _patch(torch.cuda, "synchronize", _synchronize)
            _patch(torch.cuda, "current_stream", _current_stream)
            # torch.cuda re-exports the functions of torch.cuda.random by name, and megatron uses both
            # spellings (torch.cuda.get_rng_state in the RNG tracker, torch.cuda.random.get_rng_state in
            # _get_cuda_rng_state), so both modules are patched.
            for mod in (torch.cuda, cuda_random):
                _patch(mod, "get_rng_state", _get_rng_state)
                _patch(mod, "set_rng_state", _set_rng_state)
                _patch(mod, "get_rng_state_all", _get_rng_state_all)
                _patch(mod, "set_rng_state_all", _set_rng_state_all)
                _patch(mod, "manual_seed", _manual_seed)
                _patch(mod, "manual_seed_all", _manual_seed)
                _patch(mod, "seed", _seed)
                _patch(mod, "seed_all", _seed)
                _patch(mod, "initial_seed", _initial_seed)

            # Megatron's module-level helpers are looked up by name at call time inside the module
            # (nothing else in megatron.core imports them by name), so patching the module suffices.
            import megatron.core.tensor_parallel.random as mrandom

            _patch(mrandom, "_get_cuda_rng_state", _megatron_get_cuda_rng_state)
            _patch(mrandom, "_set_cuda_rng_state", _megatron_set_cuda_rng_state)
            _enabled = True
    enter_mode_in_this_thread()


def disable() -> None:
    """Undo enable(): restore the patched functions and leave the mode in this thread (tests).

    Other threads that entered the mode keep it until they end.
    """
    global _enabled
    with _lock:
        for (obj, name), value in _saved.items():
            setattr(obj, name, value)
        _saved.clear()
        _enabled = False
    if getattr(_tls, "entered", False):
        _mode.__exit__(None, None, None)
        _tls.entered = False


def is_enabled() -> bool:
    return _enabled
