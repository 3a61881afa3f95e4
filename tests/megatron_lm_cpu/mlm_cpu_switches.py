"""The extra CPU switches that Megatron-LM's own training loop (pretrain_gpt.py, megatron.training) needs.

``examples/megatron/cpu_compat.py`` makes megatron-core run on a CPU-only machine (CUDA devices -> CPU,
CUDA RNG -> CPU RNG, ``Tensor.type()`` reporting ``torch.cuda.*``). Megatron-LM's training code
(``megatron.training`` from a Megatron-LM source tree, which is not part of the megatron-core wheel)
assumes a GPU in more places; this module covers those, for tests only:

* ``torch.cuda``: ``device_count`` -> 1 (``_initialize_distributed`` skips the model-parallel setup when
  it sees no device), ``set_device`` / ``empty_cache`` no-ops, stand-ins for streams and events
  (``training.get_model`` builds DDP inside ``torch.cuda.stream(torch.cuda.Stream())``), device
  properties / capability of an sm_90 device (argument checks for TP>1 and some kernels ask for it),
  memory statistics that are all 0 (``report_memory``, memory logging).
* modules patched right after they are imported (they are not imported yet when ``sitecustomize`` runs,
  and some names are imported elsewhere with ``from ... import``, so the patch must land before that):
  ``megatron.legacy.fused_kernels.load`` (builds CUDA kernels with nvcc) and
  ``megatron.core.datasets.utils.compile_helpers`` (runs ``make`` in the megatron source tree) become
  no-ops; ``megatron.training.initialize.set_jit_fusion_options`` becomes a no-op (it warms up fused
  functions, i.e. torch.compile on this torch) and ``initialize_megatron`` is called with
  ``allow_no_cuda=True`` (it asserts ``torch.cuda.is_available()`` otherwise).
* ``megatron.core.transformer.custom_layers.batch_invariant_kernels`` is imported unconditionally by
  ``megatron.training.initialize`` and imports triton: without triton an empty stand-in is served.
* ``megatron.core.datasets.helpers_cpp`` (the compiled dataset index builder, needed by the GPT
  datasets): a Megatron-LM source tree has only ``helpers.cpp``; since ``compile_helpers`` is off, the
  compiled module of the installed megatron-core wheel (same release) is served when the tree has none.
* ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer``: four fixes to its checkpoint
  loading (not CPU switches: bugs on the fp32 / torch-Adam-fallback paths, see
  ``_after_distrib_optimizer``) without which ``--use-distributed-optimizer`` runs cannot resume.
  ``EASYCKPT_MEGATRON_NO_UPSTREAM_FIXES=1`` turns them off.
* ``cpu_compat.enable()`` itself runs once ``megatron.core.tensor_parallel.random`` has been imported
  (``enable()`` patches that module; megatron.core's ``__init__`` imports it first thing). Nothing in
  megatron allocates tensors at import time, so this is early enough, and processes that never import
  megatron (the torchrun launcher, helper scripts) are left alone and start faster.

All of this is installed by :func:`install`, which ``sitecustomize.py`` calls when
``EASYCKPT_MEGATRON_CPU=1``: every Python process with this directory on ``PYTHONPATH`` gets it,
including the children that the torch_dist checkpoint writer starts with multiprocessing "spawn".
"""
from __future__ import annotations

import collections
import contextlib
import functools
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
import types
from typing import Callable, Dict, List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
# The project's megatron-core CPU switch (examples/megatron/cpu_compat.py), found relative to this file.
_CPU_COMPAT_DIR = os.path.normpath(os.path.join(_HERE, "..", "..", "examples", "megatron"))

_installed = False
_cuda_patched = False
_lock = threading.RLock()


# ----------------------------------------------------------------------------------------------------
# torch.cuda stand-ins
# ----------------------------------------------------------------------------------------------------

class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so every wait/sync is a no-op."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = device
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        event = event if event is not None else _CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    # `with stream:` is allowed on a real Stream as well.
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


