"""The sharding map every snapshot of Megatron's torch layout records per model-parallel rank (beside its
model file, as SHARDMAP): megatron-core's own sharding metadata of each saved tensor, so that a resume on
another TP/PP size (reshard_torch.py) knows where each saved piece sits in the whole tensor."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from easyckpt.megatron import state as _state

SHARDMAP = "easyckpt_shardmap.safetensors"
VERSION = 1

# an entry: [sharded key, global shape, global offset, block sizes (prepended axes included), first row,
#            rows (-1: the whole tensor), whether Megatron allows the global shape to differ (padded vocab)]
Entry = List[Any]
_cache: Dict[Tuple[Any, ...], Dict[str, Any]] = {}


def shard_map(model: Any, optimizer: Any, layout: str) -> Dict[str, Any]:
    """This rank's map; computed at a process's first snapshot (its model's structure does not change)."""
    ident = (layout, optimizer is None) + tuple(id(c) for c in _state.chunks(model)) + (id(optimizer),)
    if ident not in _cache:
        _cache.clear()
        _cache[ident] = _compute(model, optimizer, layout)
    return _cache[ident]


def live_tensors(wrapped: List[Any]) -> Dict[str, torch.Tensor]:
    """Every tensor Megatron's legacy file holds of the model, as "model[i]/<state dict key>": views of the
    live parameters and buffers."""
    return {f"{_state.model_key(i, len(wrapped))}/{name}": t for i, chunk in enumerate(wrapped)
            for name, t in chunk.state_dict_for_save_checkpoint().items() if isinstance(t, torch.Tensor)}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _locate(data: torch.Tensor, candidates: Sequence[Tuple[str, torch.Tensor]]) -> Optional[Tuple[str, int, int]]:
    """Which saved tensor ``data`` is, or which run of its rows: (path, first row, rows; -1 = whole)."""
    for path, t in candidates:
        if t.dtype != data.dtype:
            continue
        if (t.shape == data.shape and t.stride() == data.stride()
                and t.storage_offset() == data.storage_offset()):
            return path, 0, -1
        if t.dim() >= 1 and t.is_contiguous() and data.is_contiguous() and t.numel():
            row = t.numel() // t.shape[0]
            delta = data.storage_offset() - t.storage_offset()
            if row and delta >= 0 and delta % row == 0 and data.numel() % row == 0:
                first, rows = delta // row, data.numel() // row
                if first + rows <= t.shape[0]:
                    return path, first, rows
    return None


def _compute(model: Any, optimizer: Any, layout: str) -> Dict[str, Any]:
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.utils import unwrap_model

    wrapped = _state.chunks(model)
    by_storage: Dict[int, List[Tuple[str, torch.Tensor]]] = {}
    for path, t in live_tensors(wrapped).items():
        by_storage.setdefault(_storage(t), []).append((path, t))
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    tensors: Dict[str, List[Entry]] = {}
    for chunk in unwrap_model(wrapped):
        sd = chunk.sharded_state_dict(metadata={"dp_cp_group": group})
        apply_factories(sd)
        for sh in nested_values(sd):
            if not isinstance(sh, ShardedTensor) or sh.flattened_range is not None:
                continue
            found = _locate(sh.data, by_storage.get(_storage(sh.data), []))
            if found is None:
                continue
            path, first, rows = found
            sizes = [1] * sh.prepend_axis_num + list(sh.local_shape)
            tensors.setdefault(path, []).append([sh.key, list(sh.global_shape), list(sh.global_offset), sizes,
                                                 first, rows, bool(sh.allow_shape_mismatch)])
    names = _state.param_names(wrapped)
    params: Dict[str, str] = {}
    for p, name in names.items():
        found = _locate(p.detach(), by_storage.get(_storage(p), []))
        if found is not None and found[2] == -1:
            params[name] = found[0]
    opt_params: List[Optional[List[str]]] = []
    for opt in _state.optimizers(optimizer):
        if _state.is_distributed(opt):
            opt_params.append([])        # its per-DP-rank shards name their parameters themselves
            continue
        order = [p for g in opt.optimizer.param_groups for p in g["params"]]
        # torch's optimizer state is indexed by position over its param groups; None: its parameters are
        # not the model's (Float16Optimizer's fp32 copies), which this map cannot place
        opt_params.append([names[p] for p in order] if all(p in names for p in order) else None)
    return {"version": VERSION, "layout": layout, "tensors": tensors, "params": params, "opt_params": opt_params}
