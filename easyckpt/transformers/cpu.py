"""The Hugging Face Trainer's FSDP on a machine without CUDA (a laptop, a CPU CI box): one call before the
Trainer's ``TrainingArguments`` are built.

    from easyckpt.transformers.cpu import fsdp_on_cpu
    fsdp_on_cpu()        # no-op with CUDA
    args = TrainingArguments(..., use_cpu=True, fsdp=True, fsdp_config={"fsdp_version": 2})

Why it is needed. accelerate turns its FSDP plugin on only for accelerator process groups (GPU, NPU, XPU,
...): on a CPU group (``use_cpu=True`` under torchrun, gloo) it keeps the plugin aside and the Trainer
runs plain data parallelism instead, without a word. FSDP2 itself (``torch.distributed.fsdp.fully_shard``)
runs on CPU with gloo; what ``fsdp_on_cpu()`` changes, only when CUDA is absent, is that one decision: a
CPU process group given an FSDP plugin becomes accelerate's FSDP type, so the Trainer shards the model
with the plugin's settings.

What it does not do: the Trainer's own FSDP checkpoint save fails on CPU in torch's state-dict gather
(a gloo collective mismatch in ``get_model_state_dict``); easyckpt's save replaces it
(``TrainerWrapper`` / ``EasyCkptCallback``), which collects each rank's local shards without that gather.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

_applied = False


def fsdp_on_cpu() -> bool:
    """Let accelerate run FSDP on a CPU process group (see the module's docstring). Returns whether anything
    was changed: False with CUDA, where it does nothing. Idempotent; call it before the Trainer's
    ``TrainingArguments`` (and so accelerate's state) are built."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = init
    _applied = True
    return True


__all__ = ["fsdp_on_cpu"]