class _CpuEvent:
    """Stands in for torch.cuda.Event; record() takes a wall-clock time so elapsed_time() is meaningful."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs):
        self._t: Optional[float] = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: "_CpuEvent") -> float:
        if self._t is None or end_event._t is None:
            return 0.0
        return (end_event._t - self._t) * 1000.0  # milliseconds, like CUDA events


_DEFAULT_STREAM = _CpuStream()


def _current_stream(device=None) -> _CpuStream:
    return _DEFAULT_STREAM


def _stream(stream=None):
    # torch.cuda.stream(s) is a context manager that makes s current; there is only one "stream" here.
    return contextlib.nullcontext(stream)


def _noop(*args, **kwargs) -> None:
    return None


def _device_count() -> int:
    # One "device" per process: _initialize_distributed only builds the model-parallel groups when
    # device_count() > 0, and it then calls set_device(local_rank), made a no-op below.
    return 1


# What an sm_90 (Hopper) device reports: argument validation for TP>1 and some kernel choices ask for
# the compute capability; the CPU does whatever they decide.
_SM_MAJOR, _SM_MINOR = 9, 0


def _total_host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _get_device_properties(device=None):
    return types.SimpleNamespace(
        name="CPU (easyckpt test stand-in for a CUDA device)",
        major=_SM_MAJOR,
        minor=_SM_MINOR,
        total_memory=_total_host_memory(),
        multi_processor_count=os.cpu_count() or 1,
        is_integrated=False,
        is_multi_gpu_board=False,
        gcnArchName="",
        uuid="00000000-0000-0000-0000-000000000000",
        L2_cache_size=0,
        warp_size=32,
    )


def _get_device_capability(device=None):
    return (_SM_MAJOR, _SM_MINOR)


def _get_device_name(device=None) -> str:
    return _get_device_properties().name


def _zero(*args, **kwargs) -> int:
    return 0


def _memory_stats(device=None):
    # Every statistic reads 0 (megatron indexes e.g. "allocated_bytes.all.current").
    return collections.defaultdict(int)


def _mem_get_info(device=None):
    total = _total_host_memory()
    return (total, total)


def patch_torch_cuda() -> None:
    """Install the torch.cuda stand-ins above (idempotent). torch.cuda.is_available() stays False."""
    global _cuda_patched
    with _lock:
        if _cuda_patched:
            return
        import torch

        cuda = torch.cuda
        replacements: Dict[str, object] = {
            "device_count": _device_count,
            "set_device": _noop,
            "empty_cache": _noop,
            "ipc_collect": _noop,
            "Stream": _CpuStream,
            "Event": _CpuEvent,
            "current_stream": _current_stream,
            "default_stream": _current_stream,
            "stream": _stream,
            "set_stream": _noop,
            "get_device_properties": _get_device_properties,
            "get_device_capability": _get_device_capability,
            "get_device_name": _get_device_name,
            "memory_stats": _memory_stats,
            "memory_allocated": _zero,
            "max_memory_allocated": _zero,
            "memory_reserved": _zero,
            "max_memory_reserved": _zero,
            "memory_cached": _zero,
            "max_memory_cached": _zero,
            "reset_peak_memory_stats": _noop,
            "reset_max_memory_allocated": _noop,
            "reset_accumulated_memory_stats": _noop,
            "mem_get_info": _mem_get_info,
        }
        for name, value in replacements.items():
            setattr(cuda, name, value)
        # torch.cuda.memory is where some of these live and are sometimes called from.
        for name in ("memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
                     "max_memory_reserved", "reset_peak_memory_stats", "empty_cache", "mem_get_info"):
            if hasattr(cuda.memory, name):
                setattr(cuda.memory, name, replacements[name])
        _cuda_patched = True


# ----------------------------------------------------------------------------------------------------
# Patches applied to megatron modules right after they are imported
# ----------------------------------------------------------------------------------------------------

def _after_tensor_parallel_random(module) -> None:
    # The torch.cuda stand-ins first, then the project's megatron-core switch (device redirection,
    # RNG, Tensor.type); enable() patches this very module, which is fully executed at this point.
    patch_torch_cuda()
    if _CPU_COMPAT_DIR not in sys.path:
        sys.path.insert(0, _CPU_COMPAT_DIR)
    import cpu_compat

    cpu_compat.enable()


def _after_fused_kernels(module) -> None:
    # fused_kernels.load() compiles CUDA kernels with nvcc. The local layers with every fusion switched
    # off do not use them.
    module.load = _noop


def _after_datasets_utils(module) -> None:
    # compile_helpers() runs `make` in megatron/core/datasets; the compiled helpers are served from
    # the installed megatron-core wheel instead (see _HelpersCppFinder below).
    module.compile_helpers = _noop


def _after_training_initialize(module) -> None:
    # Patched before megatron.training.training runs `from megatron.training.initialize import
    # initialize_megatron, set_jit_fusion_options`, so the names it binds are these.
    original = module.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        # The signature is (extra_args_provider, args_defaults, ignore_unknown_args, allow_no_cuda, ...).
        if len(args) > 3:
            args = args[:3] + (True,) + args[4:]
        else:
            kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    module.initialize_megatron = initialize_megatron
    # set_jit_fusion_options() warms up the fused (torch.compile'd) bias-gelu / bias-dropout functions,
    # which would compile C++ with inductor on the CPU; the fusions are switched off anyway.
    module.set_jit_fusion_options = _noop


def _init_torch_adam_state(optimizer) -> None:
    """Give every parameter of a torch Adam/AdamW the state its first step() would create.

    Same values as torch's lazy initialisation (step 0, zero moments), so stepping afterwards is
    identical to stepping a fresh optimizer; each parameter gets its own "step" tensor.
    """
    import torch

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state[param]
                if len(state) != 0:
                    continue
                state["step"] = torch.tensor(0.0, dtype=scalar_dtype)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad", False):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _after_distrib_optimizer(module) -> None:
    """Make Megatron's own checkpoint loading work for --use-distributed-optimizer on this machine.

    These are NOT CPU switches but bugs in megatron-core's DistributedOptimizer loading (core_v0.16.1;
    the same code is on Megatron-LM main). Switch 1 concerns every fp32 model; switches 2-4 concern the
    fallback a machine without Transformer Engine or Apex takes: torch's Adam(W), whose state keeps a
    "step" tensor per parameter (TE/Apex FusedAdam keep the step in the param group, which is what
    Megatron's checkpoint formats are made for). Measured here, each one on its own breaks the resume
    of a --use-distributed-optimizer run of the real training loop (an exception, or resumed losses
    that differ from an uninterrupted run); EASYCKPT_MEGATRON_NO_UPSTREAM_FIXES=1 leaves megatron as
    it is.
    """
    if os.environ.get("EASYCKPT_MEGATRON_NO_UPSTREAM_FIXES") == "1":
        return
    import torch

    cls = module.DistributedOptimizer
    if getattr(cls, "_easyckpt_patched", False):
        return
    cls._easyckpt_patched = True

    # 1. (any fp32 model, also with TE/Apex) Loading copies the checkpoint's values into the optimizer's
    #    main params in _set_main_param_and_optimizer_states(), called by load_parameter_state_from_
    #    dp_zero (--ckpt-format torch) and _from_dp_reshardable (torch_dist, the default sharding) with
    #    grad mode on. For fp32 models the main params are views of the model parameters (leaves that
    #    require grad), so copy_ raises "a view of a leaf Variable that requires grad is being used in
    #    an in-place operation" (bf16/fp16 main params are separate tensors). The sibling
    #    load_parameter_state_from_fully_reshardable has @torch.no_grad(); run the copy under no_grad.
    copy_states = torch.no_grad()(cls._set_main_param_and_optimizer_states)
    cls._set_main_param_and_optimizer_states = copy_states

    if module.HAVE_APEX_OR_TE:
        return

    # 2. load_state_dict() restores "step" from the param groups into the torch state (the one value
    #    Megatron keeps for it), then _set_main_param_and_optimizer_states() copies every key of that
    #    state from the per-parameter tensors of the checkpoint:
    #    - --ckpt-format torch (load_parameter_state_from_dp_zero): those have only param / exp_avg /
    #      exp_avg_sq -> KeyError 'step';
    #    - torch_dist (load_parameter_state_from_dp_reshardable): "step" is left out of the sharded
    #      tensors ("read from param_groups"), so the value there is the placeholder of the optimizer
    #      the load started from (0 after switch 4 below) and would overwrite the restored step.
    #    Hand it the step the state already has (a tensor copied onto itself is unchanged).
    set_states = copy_states

    @functools.wraps(set_states)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state.get(main_param, {})
            if "step" in state:
                tensors = dict(tensors, step=state["step"])
        return set_states(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    # 3. Both formats: load_state_dict() gives every parameter the SAME step tensor, and torch's
    #    single-tensor Adam increments it in place (step_t += 1) once per parameter, so after a resume
    #    the bias correction runs ahead (the resumed losses differ from an uninterrupted run from the
    #    first step on). Give each parameter its own copy.
    load_state_dict = cls.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_own_steps(self, state_dict):
        result = load_state_dict(self, state_dict)
        seen = set()
        for state in self.optimizer.state.values():
            step = state.get("step")
            if torch.is_tensor(step):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                seen.add(id(step))
        return result

    cls.load_state_dict = load_state_dict_own_steps

    # 4. --ckpt-format torch_dist: loading builds the sharded state dict of the freshly built, never
    #    stepped optimizer, and state_dict() asserts that the torch state holds exactly one "step" value
    #    (it holds none yet: torch creates its state at the first step()). Create the state a first
    #    step would create (step 0, zero moments) before state_dict() reads it; stepping afterwards
    #    is unchanged, and the loaded values replace it.
    state_dict = cls.state_dict

    @functools.wraps(state_dict)
    def state_dict_with_init(self):
        if not self.ddp_config.use_megatron_fsdp:
            _init_torch_adam_state(self.optimizer)
        return state_dict(self)

    cls.state_dict = state_dict_with_init


_POST_IMPORT: Dict[str, List[Callable]] = {
    "megatron.core.optimizer.distrib_optimizer": [_after_distrib_optimizer],
    "megatron.core.tensor_parallel.random": [_after_tensor_parallel_random],
    "megatron.legacy.fused_kernels": [_after_fused_kernels],
    "megatron.core.datasets.utils": [_after_datasets_utils],
    "megatron.training.initialize": [_after_training_initialize],
}

_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
_HELPERS_CPP = "megatron.core.datasets.helpers_cpp"


class _PostImportLoader(importlib.abc.Loader):
    """Wraps a module's real loader and runs callbacks once the module has been executed."""

    def __init__(self, loader, callbacks: List[Callable]):
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name):
        # get_source, get_filename, is_package, get_code, ... (inspect, linecache, torch.jit).
        return getattr(self._loader, name)


