"""Megatron state ↔ easyckpt shards: what Megatron itself saves, in its native torch layout.

Per rank at (tp, pp, dp), for iteration N (directory ``iter_{N:07d}``):
    mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt   Megatron's own file (torch.save): args, checkpoint_version,
        iteration, model / model{i} (virtual pipeline chunks), optimizer, opt_param_scheduler, rng_state,
        num_floating_point_operations_so_far — written once per (tp, pp), by data-parallel rank 0
    mp_rank_.../distrib_optim_dp{dp:03d}.pt          with the DistributedOptimizer: this DP rank's shard of
        the fp32 main params and Adam moments (per DP rank, so no gather stalls the save; Megatron's own
        single-file ``distrib_optim.pt`` is produced by the converter, easyckpt.cli.convert)

A checkpoint Megatron wrote itself (adopted, engine/load/adopt.py) has ``distrib_optim.pt`` (DP rank 0's gathered
"dp_zero" state) and no per-DP shards: DP rank 0 reads it and megatron-core's own
``load_parameter_state_from_dp_zero`` scatters it, so any data-parallel size resumes from it without concat.
    easyckpt_rng/rank_{r:05d}.safetensors             every rank's own RNG states (Megatron keeps DP rank 0's)

This module holds no file I/O: it turns live Megatron objects into ShardSpecs and trees back into them.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

from easyckpt.config import NAMINGS
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.errors import CheckpointError
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.shardformat import ShardFormat

NAMING = NAMINGS["megatron"]
CHECKPOINT_VERSION = 3.0


@dataclass(frozen=True)
class Parallel:
    rank: int
    tp: int
    pp: int
    dp: int
    tp_size: int
    pp_size: int
    dp_size: int
    ep: int = 0           # expert-model-parallel rank (MoE)
    ep_size: int = 1
    edp: int = 0          # expert-data-parallel rank: with EP > 1, who writes the model file of this EP rank

    @property
    def mp_dir(self) -> str:
        # Megatron-LM's get_checkpoint_name: an EP rank suffix when the experts are split
        base = f"mp_rank_{self.tp:02d}" if self.pp_size == 1 else f"mp_rank_{self.tp:02d}_{self.pp:03d}"
        return base + (f"_{self.ep:03d}" if self.ep_size > 1 else "")

    @property
    def writes_model(self) -> bool:
        """Megatron-LM writes model_optim_rng.pt on data-parallel rank 0 (expert-data-parallel with EP > 1)."""
        return (self.edp if self.ep_size > 1 else self.dp) == 0

    @property
    def model_file(self) -> str:
        return f"{self.mp_dir}/model_optim_rng.pt"

    @property
    def distopt_file(self) -> str:
        return f"{self.mp_dir}/distrib_optim_dp{self.dp:03d}.pt"

    @property
    def rng_file(self) -> str:
        return f"easyckpt_rng/rank_{self.rank:05d}.safetensors"


def parallel() -> Parallel:
    from megatron.core import parallel_state as mpu
    return Parallel(torch.distributed.get_rank(), mpu.get_tensor_model_parallel_rank(),
                    mpu.get_pipeline_model_parallel_rank(), mpu.get_data_parallel_rank(),
                    mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                    mpu.get_data_parallel_world_size(), mpu.get_expert_model_parallel_rank(),
                    mpu.get_expert_model_parallel_world_size(), mpu.get_expert_data_parallel_rank())


def model_key(i: int, count: int) -> str:
    """Megatron-LM's name of model chunk ``i`` of ``count`` in its checkpoints: "model", or "model{i}" (VP)."""
    return "model" if count == 1 else f"model{i}"


def chunks(model: Any) -> List[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def optimizers(optimizer: Any) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else []))


def is_distributed(opt: Any) -> bool:
    return hasattr(opt, "gbuf_ranges") and hasattr(opt, "_get_main_param_and_optimizer_states")


# ---- RNG (Megatron's own rng_state dict, plus the tensor-parallel tracker) ----------------------------

