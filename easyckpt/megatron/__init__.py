"""Megatron drop-ins: ``load_checkpoint``, ``initialize_easyckpt``, ``save_checkpoint_if_needed``.

Same arguments and return values as Megatron-LM's ``megatron.training.checkpointing`` (core_v0.16):
``load_checkpoint`` returns ``(iteration, num_floating_point_operations_so_far)``, ``(0, 0)`` when
there is nothing to load. With Megatron-LM's ``megatron.training`` importable and its arguments
parsed, the save directory, the arguments stored in the checkpoint and the consumed-sample counters
come from ``get_args()``; with megatron-core alone pass ``save_dir=`` (and ``args=``) explicitly.

Two layouts, Megatron's own (``ckpt_format``, by default Megatron-LM's ``args.ckpt_format``, else torch):

- ``torch_dist`` (megatron.core.dist_checkpointing; torchdist.py): Megatron's loader reads it on any
  TP/PP/DP layout, and so does ``load_checkpoint`` here: a resume on another layout reads the chunks this
  rank needs from storage (a snapshot in memory serves only the layout it was taken on).
- ``torch`` (state.py): per-rank ``mp_rank_*/model_optim_rng.pt``. ``concat=True`` resumes on another
  data-parallel size: the DistributedOptimizer state is stored per data-parallel rank
  (``distrib_optim_dp{r:03d}.pt``, no gather on the save path); concat reassembles every parameter from
  all saved shards and takes this rank's slice. It also resumes on other TP/PP sizes (reshard_torch.py:
  each snapshot records megatron-core's sharding metadata of the saved tensors). Without it, a shard that
  does not match the current layout is refused with a message that names concat=True. The hook passes it.

A checkpoint is restored in the layout it was written in, whatever ``ckpt_format`` says for new saves.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch

from easyckpt import console
from easyckpt.config import STORAGE_DEFAULT, Config, adapter_config
from easyckpt.engine.checkpointer import DefaultCheckpointer, FrameworkState
from easyckpt.engine.load.reads import as_reads
from easyckpt.engine.load.sources import Loaded
from easyckpt.engine.save import estimate
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.errors import CheckpointError, ConfigError
from easyckpt.formats.manifest import Manifest
from easyckpt.megatron import reshard_torch as _reshard
from easyckpt.megatron import shardmap as _shardmap
from easyckpt.megatron import state as _state
from easyckpt.megatron import torchdist as _dist

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

# Megatron's model: its list of model chunks (one per virtual pipeline stage), or one module
Model = Union[torch.nn.Module, Sequence[torch.nn.Module]]
Optimizer = Optional["MegatronOptimizer"]
Scheduler = Optional["OptimizerParamScheduler"]

_default = DefaultCheckpointer("easyckpt.megatron")
_args: Optional[argparse.Namespace] = None
_format: Dict[str, Optional[str]] = {"ckpt_format": "torch", "layout": None}
FORMATS = ("torch", "torch_dist")


def _megatron_args() -> Optional[argparse.Namespace]:
    try:
        from megatron.training.global_vars import get_args
        return get_args()
    except (ImportError, AssertionError, AttributeError):
        return None


@dataclass
class MegatronState(FrameworkState[Any]):
    """Megatron's model chunks, optimizer and scheduler on one rank (the FrameworkState of this adapter)."""

    model: Model
    optimizer: Optimizer
    opt_param_scheduler: Scheduler
    iteration: int = 0
    flops: Optional[float] = None
    strict: bool = True
    concat: bool = False
    elsewhere: Optional[str] = None      # where Megatron's own loader resumes from when save_dir has nothing
    # the chunks this rank asks Megatron's reader for (torch_dist), what its partial reads follow
    _request: Optional[List[Tuple[str, List[int], List[int]]]] = field(default=None, init=False, repr=False)

    def otherwise(self) -> Optional[str]:
        return self.elsewhere

    def layout(self) -> str:
        # asked at every iteration's save call (the snapshot's info): fixed for a process once computed
        layout = _format.get("layout")
        if layout is None:
            layout = _format["layout"] = _dist.layout(_state.parallel(), self.model)
        return layout

    def collect(self) -> List[ShardSpec]:
        # everything happens here: an iteration that takes no snapshot pays for nothing
        where = _state.parallel()
        if _format["ckpt_format"] == "torch_dist":
            return _dist.collect(self.iteration, self.model, self.optimizer, self.opt_param_scheduler,
                                 self.flops or 0, _args, where)
        shards = _state.collect(self.iteration, self.model, self.optimizer, self.opt_param_scheduler,
                                self.flops or 0, _args, where)
        # where each saved tensor sits in the global one: what a resume on other TP/PP sizes needs
        shards.append(ShardSpec(f"{where.mp_dir}/{_shardmap.SHARDMAP}",
                                _shardmap.shard_map(self.model, self.optimizer, self.layout()),
                                persist=where.writes_model))
        return shards

    def snapshot_bytes(self) -> int:
        """About what the first snapshot holds (the slots are reserved ahead, engine/save/estimate.py): the
        model chunks' tensors, each optimizer's state and, with the DistributedOptimizer, its fp32 main
        parameters (saved beside their moments)."""
        total = sum(estimate.tensor_bytes(t) for t in _shardmap.live_tensors(_state.chunks(self.model)).values())
        for opt in _state.optimizers(self.optimizer):
            inner = getattr(opt, "optimizer", None)
            total += estimate.optimizer_bytes(inner)
            if _state.is_distributed(opt) and inner is not None:
                total += sum(estimate.tensor_bytes(g["params"]) for g in inner.param_groups)
        return total

    @as_reads
    def needed(self, manifest: Manifest) -> List[Tuple[Any, ...]]:
        where = _state.parallel()
        if _dist.is_torch_dist(manifest.files):
            if self._request is None:      # once per load, not per candidate step
                self._request = _dist.request(self.model, self.optimizer, where)
            return _dist.needed(where, torch.distributed.get_world_size(), manifest, self._request)
        saved = manifest.layout
        now = self.layout()
        moved = _dist.changed(saved, now) if isinstance(saved, str) else []
        # with split experts the dense optimizer shards of one (tp, pp) lie in every EP rank's directory:
        # a DP change too goes through the reshard, which joins them (moved is empty unless saved is a layout)
        if isinstance(saved, str) and (set(moved) - {"dp"}
                                       or (moved and (_reshard.expert_split(saved) or _reshard.expert_split(now)))):
            if not self.concat:
                # a CheckpointError from needed() is the verdict "incompatible" (engine/load/): the step is
                # kept as it is, an older one of this layout is tried, and none: the job stops naming this
                raise CheckpointError(f"iteration {manifest.step} was saved in Megatron's torch layout with {saved}; "
                                    f"this run is {now}: pass load_checkpoint(..., concat=True) to reshard it")
            return _reshard.needed(manifest, saved, now, manifest.step,
                                   _shardmap.shard_map(self.model, self.optimizer, now))
        # concat reads every DP rank's optimizer shard: only when the data-parallel size changed
        return _state.needed(where, self.optimizer, manifest, self.concat and saved != now)

    def restore(self, loaded: Loaded) -> Tuple[int, float]:
        where = _state.parallel()
        if _dist.COMMON in loaded.trees or _dist.METADATA_JSON in loaded.trees:    # torch_dist
            in_memory = loaded.path is None     # a snapshot (memory, a peer, the local tier); else a step directory
            same = True if in_memory else _dist.same_layout(
                loaded.manifest, _dist.common_state(loaded.trees, loaded.path), self.layout())
            t0 = time.perf_counter()
            before = loaded.manifest.layout if loaded.manifest else None
            moved = before != self.layout() if isinstance(before, str) else not same
            split = _reshard.expert_split(self.layout()) or (isinstance(before, str) and _reshard.expert_split(before))
            saved = _dist.restore(loaded.trees, None if in_memory else loaded.path, where, self.model, self.optimizer,
                                  self.opt_param_scheduler, self.strict, same_layout=same, exact=in_memory or not moved,
                                  split=split, stage=None if in_memory else _default.require().staging(loaded))
            if not in_memory and moved:
                _default.require().converting(f"by Megatron's reader, {before or 'another layout'} to {self.layout()}")
            if not in_memory and moved and where.rank == 0:
                console.info(f"{os.path.basename(loaded.path or '')} (saved on {before or 'another layout'}) "
                             f"resharded to {self.layout()} through Megatron's reader in "
                             f"{time.perf_counter() - t0:.2f} s")
        elif loaded.source == "storage" and _reshard.is_reshard(loaded.trees):
            t0 = time.perf_counter()
            before = loaded.manifest.layout if loaded.manifest else None
            saved = _reshard.restore(loaded.trees, where, self.model, self.optimizer, self.opt_param_scheduler,
                                     self.layout(), before if isinstance(before, str) else "")
            _default.require().converting(f"by easyckpt's torch-layout reshard, {before} to {self.layout()}")
            if where.rank == 0:
                console.info(f"{os.path.basename(loaded.path or '')} (saved on {before}, torch layout) resharded to "
                             f"{self.layout()} in {time.perf_counter() - t0:.2f} s")
        else:
            t0 = time.perf_counter()
            saved = _state.restore(loaded.trees, where, self.model, self.optimizer, self.opt_param_scheduler,
                                   self.strict, self.concat)
            before = loaded.manifest.layout if loaded.manifest else None
            if loaded.source == "storage" and isinstance(before, str) and before != self.layout() \
                    and where.rank == 0:       # (the data-parallel size changed: concat joined the shards)
                console.info(f"{os.path.basename(loaded.path or '')} (saved on {before}, torch layout) resharded "
                             f"to {self.layout()} in {time.perf_counter() - t0:.2f} s")
        iteration = int(saved["iteration"])
        _restore_training_counters(saved, iteration)
        return iteration, saved.get("num_floating_point_operations_so_far", 0) or 0


