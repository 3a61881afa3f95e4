"""DeepSpeed on a machine without CUDA (a laptop, a CPU CI box): one call before DeepSpeed starts.

    from easyckpt.deepspeed.cpu import deepspeed_on_cpu
    deepspeed_on_cpu()        # before deepspeed.initialize / TrainingArguments(deepspeed=...); no-op with CUDA

Why it is needed. On a CPU, DeepSpeed builds C++ ops from source the first time they are used
(torch.utils.cpp_extension, cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions):

- ``deepspeed.init_distributed`` (which ``deepspeed.initialize`` and the Trainer call) always builds the
  shared-memory all-reduce op ``deepspeed_shm_comm`` (about 30 s on 2 cores). The op only serves ranks
  started by DeepSpeed's own launcher (it sets LOCAL_SIZE); under torchrun it is built and never used.
- an ``"optimizer"`` section in the DeepSpeed config without ``"torch_adam": true`` builds ``fused_adam``
  (about 2 minutes on 2 cores).

Nothing is printed while they compile, and the build holds a lock file in the op's build directory: a
build interrupted by kill -9 or SIGTERM (a timeout, torchrun stopping the other ranks after one failed)
leaves the lock behind, and every later start waits on it for ever, silently
(``torch.utils.file_baton.FileBaton.wait``).

What ``deepspeed_on_cpu()`` does, only when CUDA is absent:
1. ``deepspeed.comm.torch.build_shm_op`` returns None: no build, gloo's all-reduce is used instead.
2. every other op build DeepSpeed starts is said on the ``easyckpt`` logger before it starts, and a lock
   file no process holds open (a dead build's) raises EasyCkptError naming the file, instead of waiting.

What it does not do: a Hugging Face Trainer on a CPU still needs ``TrainingArguments(use_cpu=True)``
(without it accelerate sets up no process group and every rank thinks it is alone, which DeepSpeed reports
as "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size"); and a
single process still needs a launcher (``torchrun --nproc_per_node 1``: without RANK/MASTER_ADDR
DeepSpeed looks for MPI and fails on ``import mpi4py``).
"""
from __future__ import annotations

import functools
import importlib
import os
import time
from typing import Any, Callable, Optional

import torch

from easyckpt import console
from easyckpt.errors import EasyCkptError

_applied = False
_advised = False


def deepspeed_on_cpu() -> bool:
    """Make DeepSpeed start on a machine without CUDA (see the module's docstring). Returns whether
    anything was changed: False with CUDA, where it does nothing. Idempotent; call it before DeepSpeed
    initialises its communication (``deepspeed.initialize``, ``deepspeed.init_distributed``, or building
    the Trainer's ``TrainingArguments(deepspeed=...)``)."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    # `import deepspeed.comm.torch as m` would give the torch package (deepspeed.comm re-exports it)
    comm_torch: Any = importlib.import_module("deepspeed.comm.torch")    # untyped, like all of deepspeed
    comm_torch.build_shm_op = _no_shm_op
    builder = importlib.import_module("deepspeed.ops.op_builder.builder")
    builder.OpBuilder.jit_load = _guarded(builder.OpBuilder.jit_load)
    _applied = True
    return True


def applied() -> bool:
    """Whether ``deepspeed_on_cpu()`` changed DeepSpeed in this process."""
    return _applied


def advise() -> None:
    """Say once, on a machine without CUDA, that ``deepspeed_on_cpu()`` was not called: the adapters call
    it when they meet a DeepSpeed engine, which is after DeepSpeed started (too late to apply it), so the
    next start knows which line to add."""
    global _advised
    if _applied or _advised or torch.cuda.is_available():
        return
    _advised = True
    console.warning("DeepSpeed runs without CUDA here; call easyckpt.deepspeed.cpu.deepspeed_on_cpu() before "
                   "deepspeed.initialize (or before building TrainingArguments): it skips the build of an op "
                   "torchrun never uses and turns a lock left by an interrupted build, on which DeepSpeed "
                   "would wait silently for ever, into an error")


def _no_shm_op() -> None:
    return None


def _guarded(jit_load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(jit_load)
    def announced_jit_load(self: Any, verbose: bool = True) -> Any:
        directory = _build_directory(self.name)
        if directory is not None:
            lock = os.path.join(directory, "lock")
            if _stale(lock):
                raise EasyCkptError(
                    f"DeepSpeed's build of its C++ op {self.name!r} was interrupted earlier and left the lock "
                    f"file {lock}: torch would wait on it for ever. Remove it (rm {lock}) and start again.")
            if not any(name.endswith(".so") for name in os.listdir(directory)):
                console.warning(f"DeepSpeed compiles its C++ op {self.name!r} for this CPU now (once, a minute or "
                                f"more, cached in {directory})"
                                + (": '\"torch_adam\": true' in the optimizer's params avoids it" if "adam" in self.name
                                   else ""))
        return jit_load(self, verbose)
    return announced_jit_load


def _build_directory(name: str) -> Optional[str]:
    try:   # torch's own rule for where load(name=...) builds (TORCH_EXTENSIONS_DIR, python and CUDA versions)
        from torch.utils.cpp_extension import _get_build_directory
        return _get_build_directory(name, False)
    except (ImportError, OSError):
        return None


def _stale(lock: str) -> bool:
    """A lock file no process holds open. torch's builder keeps the lock's descriptor open for the whole
    build and closes it just before removing the file, so a lock seen unheld twice, a second apart, with
    the same inode, belongs to a dead build."""
    first = _unheld_inode(lock)
    if first is None:
        return False
    time.sleep(1.0)
    return _unheld_inode(lock) == first


def _unheld_inode(lock: str) -> Optional[int]:
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return None
    if not os.path.isdir("/proc/self/fd") or st.st_uid != os.getuid():
        return None        # no way to see who holds it: let torch wait as it would
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue       # another user's process, or gone
        for fd in fds:
            try:
                held = os.stat(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
                return None
    return st.st_ino


__all__ = ["deepspeed_on_cpu", "applied"]
