"""A PEFT model (LoRA and the other adapters PEFT wraps a model with) under the Trainer: what its
checkpoint-N holds, and how a resume puts it back.

A plain Trainer saves a PeftModel as PEFT does (PeftModel.save_pretrained): ``adapter_model.safetensors``
(the adapter's weights, and the modules PEFT trains beside it: ``modules_to_save``) and
``adapter_config.json``; the frozen base weights are not in the checkpoint, they are the base model the
job loads again. easyckpt writes the same files, so ``PeftModel.from_pretrained(base, checkpoint-N)`` and a
plain Trainer's resume read them, and a snapshot copies the adapter only: its stall and bytes scale with
the adapter, not the model.

What is not saved must be the same at the resume: the checksum of the frozen weights, taken once when the
session starts, goes into each step's manifest (``peft_base``), and a step whose checksum differs from the
base model loaded now is not restored (an "incompatible" verdict: kept, an older step tried).
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

import torch

from easyckpt.errors import CheckpointError
from easyckpt.formats.manifest import Hasher

ADAPTER, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
BASE_KEY = "peft_base"      # the manifest info entry: checksum of the frozen weights


def peft_model(model: Any) -> Optional[Any]:
    """``model`` when it is a PeftModel (duck-typed: peft is an optional dependency), else None."""
    if model is not None and hasattr(model, "peft_config") and hasattr(model, "active_adapter") \
            and type(model).__module__.startswith("peft."):
        return model
    return None


def adapter_state(model: Any) -> Dict[str, torch.Tensor]:
    """The adapter's weights as PeftModel.save_pretrained keeps them (keys without the adapter's name)."""
    from peft import get_peft_model_state_dict
    return dict(get_peft_model_state_dict(model, adapter_name=model.active_adapter))


def config_json(model: Any) -> bytes:
    """adapter_config.json as PEFT writes it: the active adapter's config, in inference mode (a loader
    that trains on passes is_trainable=True, as the Trainer's resume does)."""
    data = model.peft_config[model.active_adapter].to_dict()
    data["inference_mode"] = True
    return (json.dumps(_plain(data), indent=2, sort_keys=True) + "\n").encode()


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "value", value)       # an enum (task_type, peft_type)


def base_checksum(model: Any) -> str:
    """A checksum of every frozen parameter and buffer (name, dtype, shape, bytes): what a resume takes from
    the base model instead of the checkpoint."""
    h = Hasher()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        if name in trainable:
            continue
        data = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        if data.numel():
            h.update(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def check_base(recorded: Any, current: str, step: int) -> None:
    """CheckpointError (the verdict "incompatible") when step ``step`` was trained on other frozen weights."""
    if isinstance(recorded, str) and recorded != current:
        raise CheckpointError(f"checkpoint-{step} holds a PEFT adapter trained on another base model (the frozen "
                              f"weights' checksum {recorded} was recorded, the model loaded now has {current}): "
                              f"load the base model it was trained on")


def restore_adapter(model: Any, state: Dict[str, torch.Tensor]) -> None:
    """Load the adapter's weights into the live PeftModel; CheckpointError when they are not this model's."""
    from peft import set_peft_model_state_dict
    want, got = set(adapter_state(model)), set(state)
    if want != got:
        raise CheckpointError(f"the checkpoint's adapter does not match the model's: missing {sorted(want - got)[:5]}, "
                              f"unexpected {sorted(got - want)[:5]}")
    set_peft_model_state_dict(model, state, adapter_name=model.active_adapter)