def initialize_easyckpt(save_mem_interval: Union[int, Config] = 1, save_storage_interval: int = STORAGE_DEFAULT,
                        max_ckpt_num: Optional[int] = 5, log_file_path: Union[str, bool, None] = None, *,
                        save_dir: Optional[str] = None, args: Optional[argparse.Namespace] = None,
                        config: Optional[Config] = None, ckpt_format: Optional[str] = None, **advanced: Any) -> None:
    """Attach this rank to easyckpt. ``save_dir`` defaults to Megatron's ``args.save``. Or one ``Config``
    instead of the settings: ``initialize_easyckpt(config)`` / ``initialize_easyckpt(config=config, args=args)``.
    ``ckpt_format``: the layout of new checkpoints, "torch_dist" or "torch"; by default ``args.ckpt_format``
    when the args have one (Megatron-LM's default is torch_dist), else "torch"."""
    global _args
    if isinstance(save_mem_interval, Config):
        config, save_mem_interval = save_mem_interval, 1
    _args = args if args is not None else _megatron_args()
    fmt = ckpt_format or getattr(_args, "ckpt_format", None) or "torch"
    if fmt not in FORMATS:
        raise ConfigError(f"ckpt_format {fmt!r} is not written by easyckpt, which writes Megatron's "
                          f"{' and '.join(FORMATS)} layouts (not torch_dcp or fsdp_dtensor, Megatron's FSDP "
                          f"formats): pass --ckpt-format torch_dist (Megatron's default) or torch. Nothing was "
                          f"started and nothing in the save directory was touched")
    _format["ckpt_format"], _format["layout"] = fmt, None
    if config is None:
        save_dir = save_dir or getattr(_args, "save", None)
        if not save_dir:
            raise ConfigError("no save directory: pass save_dir=... or run under Megatron-LM with --save")
    _default.start(adapter_config("initialize_easyckpt", _state.NAMING, config, dict(
        save_dir=save_dir, save_mem_interval=save_mem_interval, save_storage_interval=save_storage_interval,
        max_ckpt_num=max_ckpt_num, log_file_path=log_file_path), advanced))


