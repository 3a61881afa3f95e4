"""The Trainer's FSDP2 layout (the Trainer's session, session.py, uses it when ``trainer.is_fsdp_enabled``).

``checkpoint-N`` holds two torch DCP checkpoints, as accelerate's save_fsdp_model / save_fsdp_optimizer write
them with ``state_dict_type`` SHARDED_STATE_DICT: ``pytorch_model_fsdp_0/`` (``{"model": ...}``) and
``optimizer_0/`` (``{"optimizer": ...}``), each rank writing its own shards (dtensor.py), so the Trainer's own
FSDP loader reads it. Restores run after accelerate's ``prepare`` (the Trainer loads a checkpoint into the
sharded model and its optimizer): through DCP's reader from a committed step, or from the memory snapshot.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from easyckpt import dtensor
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.engine.scratch import Stage
from easyckpt.errors import CheckpointError, ConfigError
from easyckpt.formats.manifest import Manifest

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0/", "optimizer_0/"


def check_supported(trainer: Any) -> None:
    """ConfigError for what is not supported under the Trainer's FSDP: FSDP1, a PEFT model."""
    plugin = trainer.accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ConfigError("easyckpt supports the Trainer's FSDP2 (fsdp_config={'fsdp_version': 2}); FSDP1 "
                          "(fsdp_version 1, FullyShardedDataParallel) is not supported")
    from easyckpt.transformers import peftmodel
    if peftmodel.peft_model(trainer.model) is not None:
        raise ConfigError("easyckpt does not support a PEFT model under the Trainer's FSDP yet (LoRA is supported "
                          "with DDP; FSDP2 with a whole model)")


def objects(trainer: Any) -> Tuple[Any, Any]:
    """The sharded model and the torch optimizer (accelerate's wrapper unwrapped)."""
    opt = trainer.optimizer
    assert opt is not None      # train() creates it before the first save and before loading
    return trainer.model_wrapped, getattr(opt, "optimizer", opt)


def shards(trainer: Any, rank: int) -> List[ShardSpec]:
    """Each rank's local shards of the model and of the optimizer state, nothing gathered."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = objects(trainer)
    msd, osd = get_state_dict(model, opt)
    return dtensor.collect_state({"model": msd}, rank, MODEL_DIR) + \
        dtensor.collect_state({"optimizer": osd}, rank, OPTIM_DIR)


def needed(manifest: Manifest, fsdp: bool, rank: int, world_size: int) -> Optional[List[Tuple[str, bool]]]:
    """The files this rank reads of an FSDP checkpoint; None when neither the checkpoint nor the Trainer uses
    FSDP; CheckpointError ("incompatible") when only one of them does."""
    saved = MODEL_DIR + dtensor.DCP_METADATA in manifest.files
    if not (fsdp or saved):
        return None
    if fsdp != saved:
        how = "without" if fsdp else "with"
        raise CheckpointError(f"checkpoint-{manifest.step} was saved {how} the Trainer's FSDP: it restores only "
                              f"into a Trainer {how} FSDP (fsdp=)")
    return dtensor.needed(manifest, rank, world_size, MODEL_DIR) + \
        dtensor.needed(manifest, rank, world_size, OPTIM_DIR)


def load_model(model: Any, trees: Dict[str, Any], path: Optional[str], rank: int,
               stage: Optional[Stage] = None) -> None:
    """The model's shards from the checkpoint (``path``: the committed step, opened by ``stage``; None: the
    memory snapshot)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    state = {"model": get_model_state_dict(model)}
    dtensor.load_state(state, trees, path, rank, MODEL_DIR, stage)
    set_model_state_dict(model, state["model"])


def load_optimizer(trainer: Any, trees: Dict[str, Any], path: Optional[str], rank: int,
                   stage: Optional[Stage] = None) -> None:
    """The optimizer's state shards from the checkpoint, into the Trainer's (prepared) optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    model, opt = objects(trainer)
    state = {"optimizer": get_optimizer_state_dict(model, opt)}
    dtensor.load_state(state, trees, path, rank, OPTIM_DIR, stage)
    set_optimizer_state_dict(model, opt, state["optimizer"])
