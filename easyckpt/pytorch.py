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

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

from easyckpt import dtensor
from easyckpt.config import NAMINGS, STORAGE_DEFAULT, Config, adapter_config
from easyckpt.engine.checkpointer import (
    Checkpointer,
    DefaultCheckpointer,
    FrameworkState,
)
from easyckpt.engine.load.dcp import data_file
from easyckpt.engine.load.reads import Read, as_reads
from easyckpt.engine.load.sources import Loaded
from easyckpt.engine.save import estimate, rng
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.errors import CheckpointError
from easyckpt.formats.manifest import Manifest

NAMING = NAMINGS["pytorch"]
MODEL, OPTIM = "model.safetensors", "optimizer.safetensors"

_default = DefaultCheckpointer("easyckpt")


# model -> (its class, whether it is sharded) (PytorchState.sharded); weak: no model is kept alive
_SHARDED: "weakref.WeakKeyDictionary[torch.nn.Module, Tuple[type, bool]]" = weakref.WeakKeyDictionary()


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@dataclass
class PytorchState(FrameworkState[Any]):
    """A plain training loop's objects on one rank (the FrameworkState of this adapter)."""

    ckpt: Checkpointer
    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer] = None
    lr_scheduler: Optional[LRScheduler] = None
    iteration: int = 0
    extra: Optional[Dict[str, Any]] = None

    @property
    def rank(self) -> int:
        return self.ckpt.rank

    @functools.cached_property
    def sharded(self) -> bool:
        """FSDP2 (DTensor parameters): the DCP layout (dtensor.py), each rank its own shards. Kept per model
        while its class is the same: this state is made at every save, and walking the parameters cost each
        snapshot of a 3-layer MLP about 17 us (torch.optim imports the DTensor module, so the walk always runs;
        even finding the first parameter costs 9 us). fully_shard gives the root module a class of its own
        (FSDP2's FSDP<Module>), so a model loaded, then sharded, is looked at again."""
        known = _SHARDED.get(self.model)
        if known is None or known[0] is not type(self.model):
            known = _SHARDED[self.model] = (type(self.model), dtensor.is_dtensor_model(self.model))
        return known[1]

    def collect(self) -> List[ShardSpec]:
        if self.sharded:
            return dtensor.collect(self.model, self.optimizer, self.rank) + [self._rank_state()]
        owner = self.rank == 0
        shards = [ShardSpec(MODEL, _unwrap(self.model).state_dict(), persist=owner)]
        if self.optimizer is not None or self.lr_scheduler is not None:
            shards.append(ShardSpec(OPTIM, {
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None},
                persist=owner))
        shards.append(self._rank_state())
        return shards

    def _rank_state(self) -> ShardSpec:
        state: Dict[str, Any] = {"iteration": self.iteration, "rng": rng.capture(), "extra": self.extra}
        if self.sharded and self.lr_scheduler is not None:     # (else in OPTIM, beside the optimizer)
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return ShardSpec(_rank_file(self.rank), state, persist=True)

    def snapshot_bytes(self) -> int:
        """About what the first snapshot holds (the slots are reserved ahead, engine/save/estimate.py)."""
        if self.sharded:
            return dtensor.local_bytes(self.model, self.optimizer)
        model = estimate.tensor_bytes(_unwrap(self.model).state_dict())
        return model + (estimate.optimizer_bytes(self.optimizer) if self.optimizer is not None else 0)

    def needed_in_memory(self, manifest: Manifest) -> List[Read]:
        """From the nodes' memory, on another world size: a whole model and optimizer (DDP, one process) as
        ``needed`` reads them from storage; FSDP2's shards from every rank of the run that wrote them (its data
        file and its memory-only rest), which DCP's planner reshards (dcpmemory.MemoryReader)."""
        if not self.sharded:
            return self.needed(manifest)
        saved = manifest.world_size or 1
        files = [Read(f) for q in range(saved) for f in (data_file(q), dtensor.LOCAL.format(q))]
        return files + [Read(_rank_file(self.rank), optional=self.rank >= saved)]

    @as_reads
    def needed(self, manifest: Manifest) -> List[Tuple[str, bool]]:
        if self.sharded:
            files = dtensor.needed(manifest, self.rank, self.ckpt.world_size)
            return files + [(_rank_file(self.rank), self.rank >= (manifest.world_size or 1))]
        if MODEL not in manifest.files and dtensor.DCP_METADATA in manifest.files:
            raise CheckpointError(f"step {manifest.step} was saved from an FSDP model (torch DCP layout): it "
                                  f"restores only into a model whose parameters are DTensors (fully_shard)")
        files = [(MODEL, False)]
        if self.optimizer is not None or self.lr_scheduler is not None:
            files.append((OPTIM, False))
        # a rank that did not exist when the checkpoint was written has no RNG state to restore
        files.append((_rank_file(self.rank), self.rank >= (manifest.world_size or 1)))
        return files

    def restore(self, loaded: Loaded) -> Tuple[int, Optional[Dict[str, Any]]]:
        trees = loaded.trees
        per_rank = trees.get(_rank_file(self.rank))
        if self.sharded:
            # from memory (path None): this rank's own shards, or every rank's of another world size (resharded.py);
            # a committed step is read by DCP's reader
            self.ckpt.converting("by DCP's resharding")      # said only where the world size changed
            dtensor.restore(self.model, self.optimizer, trees, loaded.path, self.rank, self.ckpt.staging(loaded))
            if self.lr_scheduler is not None and per_rank is not None and "lr_scheduler" in per_rank:
                self.lr_scheduler.load_state_dict(per_rank["lr_scheduler"])
        else:
            self._restore_whole(trees)
        if per_rank is None:
            self.ckpt.missing_rng("this rank")
            return loaded.step, None
        rng.restore(per_rank["rng"])
        return int(per_rank["iteration"]), per_rank["extra"]

    def _restore_whole(self, trees: Dict[str, Any]) -> None:
        _unwrap(self.model).load_state_dict(trees[MODEL])
        if self.optimizer is not None or self.lr_scheduler is not None:
            state = trees[OPTIM]
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            if self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])


