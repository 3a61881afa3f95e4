"""Plain PyTorch (single process or DDP under torchrun): the public verbs on the engine.

On-disk layout of step S (``step_{S:08d}/``):
    model.safetensors        the model's state_dict (DDP's ``module.`` unwrapped); loadable with
                             ``safetensors.torch.load_file`` — written once, by rank 0
    optimizer.safetensors    optimizer and LR-scheduler state — written once, by rank 0
    rank_{r:05d}.safetensors per-rank state: iteration, RNG states, the user's ``extra``
    easyckpt_manifest.json   written last: the commit
and ``latest`` holds the newest committed directory name.

Decision: with DDP, model and optimizer are identical on every rank, so every rank snapshots them
into its own memory slot (a restart on the same node resumes from memory without any collective),
but only rank 0's copy is persisted.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from easyckpt.config import NAMINGS, Config, check_advanced, log_setting
from easyckpt.trainer import rng
from easyckpt.trainer.session import Engine, EngineSlot
from easyckpt.trainer.snapshot import ShardSpec

NAMING = NAMINGS["pytorch"]
MODEL, OPTIM = "model.safetensors", "optimizer.safetensors"

_slot = EngineSlot("easyckpt")


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def initialize_easyckpt(save_dir: str, save_mem_interval: int = 1, save_storage_interval: int = 5,
                        max_ckpt_num: Optional[int] = 5, log_file_path: Union[str, bool, None] = None,
                        **advanced: Any) -> None:
    """Validate the settings and attach to this node's agent (starting it on the first local rank).

    ``advanced``: see config.ADVANCED and Config (e.g. ``exit_after_ondemand_checkpoint=True``).
    """
    check_advanced("initialize_easyckpt", advanced)
    _slot.start(Config(save_dir=str(save_dir), save_mem_interval=save_mem_interval,
                            save_storage_interval=save_storage_interval, max_ckpt_num=max_ckpt_num,
                            log_file_path=log_setting(log_file_path),
                            naming=NAMING, **advanced))


def _shards(engine: Engine, iteration: int, model: torch.nn.Module, optimizer, lr_scheduler,
            extra: Optional[Dict[str, Any]]) -> List[ShardSpec]:
    owner = engine.rank == 0
    shards = [ShardSpec(MODEL, _unwrap(model).state_dict(), persist=owner)]
    if optimizer is not None or lr_scheduler is not None:
        shards.append(ShardSpec(OPTIM, {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None}, persist=owner))
    shards.append(ShardSpec(_rank_file(engine.rank), {"iteration": iteration, "rng": rng.capture(),
                                                      "extra": extra}, persist=True))
    return shards


def save_checkpoint_if_needed(iteration: int, model: torch.nn.Module, optimizer=None, lr_scheduler=None,
                              extra: Optional[Dict[str, Any]] = None) -> None:
    """Call once per iteration, after the optimizer step; ``iteration`` counts completed iterations."""
    engine = _slot.require()
    engine.maybe_save(iteration, lambda: _shards(engine, iteration, model, optimizer, lr_scheduler, extra),
                      optimizer=optimizer)


def load_checkpoint(model: torch.nn.Module, optimizer=None, lr_scheduler=None) -> Tuple[int, Optional[Dict[str, Any]]]:
    """Restore the newest complete state; returns ``(iteration, extra)``, or ``(0, None)`` when there is none."""
    engine = _slot.require()

    def needed(manifest: Dict[str, Any]) -> List[Tuple[str, bool]]:
        files = [(MODEL, False)]
        if optimizer is not None or lr_scheduler is not None:
            files.append((OPTIM, False))
        # a rank that did not exist when the checkpoint was written has no RNG state to restore
        files.append((_rank_file(engine.rank), engine.rank >= manifest.get("world_size", 1)))
        return files

    loaded = engine.load(needed)
    if loaded is None:
        engine.log.emit("load", step=0, rank=engine.rank, source="none",
                        message="no checkpoint found: starting from scratch")
        return 0, None
    trees = loaded.trees
    _unwrap(model).load_state_dict(trees[MODEL])
    if optimizer is not None or lr_scheduler is not None:
        state = trees[OPTIM]
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if lr_scheduler is not None:
            lr_scheduler.load_state_dict(state["lr_scheduler"])
    per_rank = trees.get(_rank_file(engine.rank))
    if per_rank is None:
        engine.log.emit("warning", rank=engine.rank, message="no RNG state saved for this rank")
        return loaded.step, None
    rng.restore(per_rank["rng"])
    return int(per_rank["iteration"]), per_rank["extra"]


def finalize_easyckpt(timeout: Optional[float] = None) -> Optional[int]:
    """Make the newest state durable (persisted and committed), then release shared memory.

    Returns the committed step (None if nothing was ever saved)."""
    return _slot.finalize(timeout)