def save_checkpoint_if_needed(iteration: int, model: Model, optimizer: Optimizer, opt_param_scheduler: Scheduler,
                              num_floating_point_operations_so_far: Optional[float] = None) -> None:
    """Call every iteration after the optimizer step; snapshots and persists on the configured intervals."""
    state = MegatronState(model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far)
    _default.require().save(iteration, state, optimizer=optimizer, info={"layout": state.layout()})


def save_checkpoint_now(iteration: int, model: Model, optimizer: Optimizer, opt_param_scheduler: Scheduler,
                        num_floating_point_operations_so_far: Optional[float] = None) -> None:
    """Snapshot ``iteration`` (unless it already is) and have it persisted, without waiting for storage:
    what Megatron's own save points (--save-interval, exit signal, end of training) map to."""
    state = MegatronState(model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far)
    _default.require().save_now(iteration, state, info={"layout": state.layout()})


def save_checkpoint(iteration: int, model: Model, optimizer: Optimizer, opt_param_scheduler: Scheduler,
                    num_floating_point_operations_so_far: float = 0, checkpointing_context: Any = None,
                    *args: Any, **kwargs: Any) -> None:
    """Megatron's ``save_checkpoint`` signature, easyckpt's behaviour: snapshot + background persist."""
    save_checkpoint_now(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far)


