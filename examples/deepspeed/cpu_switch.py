"""Run DeepSpeed on a CPU-only machine: skip the shared-memory comm op it would compile at start.

DeepSpeed picks its CPU accelerator and the gloo backend by itself, but ``deepspeed.init_distributed``
first builds a C++ shared-memory collective op (about 30 s, and 66 MB left in /dev/shm per rank). That
op is an optimisation only; this switch makes its builder return None. For examples and tests on CPU;
on GPU machines it is not called (``enable()`` does nothing when CUDA is available).
"""
from __future__ import annotations

import importlib

import torch


def enable() -> None:
    if torch.cuda.is_available():
        return
    # `import deepspeed.comm.torch as m` would give the torch package (the module re-exports it)
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    comm_torch.build_shm_op = lambda: None
