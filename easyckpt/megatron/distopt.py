"""The DistributedOptimizer's own pieces in Megatron's torch_dist layout (torchdist.py): what a DP rank
holds of each parameter's optimizer state, as boxes of the global tensors, and how a loaded state is fitted
back into the optimizers of a chained or plain DistributedOptimizer."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from easyckpt.errors import CheckpointError
from easyckpt.megatron import state as _state

OWN_PIECES = "param_state"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def boxes(shape: Sequence[int], begin: int, end: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """The flat range [begin, end) of a row-major tensor of ``shape`` as rectangular boxes (start, sizes),
    in flat order, each a contiguous run of the range: a partial first row, whole rows, a partial last row
    (partial rows split the same way one dimension down)."""
    if begin >= end:
        return []
    if len(shape) <= 1:
        return [((begin,), (end - begin,))]
    inner = 1
    for d in shape[1:]:
        inner *= d
    first, last = begin // inner, end // inner
    if first == last:
        return [((first, *s), (1, *n)) for s, n in boxes(shape[1:], begin - first * inner, end - first * inner)]
    out = []
    if begin % inner:
        out += [((first, *s), (1, *n)) for s, n in boxes(shape[1:], begin % inner, inner)]
        first += 1
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if end % inner:
        out += [((last, *s), (1, *n)) for s, n in boxes(shape[1:], 0, end % inner)]
    return out


def own_distopt(optimizer: Any, sd: Dict[str, Any]) -> Optional[Dict[Any, Any]]:
    """The DistributedOptimizer's state as Megatron's ``fully_reshardable`` layout names it
    (``optimizer.state.{param,exp_avg,exp_avg_sq}.<param key>``, shaped like the param), but each DP rank
    writes only the part of each parameter it owns, as rectangular chunks: no gather across the
    data-parallel group at a snapshot (megatron-core's own fully_reshardable save all-gathers the whole
    state, and on a pipeline stage whose embedding has a bucket of its own it puts the main params off by
    the bucket padding). None where this does not apply (one DistributedOptimizer, model params plain
    ShardedTensors): megatron-core's own sharded_state_dict serves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    opts = _state.optimizers(optimizer)
    if not opts or not all(_state.is_distributed(o) for o in opts):
        return None
    meta = {id(sh.data): sh for key in sd if key.startswith("model") for sh in nested_values(sd[key])}
    if len(opts) > 1:
        # a ChainedOptimizer (MoE: dense and expert parameters): {index: each one's}, no key prefix (the
        # fully_reshardable keys are the parameters' own); the steps of all agree first, as Megatron does
        optimizer._synchronize_steps()
        each = [_own_distopt_one(o, meta) for o in opts]
        return None if any(e is None for e in each) else dict(enumerate(each))
    return _own_distopt_one(opts[0], meta)


def _own_distopt_one(opt: Any, meta: Dict[int, Any]) -> Optional[Dict[str, Any]]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pieces: Dict[str, Dict[str, List[Any]]] = {}
    for n, (_, model_param, ranges) in enumerate(_state._distopt_params(opt)):
        sh = meta.get(id(model_param))
        if not isinstance(sh, ShardedTensor) or sh.flattened_range is not None:
            return None
        # every DP rank saves the part it owns; a copy that another stage or TP rank saves too (a tied
        # embedding, a norm replicated across TP) is kept in memory only, like any non-main replica
        rid = sh.replica_id if isinstance(sh.replica_id, tuple) else (0,)
        replica = 0 if not any(rid[:-1]) else 1
        tensors = opt._get_main_param_and_optimizer_states(model_param)
        sub = ranges["param"]
        p = sh.prepend_axis_num
        entry: Dict[str, List[Any]] = {}
        for state_key in STATE_KEYS:
            flat = tensors[state_key].detach().reshape(-1)
            chunks, at = [], 0
            for start, sizes in boxes(tuple(sh.local_shape), sub.start, sub.end):
                numel = 1
                for d in sizes:
                    numel *= d
                offset = tuple(sh.global_offset[:p]) + tuple(g + s for g, s in zip(sh.global_offset[p:], start))
                chunks.append(ShardedTensor(key=f"optimizer.state.{state_key}.{sh.key}",
                                            data=flat[at:at + numel].view(sizes), dtype=flat.dtype,
                                            local_shape=tuple(sizes), global_shape=tuple(sh.global_shape),
                                            global_offset=offset, axis_fragmentations=None, replica_id=replica,
                                            prepend_axis_num=p))
                at += numel
            entry[state_key] = chunks
        pieces[str(n)] = entry
    common = opt.state_dict()
    common[OWN_PIECES] = pieces
    common["param_state_sharding_type"] = "fully_reshardable"
    return common


