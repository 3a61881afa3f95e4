"""A model whose state is DTensors (FSDP2's ``torch.distributed.fsdp.fully_shard``, or any model whose
parameters are DTensors) and its optimizer, for the plain-PyTorch adapter (pytorch.py): saved in torch
DCP's layout, so that ``torch.distributed.checkpoint.load`` reads a committed step and a resume on another
world size reshards through DCP's own reader.

A snapshot is what ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives, ``{"model": ...,
"optim": ...}`` (DCP's key convention: ``model.<fqn>``, ``optim.state.<fqn>.exp_avg``,
``optim.param_groups.0.lr``), planned by DCP's own DefaultSavePlanner: each rank keeps the chunks of its
local shards, nothing is gathered. Each rank writes the main replica of what it holds (every shard of a
1-D FSDP mesh; on a mesh with replicated dimensions, the ranks at coordinate 0 of those; objects and
replicated tensors such as Adam's ``step``: rank 0) to its ``__{rank}_0.distcp``; rank 0 writes
``.metadata`` (engine/load/dcp.py). What a rank holds but does not write stays in its memory snapshot
(``LOCAL``), so that a restart on the same layout restores from memory alone.

Restore: from storage through DCP's FileSystemReader on the committed step (the files a rank needs were
checked against the manifest first: rank r checks every data file whose number is r modulo the world
size); from memory through a reader over the snapshot (no collective). Then ``set_state_dict`` puts the
state into the live model and optimizer.

The ``*_state`` functions do the same for any DCP state dict in a sub-directory of the step (``prefix``):
the Trainer's FSDP layout is two DCP checkpoints, ``pytorch_model_fsdp_0/`` (``{"model": ...}``) and
``optimizer_0/`` (``{"optimizer": ...}``), as accelerate's save_fsdp_model / save_fsdp_optimizer write them.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from easyckpt.engine.load.dcp import (
    DCP_METADATA,
    Wanted,
    boxes_of,
    checked_by,
    data_file,
    gather_to_zero,
    metadata,
    reader_files,
    wanted_items,
)
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.engine.scratch import Stage
from easyckpt.engine.shards.safeload import safe_torch_load
from easyckpt.engine.shards.tree import dcp_item_size
from easyckpt.errors import CheckpointError
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.shardformat import ShardFormat

LOCAL = "easyckpt_dcp/rank_{:05d}.safetensors"     # memory only: what this rank holds and another writes


def is_dtensor_model(model: torch.nn.Module) -> bool:
    # a DTensor parameter means its module was imported: without it, no need to import it (most of a second)
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(p, module.DTensor) for p in model.parameters())


def _state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
    )
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)      # (creates a fresh optimizer's state, at zero)
    return {"model": msd, "optim": osd}


def _main_replica(value: Any, rank: int) -> bool:
    """Whether this rank writes ``value``: a DTensor's chunk on the first rank of every replicated mesh
    dimension; anything else (objects, plain tensors, identical on every rank) on rank 0."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        coordinate = list(value.device_mesh.get_coordinate() or ())
        return all(c == 0 for c, p in zip(coordinate, value.placements) if p.is_replicate())
    return rank == 0


def collect(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], rank: int) -> List[ShardSpec]:
    """The model's and optimizer's state as one DCP checkpoint at the step's top (collect_state)."""
    return collect_state(_state(model, optimizer), rank)


def collect_state(state: Dict[str, Any], rank: int, prefix: str = "") -> List[ShardSpec]:
    """This rank's data file (the items it writes), its memory-only LOCAL (the rest of what it holds) and,
    on rank 0, ``.metadata`` (a gather of every rank's item list: a collective, on every rank), for the
    DCP state dict ``state``, under ``prefix`` ("" or "<sub dir>/")."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, rank == 0)
    plan = planner.create_local_plan()
    flat = planner.state_dict
    ids: List[List[Any]] = []
    items: List[Any] = []
    described: List[List[Any]] = []
    index: List[List[Any]] = []        # [fqn, offsets, "d" (data file) | "l" (LOCAL), position, global size]
    local: List[Any] = []
    for wi in plan.items:
        data = planner.resolve_data(wi)
        item = data.getvalue() if isinstance(data, io.BytesIO) else data.detach()
        fqn = wi.index.fqn
        chunk = wi.tensor_data.chunk if wi.type != WriteItemType.BYTE_IO and wi.tensor_data else None
        offsets = list(chunk.offsets) if chunk is not None else None
        size = list(wi.tensor_data.size) if chunk is not None and wi.tensor_data is not None else None
        if not _main_replica(flat.get(fqn), rank):
            index.append([fqn, offsets, "l", len(local), size])
            local.append(item)
            continue
        index.append([fqn, offsets, "d", len(items), size])
        if chunk is None:
            ids.append([fqn, None, None])
            described.append(["o", fqn])
        else:
            assert wi.tensor_data is not None
            ids.append([fqn, offsets, list(chunk.sizes)])
            described.append(["t", fqn, offsets, list(chunk.sizes), str(wi.tensor_data.properties.dtype)
                              .replace("torch.", ""), list(wi.tensor_data.size)])
        items.append(item)
    for d, item in zip(described, items):
        d.append(dcp_item_size(item))
    gathered = gather_to_zero(described)
    shards = [ShardSpec(prefix + data_file(rank), list(zip(ids, items)), persist=True, fmt=ShardFormat.DCP),
              ShardSpec(prefix + LOCAL.format(rank), {"index": index, "local": local}, persist=False)]
    if gathered is not None:
        shards.append(ShardSpec(prefix + DCP_METADATA, metadata(gathered), persist=True, fmt=ShardFormat.RAW))
    return shards


def local_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> int:
    """About what this rank's snapshot holds: its local shards of the parameters and of the optimizer's
    state (Adam: two moments per parameter when it has none yet)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: Any) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = sum(nbytes(p) for p in model.parameters())
    if optimizer is None:
        return params
    state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values())
    return params + (state or 2 * params)