def load_checkpoint(model: Model, optimizer: Optimizer, opt_param_scheduler: Scheduler, load_arg: str = "load",
                    strict: bool = True, concat: bool = False, elsewhere: Optional[str] = None,
                    **kwargs: Any) -> Tuple[int, float]:
    """Restore the newest complete state (memory or storage); ``(iteration, flops)`` or ``(0, 0)``. A
    torch_dist checkpoint resumes on any TP/PP/DP layout; a torch one with ``concat=True``. ``elsewhere``:
    where the caller resumes from when there is nothing (said on the console instead of "from the beginning")."""
    restored = _default.require().load(MegatronState(model, optimizer, opt_param_scheduler, strict=strict,
                                                     concat=concat, elsewhere=elsewhere))
    return (0, 0) if restored is None else restored


def _restore_training_counters(saved: Dict[str, Any], iteration: int) -> None:
    """What Megatron-LM's loader does besides tensors: sample counters, microbatch schedule, version."""
    args, ckpt_args = _megatron_args(), saved.get("args")
    if args is None:
        return
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        if hasattr(ckpt_args, name):
            setattr(args, name, getattr(ckpt_args, name))
    try:
        from megatron.core.num_microbatches_calculator import update_num_microbatches
        update_num_microbatches(consumed_samples=getattr(args, "consumed_train_samples", 0), verbose=True)
        from megatron.training import checkpointing
        checkpointing.set_checkpoint_version(saved.get("checkpoint_version", _state.CHECKPOINT_VERSION))
        checkpointing.set_loaded_iteration(iteration)
    except ImportError:
        pass


def checkpoint_metrics() -> Dict[str, float]:
    """This rank's checkpointing figures, ``{"easyckpt/<name>": number}`` (docs/metrics.md); the hook writes them
    to Megatron-LM's TensorBoard / W&B writers (logs.py). After finalize_easyckpt, the run's final ones."""
    return _default.metrics()


def finalize_easyckpt(timeout: Optional[float] = None) -> Optional[int]:
    """Persist and commit the newest state, then release shared memory. Returns the committed iteration."""
    return _default.finalize(timeout)


__all__ = ["initialize_easyckpt", "save_checkpoint_if_needed", "save_checkpoint_now", "save_checkpoint",
           "load_checkpoint", "finalize_easyckpt", "MegatronState"]
