"""Megatron's ``torch_dist`` layout (megatron.core.dist_checkpointing, the default --ckpt-format of
Megatron-LM core_v0.16): what easyckpt snapshots and persists when Megatron's args ask for it.

Per step directory ``iter_{N:07d}`` (the files Megatron's own torch_dist save writes, so that its loader
reads them on any TP/PP/DP layout):
    metadata.json        {"sharded_backend": "torch_dist", ...}: the backend its loader picks
    common.pt            torch.save of everything that is not sharded (args, iteration, the optimizer's
                         param groups, the scheduler, content_metadata): rank 0's
    .metadata            torch.distributed.checkpoint's Metadata (pickled by rank 0, from every rank's
                         item list gathered at the snapshot): each tensor's global shape, its chunks and
                         where each chunk's bytes lie
    __{r}_0.distcp       rank r's items: the main replica (replica_id 0) of every chunk it holds, each a
                         torch.save archive of the chunk, and its ShardedObjects (torch.save([obj]))
    easyckpt_rng/rank_{r:05d}.safetensors   every rank's own RNG states (exact resume; Megatron ignores it)

The training side only turns Megatron's ``sharded_state_dict`` into tensors and small pickles; the agent
writes the bytes from shared memory (shard formats DCP, TORCH and RAW of formats/shardformat.py). A snapshot also holds, for memory
only, the chunks this rank holds as a non-main replica, so that every rank resumes from its own memory.

Restore: from memory (same layout) each chunk of this rank's sharded state dict is copied back from the
snapshot; from storage, megatron.core.dist_checkpointing.load reads the chunks this rank needs, whatever
the layout the checkpoint was saved with: that is the resharding (TP, PP, DP sizes).
"""
from __future__ import annotations

import contextlib
import io
import json
from typing import Any, Collection, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

from easyckpt.engine.load.dcp import (
    DCP_METADATA,
    boxes_of,
    checked_by,
    data_file,
    data_files,
    gather_to_zero,
    reader_files,
    wanted_items,
)
from easyckpt.engine.load.dcp import metadata as dcp_metadata
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.engine.scratch import Stage
from easyckpt.engine.shards.safeload import safe_torch_load
from easyckpt.engine.shards.tree import dcp_item_size
from easyckpt.errors import CheckpointError
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.megatron import state as _state
from easyckpt.megatron.distopt import (
    fit_chain,
    own_distopt,
    pop_pieces,
    prime_adam,
    set_own_distopt,
)

COMMON = "common.pt"
METADATA_JSON = "metadata.json"
LOCAL = "easyckpt_dist/rank_{:05d}.safetensors"     # memory only: non-main replicas, and the item index
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}


def is_torch_dist(files: Collection[str]) -> bool:
    """Whether a checkpoint's files are the torch_dist layout."""
    return METADATA_JSON in files and DCP_METADATA in files


def layout(where: _state.Parallel, model: Any) -> str:
    """What must not change for a resume from memory: the parallel sizes and the model chunks."""
    return (f"tp{where.tp_size}.pp{where.pp_size}.dp{where.dp_size}.vp{len(_state.chunks(model))}"
            f".ep{where.ep_size}")


def same_tp_pp(saved: str, now: str) -> bool:
    """Whether two layouts (``layout()``) have the same TP and PP sizes."""
    return saved.split(".dp")[0] == now.split(".dp")[0]


def changed(saved: str, now: str) -> List[str]:
    """The sizes that differ between two layouts (``layout()``): ["tp", "vp", ...]."""
    def sizes(text: str) -> Dict[str, str]:
        return {part[:2]: part[2:] for part in text.split(".")}
    a, b = sizes(saved), sizes(now)
    return [k for k in ("tp", "pp", "dp", "vp", "ep") if a.get(k) != b.get(k)]