def _batch_invariant_stand_in(module) -> None:
    """The names megatron imports from batch_invariant_kernels; the mode itself needs triton."""

    def is_batch_invariant_mode_enabled() -> bool:
        return False

    def enable_batch_invariant_mode():
        raise RuntimeError("--batch-invariant-mode needs triton, which is not installed (CPU test run)")

    def disable_batch_invariant_mode() -> None:
        return None

    @contextlib.contextmanager
    def set_batch_invariant_mode(enabled: bool = True):
        if enabled:
            enable_batch_invariant_mode()
        yield

    module.is_batch_invariant_mode_enabled = is_batch_invariant_mode_enabled
    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    module.disable_batch_invariant_mode = disable_batch_invariant_mode
    module.set_batch_invariant_mode = set_batch_invariant_mode
    module.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                      "disable_batch_invariant_mode", "enable_batch_invariant_mode"]


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, fill: Callable):
        self._fill = fill

    def create_module(self, spec):
        return None  # default module object

    def exec_module(self, module):
        self._fill(module)


def _find_compiled_helpers(exclude_dirs: List[str]) -> Optional[str]:
    """A compiled megatron/core/datasets/helpers_cpp on sys.path outside the given directories."""
    excluded = {os.path.realpath(d) for d in exclude_dirs}
    for entry in sys.path:
        directory = os.path.join(entry or os.getcwd(), "megatron", "core", "datasets")
        if os.path.realpath(directory) in excluded or not os.path.isdir(directory):
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidates = glob.glob(os.path.join(glob.escape(directory), "helpers_cpp" + suffix))
            if candidates:
                return candidates[0]
    return None