def initialize_easyckpt(save_dir: Union[str, Config, None] = None, save_mem_interval: int = 1,
                        save_storage_interval: int = STORAGE_DEFAULT, max_ckpt_num: Optional[int] = 5,
                        log_file_path: Union[str, bool, None] = None, *, config: Optional[Config] = None,
                        **advanced: Any) -> None:
    """Validate the settings and attach to this node's agent (starting it on the first local rank).

    Either the settings as keywords (``advanced``: see config.ADVANCED and Config, e.g.
    ``exit_after_ondemand_checkpoint=True``), or one ``Config``: ``initialize_easyckpt(config)`` or
    ``initialize_easyckpt(config=config)``."""
    if isinstance(save_dir, Config):
        config, save_dir = save_dir, None
    _default.start(adapter_config("initialize_easyckpt", NAMING, config, dict(
        save_dir=save_dir, save_mem_interval=save_mem_interval, save_storage_interval=save_storage_interval,
        max_ckpt_num=max_ckpt_num, log_file_path=log_file_path), advanced))


def save_checkpoint_if_needed(iteration: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                              lr_scheduler: Optional[LRScheduler] = None,
                              extra: Optional[Dict[str, Any]] = None) -> None:
    """Call once per iteration, after the optimizer step; ``iteration`` counts completed iterations."""
    ckpt = _default.require()
    ckpt.save(iteration, PytorchState(ckpt, model, optimizer, lr_scheduler, iteration, extra),
              optimizer=optimizer)


def load_checkpoint(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    lr_scheduler: Optional[LRScheduler] = None) -> Tuple[int, Optional[Dict[str, Any]]]:
    """Restore the newest complete state; returns ``(iteration, extra)``, or ``(0, None)`` when there is none."""
    ckpt = _default.require()
    restored = ckpt.load(PytorchState(ckpt, model, optimizer, lr_scheduler))
    return (0, None) if restored is None else restored


def checkpoint_metrics() -> Dict[str, float]:
    """This rank's checkpointing figures, for the training loop's own logger: ``{"easyckpt/<name>": number}``
    (snapshots taken and skipped, the stall they cost, persists, commits, bytes written, the loss bound; the
    keys are listed in docs/metrics.md). After finalize_easyckpt, the run's final figures; {} before
    initialize_easyckpt."""
    return _default.metrics()


def finalize_easyckpt(timeout: Optional[float] = None) -> Optional[int]:
    """Make the newest state durable (persisted and committed), then release shared memory.

    Returns the committed step (None if nothing was ever saved)."""
    return _default.finalize(timeout)