def same_layout(manifest: Optional[Manifest], common: Dict[str, Any], now: str) -> bool:
    """Whether a checkpoint in storage was saved on this run's TP and PP sizes (its RNG states then apply):
    by easyckpt's manifest, or for one Megatron wrote itself by the arguments in its common.pt."""
    saved = manifest.layout if manifest is not None else None
    if isinstance(saved, str):
        return same_tp_pp(saved, now)
    args = common.get("args")
    tp, pp = getattr(args, "tensor_model_parallel_size", None), getattr(args, "pipeline_model_parallel_size", None)
    return isinstance(tp, int) and isinstance(pp, int) and now.startswith(f"tp{tp}.pp{pp}.")


# the DistributedOptimizer sharding types whose state megatron-core's loader reads back (Megatron-LM's own
# saves are dp_reshardable by default; easyckpt writes fully_reshardable)
_SHARDING_TYPES = ("fully_reshardable", "dp_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter")


def content_metadata(optimizer: Any, saved: Any = None) -> Dict[str, Any]:
    """The sharded_state_dict options, recorded in common.pt as Megatron-LM does. A DistributedOptimizer
    is saved ``fully_reshardable``: the form Megatron's loader reshards on another TP/PP size. ``saved``:
    the options a stored checkpoint records (its common.pt's ``content_metadata``): a load asks for the keys
    it was written with, so that Megatron's own ``dp_reshardable`` checkpoints are read as they are."""
    meta: Dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if any(_state.is_distributed(o) for o in _state.optimizers(optimizer)):
        meta["distrib_optim_sharding_type"] = "fully_reshardable"
        meta["distrib_optim_fully_reshardable_mem_efficient"] = False
    if isinstance(saved, dict):
        for key in ("singleton_local_shards", "chained_optim_avoid_prefix",
                    "distrib_optim_fully_reshardable_mem_efficient"):
            if isinstance(saved.get(key), bool):
                meta[key] = saved[key]
        if "distrib_optim_sharding_type" in meta and saved.get("distrib_optim_sharding_type") in _SHARDING_TYPES:
            meta["distrib_optim_sharding_type"] = saved["distrib_optim_sharding_type"]
    return meta