def rng_capture() -> Dict[str, Any]:
    from megatron.core import tensor_parallel
    try:
        cuda_state = torch.cuda.get_rng_state()
    except (RuntimeError, AssertionError, AttributeError):   # no CUDA: Megatron's loader still expects the key
        cuda_state = torch.get_rng_state()
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": cuda_state,
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def rng_restore(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    try:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    except (RuntimeError, AssertionError, AttributeError):
        pass
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


# ---- DistributedOptimizer parameter state, this DP rank's shard -------------------------------------

def _distopt_params(opt: Any):
    """Model params in the optimizer's bucket order (the same on every run with the same layout)."""
    for gbuf_idx, range_maps in enumerate(opt.gbuf_ranges):
        for dtype, buckets in range_maps.items():
            for bucket_idx, bucket in enumerate(buckets):
                for model_param, ranges in bucket["param_map"].items():
                    yield (gbuf_idx, dtype, bucket_idx), model_param, ranges


def param_names(model: Sequence[Any]) -> Dict[Any, str]:
    return {p: f"{i}.{n}" for i, chunk in enumerate(chunks(model)) for n, p in chunk.named_parameters()}


def distopt_state(opt: Any, names: Dict[Any, str]) -> Dict[str, Any]:
    """This DP rank's shard of every parameter it owns, with the range of the flattened parameter it
    covers (what concat=True needs to reassemble full parameters on another data-parallel size)."""
    params = []
    for where, model_param, ranges in _distopt_params(opt):
        tensors = opt._get_main_param_and_optimizer_states(model_param)
        sub = ranges["param"]
        gbuf_idx, key, bucket_idx = where
        params.append({"name": names[model_param], "gbuf": gbuf_idx, "key": key, "bucket": bucket_idx,
                       # where the whole parameter starts in its bucket (Megatron's gathered layout)
                       "bucket_start": ranges["gbuf_world_in_bucket"].start - sub.start,
                       "range": [sub.start, sub.end], "numel": model_param.numel(), **tensors})
    # expert parameters (MoE; Megatron marks them allreduce=False) have their own data-parallel group: the
    # converter gathers their shards per expert-parallel rank
    expert = any(not getattr(p, "allreduce", True) for _, p, _ in _distopt_params(opt))
    return {"per_bucket_numel_unpadded": opt.per_bucket_numel_unpadded, "params": params, "expert": expert}


def assemble(shards: List[Dict[str, Any]]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every parameter's whole main value and moments (flattened), from the shards of all DP ranks."""
    full: Dict[str, Dict[str, torch.Tensor]] = {}
    for shard in shards:
        for entry in shard["params"]:
            start, end = entry["range"]
            dst = full.setdefault(entry["name"], {})
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:               # "step": the same on every shard
                    dst[key] = value
                    continue
                if key not in dst:
                    dst[key] = torch.full((entry["numel"],), float("nan"), dtype=value.dtype)
                dst[key][start:end] = value.reshape(-1)
    return full


def distopt_restore_concat(opt: Any, shards: List[Dict[str, Any]], names: Dict[Any, str]) -> None:
    """Reassemble every parameter from the shards of all saved DP ranks, then take the slice this rank
    owns under the current data-parallel layout."""
    distopt_set_whole(opt, assemble(shards), names)


def distopt_set_whole(opt: Any, full: Dict[str, Dict[str, torch.Tensor]], names: Dict[Any, str]) -> None:
    """Give each parameter this DP rank owns its slice of the whole (flattened) main value and moments."""
    for _, model_param, ranges in _distopt_params(opt):
        name = names[model_param]
        if name not in full:
            raise CheckpointError(f"the checkpoint has no optimizer state for parameter {name}")
        sub = ranges["param"]
        tensors = {k: (v if v.dim() == 0 else v[sub.start:sub.end]) for k, v in full[name].items()}
        if any(v.dim() and torch.isnan(v).any() for v in tensors.values()):
            raise CheckpointError(f"the saved shards do not cover parameter {name} entirely")
        _ensure_adam_state(opt, model_param, tensors)
        opt._set_main_param_and_optimizer_states(model_param, tensors)


def distopt_restore(opt: Any, state: Dict[str, Any]) -> None:
    mine = list(_distopt_params(opt))
    saved = state["params"]
    if len(saved) != len(mine) or state["per_bucket_numel_unpadded"] != opt.per_bucket_numel_unpadded:
        raise CheckpointError("the distributed-optimizer shard does not match this run's parameter layout; "
                              "resuming on another data-parallel size needs load_checkpoint(..., concat=True)")
    for entry, (_, model_param, _) in zip(saved, mine):
        tensors = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
        _ensure_adam_state(opt, model_param, tensors)
        opt._set_main_param_and_optimizer_states(model_param, tensors)


def distopt_restore_dp_zero(opt: Any, state: Any) -> None:
    """megatron-core's own scatter of Megatron's ``distrib_optim.pt`` (``state`` on DP rank 0, None elsewhere;
    a collective over the data-parallel group)."""
    with torch_adam_copies(opt):
        opt.load_parameter_state_from_dp_zero(state)


@contextlib.contextmanager
def torch_adam_copies(opt: Any) -> Iterator[None]:
    """While megatron-core copies saved states into a DistributedOptimizer (its own loaders), supply what
    its per-parameter copy lacks on the torch-Adam path (no TE/Apex): Adam state to copy into, the step
    (kept in the param groups, not with the tensors) on each parameter as its own tensor, and no autograd
    on the main params (views of fp32 model params)."""
    if "_set_main_param_and_optimizer_states" in vars(opt):     # already inside one: nothing to add
        yield
        return
    original = opt._set_main_param_and_optimizer_states

    def set_states(model_param: Any, tensors: Dict[str, torch.Tensor]) -> None:
        group_index, group_order = opt.model_param_group_index_map[model_param]
        current = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in current:
            tensors = dict(tensors, step=current["step"])
        _ensure_adam_state(opt, model_param, tensors)
        original(model_param, tensors)

    opt._set_main_param_and_optimizer_states = set_states
    try:
        with torch.no_grad():
            yield
    finally:
        del opt._set_main_param_and_optimizer_states


def _ensure_adam_state(opt: Any, model_param: Any, tensors: Dict[str, torch.Tensor]) -> None:
    """torch Adam creates its state at the first step, so a fresh optimizer has nowhere to copy into;
    and without TE/Apex, DistributedOptimizer.load_state_dict gives every parameter the SAME "step"
    tensor, which torch Adam then increments once per parameter per step: each needs its own."""
    group_index, group_order = opt.model_param_group_index_map[model_param]
    main = opt.optimizer.param_groups[group_index]["params"][group_order]
    state = opt.optimizer.state[main]
    for key, value in tensors.items():
        if key == "step":
            state[key] = value.detach().clone()
        elif key != "param" and key not in state and isinstance(value, torch.Tensor):
            # (Megatron's dp_reshardable state also carries flags, such as "padding": not Adam state)
            state[key] = torch.zeros_like(value, device=main.device)


# ---- collect / restore ------------------------------------------------------------------------------

def collect(iteration: int, model: Any, optimizer: Any, scheduler: Any, flops: float,
            args: Any, where: Parallel) -> List[ShardSpec]:
    model = chunks(model)
    state: Dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    for i, chunk in enumerate(model):
        state[model_key(i, len(model))] = chunk.state_dict_for_save_checkpoint()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    rng = rng_capture()
    state["rng_state"] = [rng]
    state["num_floating_point_operations_so_far"] = flops
    shards = [ShardSpec(where.model_file, state, persist=where.writes_model, fmt=ShardFormat.TORCH)]
    dist_opts = [o for o in optimizers(optimizer) if is_distributed(o)]
    if dist_opts:
        names = param_names(model)
        shards.append(ShardSpec(where.distopt_file, [distopt_state(o, names) for o in dist_opts], persist=True,
                                fmt=ShardFormat.TORCH))
    shards.append(ShardSpec(where.rng_file, {"iteration": iteration, "rng": rng}, persist=True))
    return shards


def dp_zero_file(where: Parallel) -> str:
    """Megatron's own DistributedOptimizer file (--ckpt-format torch): the state gathered on DP rank 0."""
    return f"{where.mp_dir}/distrib_optim.pt"


def needed(where: Parallel, optimizer: Any, manifest: Manifest, concat: bool) -> List[Tuple[str, bool]]:
    files = [(where.model_file, False)]
    if any(is_distributed(o) for o in optimizers(optimizer)):
        shard_prefix = f"{where.mp_dir}/distrib_optim_dp"
        if dp_zero_file(where) in manifest.files and not any(r.startswith(shard_prefix) for r in manifest.files):
            if where.dp == 0:   # written by Megatron itself: DP rank 0 reads it and scatters (restore)
                files.append((dp_zero_file(where), False))
        elif concat:   # every saved DP rank's shard of this (tp, pp)
            prefix = f"{where.mp_dir}/distrib_optim_dp"
            shards = sorted(r for r in manifest.files if r.startswith(prefix))
            if not shards:
                raise CheckpointError(f"no distributed-optimizer shards under {where.mp_dir} in the checkpoint")
            files.extend((r, False) for r in shards)
        else:
            files.append((where.distopt_file, False))
    files.append((where.rng_file, True))
    return files


def restore(trees: Dict[str, Any], where: Parallel, model: Any, optimizer: Any, scheduler: Any,
            strict: bool, concat: bool = False) -> Dict[str, Any]:
    state = trees[where.model_file]
    model = chunks(model)
    for i, chunk in enumerate(model):
        chunk.load_state_dict(state[model_key(i, len(model))], strict=strict)
    if optimizer is not None and "optimizer" in state:
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
            dist_opts = [o for o in optimizers(optimizer) if is_distributed(o)]
            prefix = f"{where.mp_dir}/distrib_optim_dp"
            if dist_opts and where.distopt_file not in trees and not any(r.startswith(prefix) for r in trees):
                saved = trees.get(dp_zero_file(where))     # None on DP ranks other than 0
                chained = optimizers(optimizer)
                for opt in dist_opts:
                    own = saved if len(chained) == 1 or saved is None else saved[chained.index(opt)]
                    distopt_restore_dp_zero(opt, own)
            elif dist_opts and concat:
                saved = [trees[r] for r in sorted(trees) if r.startswith(prefix)]
                names = param_names(model)
                for i, opt in enumerate(dist_opts):
                    distopt_restore_concat(opt, [s[i] for s in saved], names)
            elif dist_opts:
                for opt, shard in zip(dist_opts, trees[where.distopt_file]):
                    distopt_restore(opt, shard)
    if scheduler is not None and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    own = trees.get(where.rng_file)
    if own is not None:
        rng_restore(own["rng"])
    elif state.get("rng_state"):
        # Megatron's own list: one entry, or one per DP rank with --data-parallel-random-init
        saved = state["rng_state"]
        rng_restore(saved[where.dp] if len(saved) > where.dp else saved[0])
    return state

