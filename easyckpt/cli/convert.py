"""Convert easyckpt's per-DP-rank DistributedOptimizer shards into Megatron's own ``distrib_optim.pt``.

easyckpt stores the DistributedOptimizer state per data-parallel rank (``distrib_optim_dp{r:03d}.pt``)
so that a save needs no gather. Megatron-LM's ``--ckpt-format torch`` loader instead reads one
``distrib_optim.pt`` per (tp, pp): the "dp_zero" form that ``DistributedOptimizer.save_parameter_state``
writes — per grad buffer and dtype key, flat fp32 ``param``/``exp_avg``/``exp_avg_sq`` tensors over
every bucket's unpadded range, in bucket order. This module builds that file from the shards and adds
it to the step's manifest, so ``easyckpt verify`` keeps covering it.
"""
from __future__ import annotations

import io
import os
import re
from typing import Any, Dict, List

import torch

from easyckpt.errors import CheckpointError
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import NAMINGS
from easyckpt.megatron.state import assemble
from easyckpt.storage import stepfiles
from easyckpt.storage.savedir import SaveDir
from easyckpt.trainer.tree import safe_torch_load

_SHARD = re.compile(r"^(mp_rank_[0-9_]+)/distrib_optim_dp(\d{3})\.pt$")


def dp_zero_state(shards: List[Dict[str, Any]]) -> Dict[Any, Any]:
    """Megatron's gathered parameter state from all DP ranks' shards of one optimizer."""
    full = assemble(shards)
    placement = {e["name"]: e for s in shards for e in s["params"]}
    numels = shards[0]["per_bucket_numel_unpadded"]
    state: Dict[Any, Any] = {"buckets_coalesced": True}
    for gbuf_idx, per_key in enumerate(numels):
        state[gbuf_idx] = {}
        for key, bucket_numels in per_key.items():
            total = sum(bucket_numels)
            world = {k: torch.zeros(total, dtype=torch.float32) for k in ("param", "exp_avg", "exp_avg_sq")}
            world["numel_unpadded"] = total
            offsets = [sum(bucket_numels[:i]) for i in range(len(bucket_numels))]
            for name, entry in placement.items():
                if entry["gbuf"] != gbuf_idx or entry["key"] != key:
                    continue
                at = offsets[entry["bucket"]] + entry["bucket_start"]
                for k in ("param", "exp_avg", "exp_avg_sq"):
                    if k in full[name]:
                        world[k][at:at + entry["numel"]] = full[name][k]
            state[gbuf_idx][key] = world
    return state


def to_megatron_distrib_optim(step_dir: str) -> List[str]:
    """Write ``mp_rank_*/distrib_optim.pt`` for every (tp, pp) of a committed step; returns their paths."""
    try:
        man = stepfiles.load(step_dir)      # its file names are checked: each shard is read inside the step only
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{step_dir} is not a committed easyckpt checkpoint (no valid manifest: {exc})") from None
    groups: Dict[str, List[str]] = {}
    for rel in man["files"]:
        m = _SHARD.match(rel)
        if m:
            groups.setdefault(m.group(1), []).append(rel)
    if not groups:
        raise ValueError(f"{step_dir} holds no distributed-optimizer shards (distrib_optim_dp*.pt)")
    written, entries = [], {}
    sd = SaveDir(os.path.dirname(step_dir), NAMINGS["megatron"])
    for mp_dir, rels in sorted(groups.items()):
        shard_lists = []
        for rel in sorted(rels):
            data = stepfiles.read_verified(step_dir, rel, man)
            shard_lists.append(safe_torch_load(data))
        if len(shard_lists[0]) != 1:
            raise ValueError("only a single DistributedOptimizer (not a ChainedOptimizer) can be converted")
        buf = io.BytesIO()
        torch.save(dp_zero_state([s[0] for s in shard_lists]), buf)
        rel = f"{mp_dir}/distrib_optim.pt"
        entries[rel] = {"size": buf.getbuffer().nbytes, "checksum": mf.checksum(buf.getbuffer()), "format": "torch"}
        sd.add_file(step_dir, rel, buf.getvalue())
        written.append(os.path.join(step_dir, rel))
    sd.add_to_manifest(step_dir, entries)
    return written
