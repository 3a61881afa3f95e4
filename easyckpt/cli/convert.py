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

from easyckpt.engine.shards.safeload import safe_torch_load
from easyckpt.errors import CheckpointError
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import NAMINGS
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.megatron.state import assemble
from easyckpt.storage import stepfiles
from easyckpt.storage.savedir import SaveDir

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
    """Write ``mp_rank_*/distrib_optim.pt`` for every (tp, pp) of a committed step; returns their paths.

    A ChainedOptimizer (MoE with expert parallelism: dense and expert parameters apart) is written as
    megatron-core's ``ChainedOptimizer.save_parameter_state`` writes it: per ``mp_rank_..._EEE`` directory a
    list with one entry per optimizer. A dense optimizer's data-parallel group spans the expert-parallel
    ranks of its (tp, pp), so its gathered state goes to the directory of its DP rank 0 (None elsewhere); an
    expert optimizer's group is the ranks of one directory."""
    try:
        man = stepfiles.load(step_dir)      # its file names are checked: each shard is read inside the step only
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{step_dir} is not a committed easyckpt checkpoint (no valid manifest: {exc})") from None
    groups: Dict[str, List[str]] = {}
    for rel in man.files:
        m = _SHARD.match(rel)
        if m:
            groups.setdefault(m.group(1), []).append(rel)
    if not groups:
        raise ValueError(f"{step_dir} holds no distributed-optimizer shards (distrib_optim_dp*.pt)")
    shards = {rel: safe_torch_load(stepfiles.read_verified(step_dir, rel, man)) for rels in groups.values()
              for rel in sorted(rels)}
    counts = {len(s) for s in shards.values() if isinstance(s, list) and all(isinstance(x, dict) for x in s)}
    if len(counts) != 1 or len(shards) != sum(len(r) for r in groups.values()):
        raise CheckpointError(f"{step_dir}: the optimizer shards do not all hold the same optimizers")
    count = counts.pop()
    layout = man.layout
    ep = re.search(r"\.ep(\d+)$", layout) if isinstance(layout, str) else None
    split = ep is not None and int(ep.group(1)) > 1
    if count > 1 and not split:
        raise ValueError("a ChainedOptimizer is converted when its experts are split (EP > 1, recorded in the "
                         "manifest): this step does not say so")

    def base(mp_dir: str) -> str:
        return mp_dir[:-4] if split else mp_dir       # without the expert-parallel rank "_EEE"

    written: List[str] = []
    entries: Dict[str, mf.FileEntry] = {}
    sd = SaveDir(os.path.dirname(step_dir), NAMINGS["megatron"])
    for mp_dir, rels in sorted(groups.items()):
        mine = [shards[r] for r in sorted(rels)]
        states: List[Any] = []
        for i in range(count):
            if count == 1 or mine[0][i].get("expert", i > 0):
                states.append(dp_zero_state([s[i] for s in mine]))
            elif f"{mp_dir}/distrib_optim_dp000.pt" in rels:    # the dense optimizer's DP rank 0
                states.append(dp_zero_state([shards[r][i] for r in sorted(shards)
                                             if base(r.split("/")[0]) == base(mp_dir)]))
            else:
                states.append(None)
        buf = io.BytesIO()
        torch.save(states[0] if count == 1 else states, buf)
        rel = f"{mp_dir}/distrib_optim.pt"
        entries[rel] = mf.FileEntry(buf.getbuffer().nbytes, mf.checksum(buf.getbuffer()), ShardFormat.TORCH)
        sd.add_file(step_dir, rel, buf.getvalue())
        written.append(os.path.join(step_dir, rel))
    sd.add_to_manifest(step_dir, entries)
    return written