def fit_chain(state: Dict[str, Any], optimizer: Any) -> None:
    """Fit the optimizer's common state to a change of the number of optimizers (MoE: with EP > 1 a
    ChainedOptimizer keeps dense and expert parameters apart; with EP = 1 one optimizer holds them all).
    Megatron's loader merges the saved common parts with the tensors this run's request read.

    - Several saved ({0: ..., 1: ...}), one now: it gets all their param groups (it picks its own by their
      identifiers) and the step they share.
    - One saved, several now: each gets the saved groups; the experts' optimizer asks for groups marked
      ``is_expert_parallel``, which EP = 1 did not mark, so each group is offered under both marks."""
    opt, count = state.get("optimizer"), len(_state.optimizers(optimizer))
    if not isinstance(opt, dict):
        return
    if _fit_plain_chain(state, opt, _state.optimizers(optimizer)):
        return
    if count > 1 and isinstance(opt.get("optimizer"), dict):
        common = {k: v for k, v in opt.items() if not isinstance(k, int)}
        groups = list(common["optimizer"].get("param_groups") or [])

        def ident(g: Dict[str, Any], expert: bool) -> Tuple[Any, ...]:
            return tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "is_expert_parallel"))) \
                + (expert,)
        present = {ident(g, bool(g.get("is_expert_parallel"))) for g in groups}
        groups += [dict(g, is_expert_parallel=not g.get("is_expert_parallel")) for g in groups
                   if ident(g, not g.get("is_expert_parallel")) not in present]
        fitted = {}
        for i in range(count):
            fitted[i] = dict(common)
            fitted[i].update(opt.get(i) or {})
            fitted[i]["optimizer"] = dict(common["optimizer"], param_groups=groups)
        state["optimizer"] = fitted
        return
    if count != 1 or "optimizer" in opt:
        return
    parts = [opt[i] for i in sorted(k for k in opt if isinstance(k, int))]
    if not parts:
        return
    if not all(isinstance(p, dict) and "optimizer" in p for p in parts):
        raise CheckpointError(f"this checkpoint holds {len(parts)} optimizers (MoE with expert parallelism: dense "
                              f"and expert parameters apart) in a form this run's one optimizer cannot take")
    merged = {k: v for k, v in parts[0].items()}
    merged["optimizer"] = dict(parts[0]["optimizer"],
                               param_groups=[g for p in parts for g in p["optimizer"]["param_groups"]])
    merged.update({k: v for k, v in opt.items() if not isinstance(k, int)})
    state["optimizer"] = merged


def _fit_plain_chain(state: Dict[str, Any], opt: Dict[Any, Any], opts: List[Any]) -> bool:
    """The plain optimizer across an EP change. Its tensors come by parameter key, as this run's request
    asked for them ("state", "param_groups" of each of its optimizers); the saved common part holds only
    the step every parameter shares (``common_step``) and the saved layout's param groups, indexed by
    that layout's parameters: keep this run's groups (the scheduler sets their lr and weight decay) and
    give every optimizer the saved step. True when it applied."""
    ints, count = [k for k in opt if isinstance(k, int)], len(opts)
    if any(_state.is_distributed(o) for o in opts):
        return False
    if count == 1 and ints and isinstance(opt.get("state"), dict) and "optimizer" not in opt:
        steps = [opt[i]["state"]["common_step"] for i in sorted(ints)
                 if isinstance(opt[i], dict) and isinstance(opt[i].get("state"), dict) and "common_step" in opt[i]["state"]]
        if not steps:
            return False
        state["optimizer"] = {k: v for k, v in opt.items() if not isinstance(k, int)}
        state["optimizer"]["state"]["common_step"] = steps[0]
        state["optimizer"]["param_groups"] = opts[0].optimizer.state_dict()["param_groups"]
        return True
    if count > 1 and sorted(ints) == list(range(count)) and isinstance(opt.get("state"), dict) \
            and "common_step" in opt["state"] and all(isinstance(opt[i].get("state"), dict) for i in ints):
        for i in ints:
            opt[i]["state"]["common_step"] = opt["state"]["common_step"]
            opt[i]["param_groups"] = opts[i].optimizer.state_dict()["param_groups"]
        state["optimizer"] = {i: opt[i] for i in ints}
        return True
    return False


def pop_pieces(state: Any, count: int) -> Optional[List[Any]]:
    """The pieces each DistributedOptimizer saved (memory), taken out of the state its load_state_dict gets."""
    if not isinstance(state, dict):
        return None
    if count > 1 and all(i in state for i in range(count)):
        parts = [state[i].pop(OWN_PIECES, None) if isinstance(state[i], dict) else None for i in range(count)]
        return None if any(p is None for p in parts) else parts
    own = state.pop(OWN_PIECES, None)
    return None if own is None else [own]


def set_own_distopt(opt: Any, pieces: Dict[str, Dict[str, List[torch.Tensor]]]) -> None:
    """Put this DP rank's pieces of every parameter, read back from memory, into the optimizer."""
    with _state.torch_adam_copies(opt):
        for n, (_, model_param, _) in enumerate(_state._distopt_params(opt)):
            entry = pieces.get(str(n))
            if entry is None:
                continue
            opt._set_main_param_and_optimizer_states(
                model_param, {k: torch.cat([t.reshape(-1) for t in entry[k]]) for k in STATE_KEYS})


# ---- save ---------------------------------------------------------------------------------------------



def prime_adam(opt: Any) -> None:
    """torch Adam creates its state at the first step; a DistributedOptimizer that never stepped (a fresh
    process about to load) has none, and without TE/Apex its state_dict() then fails: give every main
    parameter zero moments and a step, all overwritten by the load."""
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            st = opt.optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p.data)
                st["exp_avg_sq"] = torch.zeros_like(p.data)