def sharded_state_dict(iteration: int, model: Any, optimizer: Any, scheduler: Any, flops: float, args: Any,
                       where: _state.Parallel, is_loading: bool, rng: Optional[Dict[str, Any]] = None,
                       path_is_memory: bool = False, saved_metadata: Any = None) -> Dict[str, Any]:
    """Megatron-LM's generate_state_dict for torch_dist (checkpointing.py), from megatron-core alone. A
    DistributedOptimizer's state is this DP rank's own pieces (``own_distopt``) when saving and when
    loading from memory; Megatron's ``fully_reshardable`` request reads them back on any other layout."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    group = mpu.get_data_parallel_group(with_context_parallel=True)
    # Megatron-LM takes the state of the model inside its DDP / Float16Module wrappers: their keys
    chunks = unwrap_model(_state.chunks(model))
    sd: Dict[str, Any] = {"args": args, "checkpoint_version": _state.CHECKPOINT_VERSION, "iteration": iteration}
    for i, chunk in enumerate(chunks):
        sd[_state.model_key(i, len(chunks))] = chunk.sharded_state_dict(metadata={"dp_cp_group": group})
    meta = content_metadata(optimizer, saved_metadata)
    own = own_distopt(optimizer, sd) if not is_loading or path_is_memory else None
    if own is not None:
        sd["optimizer"] = own
    elif optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading,
                                                       metadata=dict(meta, dp_cp_group=group))
    if scheduler is not None:
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if rng is not None and mpu.get_expert_model_parallel_world_size() > 1:
        # Megatron-LM's naming with expert parallelism: one per (PP, TP, DP) rank
        dp, dp_size = (mpu.get_data_parallel_rank(with_context_parallel=True),
                       mpu.get_data_parallel_world_size(with_context_parallel=True))
        sd["rng_state"] = ShardedObject("rng_state", [rng], (where.pp_size, where.tp_size, dp_size),
                                        (where.pp, where.tp, dp), replica_id=0)
    elif rng is not None:
        sd["rng_state"] = ShardedObject("rng_state", [rng], (where.pp_size, where.tp_size), (where.pp, where.tp),
                                        replica_id=where.dp)
    sd["num_floating_point_operations_so_far"] = flops
    sd["content_metadata"] = meta
    return sd


def _chunk_id(key: str, offset: Sequence[int]) -> str:
    return f"{key}@{','.join(map(str, offset))}"


def collect(iteration: int, model: Any, optimizer: Any, scheduler: Any, flops: float, args: Any,
            where: _state.Parallel) -> List[ShardSpec]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    rng = _state.rng_capture()
    sd = sharded_state_dict(iteration, model, optimizer, scheduler, flops, args, where, False, rng)
    sharded, common = save_preprocess(sd, validate_access_integrity=False)
    items: List[Any] = []           # the distcp file's items, in file order
    ids: List[List[Any]] = []        # each one's [name, global offsets, sizes] (manifest items: partial reads)
    described: List[List[Any]] = []   # what rank 0 needs of each for the metadata
    index: List[List[Any]] = []      # memory: [chunk id, "d" (distcp item) | "t" (local tensor) | "o", position]
    local: List[torch.Tensor] = []
    objects: List[bytes] = []
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            if sh.flattened_range is not None:
                raise CheckpointError(f"{sh.key}: a flattened ShardedTensor cannot be saved in torch_dist")
            ident = _chunk_id(sh.key, sh.global_offset)
            sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            if is_main_replica(sh.replica_id):
                index.append([ident, "d", len(items)])
                items.append(sh.data.detach().reshape(sizes))
                ids.append([sh.key, list(sh.global_offset), list(sizes)])
                described.append(["t", sh.key, list(sh.global_offset), list(sizes),
                                  str(sh.dtype).replace("torch.", ""), list(sh.global_shape)])
            else:
                index.append([ident, "t", len(local)])
                local.append(sh.data.detach())
        elif isinstance(sh, ShardedObject):
            buf = io.BytesIO()
            torch.save([sh.data], buf)
            if is_main_replica(sh.replica_id):
                index.append([sh.unique_key, "d", len(items)])
                items.append(buf.getvalue())
                ids.append([sh.unique_key, None, None])
                described.append(["o", sh.unique_key])
            else:
                index.append([sh.unique_key, "o", len(objects)])
                objects.append(buf.getvalue())
        else:
            raise CheckpointError(f"torch_dist cannot save a {type(sh).__name__} of the sharded state dict")
    for d, item in zip(described, items):
        d.append(dcp_item_size(item))
    gathered = gather_to_zero(described)
    rank = where.rank
    shards = [ShardSpec(data_file(rank), list(zip(ids, items)), persist=True, fmt=ShardFormat.DCP),
              ShardSpec(COMMON, common, persist=rank == 0, fmt=ShardFormat.TORCH),
              ShardSpec(LOCAL.format(rank), {"index": index, "local": local, "objects": objects}, persist=False),
              ShardSpec(where.rng_file, {"iteration": iteration, "rng": rng}, persist=True)]
    if gathered is not None:
        shards.append(ShardSpec(METADATA_JSON, json.dumps(BACKEND), persist=True, fmt=ShardFormat.RAW))
        shards.append(ShardSpec(DCP_METADATA, dcp_metadata(gathered), persist=True, fmt=ShardFormat.RAW))
    return shards


# ---- load ---------------------------------------------------------------------------------------------

def request(model: Any, optimizer: Any, where: _state.Parallel) -> List[Tuple[str, List[int], List[int]]]:
    """Every chunk this rank will ask Megatron's reader for: (key, global offsets, sizes)."""
    for opt in _state.optimizers(optimizer):
        if _state.is_distributed(opt):
            prime_adam(opt)
    return _asked(sharded_state_dict(0, model, optimizer, None, 0.0, None, where, True))[0]