def needed(manifest: Manifest, rank: int, world_size: int, prefix: str = "") -> List[Tuple[str, bool]]:
    """``.metadata`` and the data files this rank checks (each checked once, by rank ``n % world_size``):
    DCP's reader then takes from them what this rank's shards need, on any world size."""
    if prefix + DCP_METADATA not in manifest.files:
        raise CheckpointError(f"step {manifest.step} holds no torch DCP checkpoint ({prefix}{DCP_METADATA}): it was "
                              f"saved from a model without FSDP; it restores only into a model whose parameters "
                              f"are not DTensors")
    under = [rel[len(prefix):] for rel in manifest.files if rel.startswith(prefix) and "/" not in rel[len(prefix):]]
    return [(prefix + DCP_METADATA, False)] + [(prefix + rel, False) for rel in checked_by(under, rank, world_size)]


def restore(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], trees: Dict[str, Any],
            path: Optional[str], rank: int, stage: Optional[Stage] = None) -> None:
    """Load the checkpoint into the live model and optimizer: from the committed step ``path`` through
    DCP's own reader (any world size; ``stage``: how it is opened, see load_state), or from this rank's memory
    snapshot (``path`` None)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_state_dict,
    )

    state = _state(model, optimizer)
    load_state(state, trees, path, rank, stage=stage)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_state(state: Dict[str, Any], trees: Dict[str, Any], path: Optional[str], rank: int, prefix: str = "",
               stage: Optional[Stage] = None) -> None:
    """Fill the DCP state dict ``state`` (its tensors in place) from the checkpoint under ``prefix``: of the
    committed step ``path`` through DCP's own reader (any world size; a collective), or from this rank's
    memory snapshot (``path`` None; no collective). ``stage`` opens the step for the reader (engine/scratch.py:
    from an object store, a local copy of only the items this rank's state reads); None: ``path`` as it is."""
    import torch.distributed.checkpoint as dcp

    if path is not None:
        opened = stage(asked(state), reader_files(prefix)) if stage is not None else contextlib.nullcontext(path)
        with opened as here:
            dcp.load(state, checkpoint_id=os.path.join(here, prefix) if prefix else here, planner=_safe_planner())
    else:
        # defined on DCP's StorageReader, so imported only here
        from easyckpt.engine.load.dcpmemory import MemoryReader
        dcp.load(state, storage_reader=MemoryReader(trees, rank, LOCAL, prefix), planner=_safe_planner(),
                 no_dist=True)


def asked(state: Dict[str, Any]) -> Wanted:
    """Which saved items a DCP load of ``state`` reads: the chunks overlapping what this rank holds of each
    tensor (DCP's save planner, as coordinator, lists every local chunk and every object), and its objects."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, True)
    chunks, objects = [], set()
    for wi in planner.create_local_plan().items:
        if wi.type == WriteItemType.BYTE_IO or wi.tensor_data is None:
            objects.add(wi.index.fqn)
        else:
            chunks.append((wi.index.fqn, list(wi.tensor_data.chunk.offsets), list(wi.tensor_data.chunk.sizes)))
    return wanted_items(boxes_of(chunks), objects)


def _safe_planner() -> Any:
    """DCP's DefaultLoadPlanner, except that an object item (param_groups' values, say) is read with the
    allow-list of safe_torch_load: DCP's own load_bytes unpickles it whole (``weights_only=False``)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            checked = safe_torch_load(value.getbuffer())        # refuses anything but plain data
            again = io.BytesIO()
            torch.save(checked, again)                          # what DCP's planner then loads is ours
            again.seek(0)
            super().load_bytes(read_item, again)

    return SafeLoadPlanner()