class _MegatronCpuFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path; only ever looks at the few megatron module names above."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("megatron."):
            return None
        if fullname == _BATCH_INVARIANT:
            if importlib.util.find_spec("triton") is not None:
                return None  # the real module works
            return importlib.util.spec_from_loader(fullname, _StandInLoader(_batch_invariant_stand_in))
        if fullname == _HELPERS_CPP:
            spec = self._real_spec(fullname, path, target)
            if spec is not None:
                return spec
            so_path = _find_compiled_helpers(list(path or []))
            if so_path is None:
                return None
            return importlib.util.spec_from_file_location(fullname, so_path)
        callbacks = _POST_IMPORT.get(fullname)
        if callbacks is None:
            return None
        spec = self._real_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PostImportLoader(spec.loader, callbacks)
        return spec

    def _real_spec(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


_finder = _MegatronCpuFinder()


def install() -> None:
    """Register the import hook (idempotent). Modules imported earlier are patched at once."""
    global _installed
    with _lock:
        if _installed:
            return
        sys.meta_path.insert(0, _finder)
        _installed = True
        # Normally nothing of megatron is imported yet (sitecustomize runs first); be correct otherwise.
        for name, callbacks in _POST_IMPORT.items():
            module = sys.modules.get(name)
            if module is not None:
                for callback in callbacks:
                    callback(module)