def _asked(sd: Dict[str, Any]) -> Tuple[List[Tuple[str, List[int], List[int]]], List[str]]:
    """The tensor chunks (key, global offsets, sizes) and the objects (unique keys) a load of the sharded state
    dict ``sd`` asks for; its factories are applied (pass one that is not loaded itself)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
    )

    apply_factories(sd)
    chunks = [(sh.key, list(sh.global_offset), [1] * sh.prepend_axis_num + list(sh.local_shape))
              for sh in nested_values(sd) if isinstance(sh, ShardedTensor)]
    return chunks, [sh.unique_key for sh in nested_values(sd) if isinstance(sh, ShardedObject)]


def needed(where: _state.Parallel, world_size: int, manifest: Manifest,
           wanted: Optional[List[Tuple[str, List[int], List[int]]]] = None) -> List[Tuple[Any, ...]]:
    """The small files, the data this rank's load reads, and its own RNG states. easyckpt's own
    checkpoints record each item's place and checksum (manifest ``items``): a rank reads and checks only
    the items its request (``wanted``) overlaps, the byte ranges Megatron's reader then takes. Else (a
    checkpoint Megatron wrote itself) rank i checks every whole file whose number is i modulo the world
    size: each is checked once."""
    # common.pt: easyckpt writes it (megatron-core reads it on every release); Megatron-LM 0.19's own saves
    # keep the common state inside the DCP checkpoint instead (common_state, read by common_state below)
    files: List[Tuple[Any, ...]] = [(COMMON, True), (METADATA_JSON, False), (DCP_METADATA, False)]
    data = data_files(manifest.files)
    if wanted is not None and data and all(manifest.files[rel].items is not None for rel in data):
        # every object: the RNG states (small) are asked for or not by restore, once common.pt is read
        takes = wanted_items(boxes_of(wanted), None)
        for rel in data:
            items = manifest.files[rel].items or ()
            picked = [i for i, item in enumerate(items) if takes(item.ident)]
            if picked:
                files.append((rel, False, picked))
    else:
        files += [(rel, False) for rel in checked_by(manifest.files, where.rank, world_size)]
    files.append((where.rng_file, True))
    return files


def common_state(trees: Dict[str, Any], path: Optional[str]) -> Dict[str, Any]:
    """The checkpoint's common (non-sharded) state: its common.pt, or for a checkpoint Megatron-LM 0.19 wrote
    itself, the ``common_state`` object in its DCP files (megatron-core's own reader), kept in ``trees`` as
    common.pt so that it is read once."""
    if COMMON not in trees:
        if path is None:
            raise CheckpointError("the snapshot in memory holds no common.pt")
        try:
            from megatron.core.dist_checkpointing.serialization import (
                load_common_state_dict,
            )
            trees[COMMON] = load_common_state_dict(path)
        except (ImportError, KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path}: no common.pt, and no common state in its DCP files ({exc})") from None
    return dict(trees[COMMON])


def restore(trees: Dict[str, Any], path: Optional[str], where: _state.Parallel, model: Any, optimizer: Any,
            scheduler: Any, strict: bool, same_layout: bool, exact: bool = True, split: bool = False,
            stage: Optional[Stage] = None) -> Dict[str, Any]:
    """Load into the live objects. ``path``: the committed step directory (storage; Megatron's reader
    takes the chunks this rank's layout needs, from the directory ``stage`` gives it for what this rank's
    request reads: engine/scratch.py; None: ``path`` itself), None: this rank's own snapshot in ``trees``
    (memory).
    ``same_layout``: the same TP and PP sizes; ``exact``: the same layout in every size (each rank's own
    RNG file then exists); ``split``: experts split over EP ranks, in the saved layout or this one."""
    common = common_state(trees, path)
    # the RNG comes from one source on every rank (Megatron's reader needs every rank to ask for the same
    # objects): each rank's own file on the same layout; else Megatron's per-(PP, TP) object, which with
    # split experts is one per DP rank and so exists for another DP size only by chance: then none
    own_rng = trees.get(where.rng_file) if exact else None
    load_rng = same_layout and own_rng is None and (exact or not split)
    for opt in _state.optimizers(optimizer):
        if _state.is_distributed(opt):
            prime_adam(opt)
    def build() -> Dict[str, Any]:
        return sharded_state_dict(int(common["iteration"]), model, optimizer, scheduler, 0.0, None, where, True,
                                  _state.rng_capture() if load_rng else None, path_is_memory=path is None,
                                  saved_metadata=common.get("content_metadata") if path is not None else None)
    sd = build()
    if path is not None:
        from megatron.core import dist_checkpointing
        if stage is None:
            opened: ContextManager[str] = contextlib.nullcontext(path)
        else:      # what this very request reads (a second copy of it: Megatron's load applies its factories)
            chunks, objects = _asked(build())
            opened = stage(wanted_items(boxes_of(chunks), set(objects)), reader_files("", (COMMON, METADATA_JSON)))
        with opened as here:
            state = dist_checkpointing.load(sd, here)
        fit_chain(state, optimizer)
    else:
        state = _fill_from_memory(sd, common, trees, where.rank)
    pieces = pop_pieces(state.get("optimizer"), len(_state.optimizers(optimizer))) if path is None else None
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(_state.chunks(model))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[_state.model_key(i, len(chunks))], strict=strict)
    if optimizer is not None and "optimizer" in state:
        with contextlib.ExitStack() as stack:
            for opt in _state.optimizers(optimizer):
                if _state.is_distributed(opt):
                    stack.enter_context(_state.torch_adam_copies(opt))
            optimizer.load_state_dict(state["optimizer"])
            for opt, own in zip(_state.optimizers(optimizer), pieces or ()):
                set_own_distopt(opt, own)
    if scheduler is not None and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if own_rng is not None and same_layout:
        _state.rng_restore(own_rng["rng"])
    elif load_rng and state.get("rng_state"):
        _state.rng_restore(state["rng_state"][0])
    return state


def _fill_from_memory(sd: Dict[str, Any], common: Dict[str, Any], trees: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """What megatron.core.dist_checkpointing.load does, with the chunks taken from this rank's snapshot."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factory_merges,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    mine = trees[LOCAL.format(rank)]
    items = trees[data_file(rank)]
    where = {ident: (kind, pos) for ident, kind, pos in mine["index"]}
    result = dict(common)
    sharded, nonpersistent, factories = load_preprocess(sd)
    merge(result, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)

    def take(sh: Any) -> Any:
        ident = sh.unique_key if isinstance(sh, ShardedObject) else _chunk_id(sh.key, sh.global_offset)
        if ident not in where:
            raise CheckpointError(f"the snapshot in memory has no {ident}: it was taken on another layout")
        kind, pos = where[ident]
        pool = {"d": items, "t": mine["local"], "o": mine["objects"]}.get(kind)
        if pool is None or type(pos) is not int or not 0 <= pos < len(pool):
            raise CheckpointError(f"the snapshot's index places {ident} at {kind!r} {pos!r}, which it does not hold")
        if isinstance(sh, ShardedObject):
            return safe_torch_load(pool[pos])[0]
        assert isinstance(sh, ShardedTensor)
        t = pool[pos]
        if not isinstance(t, torch.Tensor) or t.numel() != sh.data.numel():
            raise CheckpointError(f"{ident}: not a tensor of {sh.data.numel()} elements in memory")
        return t.reshape(sh.data.shape)

    dict_list_map_inplace(take, sharded)
    merge(result, sharded)
    return apply_factory_merges(result, factories)
