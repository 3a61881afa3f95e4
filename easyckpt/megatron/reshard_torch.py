"""Megatron's torch layout resumed on another TP/PP size (``load_checkpoint(..., concat=True)``).

Megatron's legacy files (``mp_rank_*/model_optim_rng.pt``, easyckpt's ``distrib_optim_dp*.pt``) hold each
rank's local tensors and nothing that says where they sit in the whole tensor. So every snapshot also
records, per model-parallel rank, a sharding map (``SHARDMAP`` beside the model file; JSON-like, never a
pickle): megatron-core's own sharding metadata of each saved tensor (sharded key, global shape, offset;
the rows it covers when Megatron splits one local tensor under two keys, as for SwiGLU). A rank resuming
on another layout computes the same map for itself and copies into each of its tensors the overlapping box
of every saved piece with the same key: the model, the Adam moments, and the DistributedOptimizer's fp32
main parameters (its per-DP-rank flat shards are first joined into whole local tensors, state.assemble).

What is not carried over, as in Megatron-LM's own loader: the RNG states (they belong to ranks of the saved
layout). The optimizer's hyper-parameters come from this run's configuration and the scheduler's state.
Not supported (refused with a message): expert parallelism, and optimizers whose main parameters are copies
of the model's (Float16Optimizer: fp16/bf16 training without the DistributedOptimizer).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Tuple

import torch

from easyckpt.errors import CheckpointError, EasyCkptError
from easyckpt.formats.manifest import Manifest
from easyckpt.megatron import state as _state
from easyckpt.megatron.shardmap import SHARDMAP, VERSION, Entry, live_tensors, shard_map

# mp_rank_TT, then _PPP with pipeline stages, then _EEE with expert parallelism (Megatron-LM's naming)
MODEL_FILE = re.compile(r"(mp_rank_\d{2}(?:_\d{3}){0,2})/model_optim_rng\.pt")
DISTOPT_FILE = re.compile(r"(mp_rank_\d{2}(?:_\d{3}){0,2})/distrib_optim_dp\d{3}\.pt")
KINDS = ("param", "exp_avg", "exp_avg_sq")


# ---- load -----------------------------------------------------------------------------------------------

def expert_split(layout: str) -> bool:
    """Whether a layout (``tp2.pp1.dp1.vp1.ep2``) splits the experts: its directories end in an EP rank."""
    m = re.search(r"\.ep(\d+)$", layout)
    return m is not None and int(m.group(1)) > 1


def needed(manifest: Manifest, saved: str, now: str, step: int, mine: Dict[str, Any]) -> List[Tuple[Any, ...]]:
    """Every model-parallel rank's sharding map, then of its model file and every DistributedOptimizer
    shard the tensors whose blocks overlap this rank's (``mine``, its own map): files the agent wrote list
    their items, and only those are read (torchparts.py); older ones are read whole."""
    files = manifest.files
    dirs = sorted({m.group(1) for rel in files for m in [MODEL_FILE.fullmatch(rel)] if m})
    lacking = [d for d in dirs if f"{d}/{SHARDMAP}" not in files]
    if not dirs or lacking:
        raise EasyCkptError(f"iteration {step} was saved in Megatron's torch layout on {saved} without easyckpt's "
                            f"sharding map ({(lacking or ['every mp_rank directory'])[0]} has none: written by "
                            f"Megatron itself or an older easyckpt); this run is {now}. It resumes only on its "
                            f"own TP/PP/EP sizes")
    want = _Wanted(mine)
    data = [(f"{d}/model_optim_rng.pt", want.model(d)) for d in dirs]
    data += [(rel, want.distopt(m.group(1))) for rel in sorted(files) if (m := DISTOPT_FILE.fullmatch(rel))]
    return [(f"{d}/{SHARDMAP}", False) for d in dirs] + \
        [(rel, False, pick) if files[rel].items is not None else (rel, False) for rel, pick in data]


def _meets(offset: List[int], sizes: List[int], other: Tuple[List[int], List[int]]) -> bool:
    return len(offset) == len(other[0]) and all(
        a < b + m and b < a + n for a, n, b, m in zip(offset, sizes, other[0], other[1]))


class _Wanted:
    """Which saved tensors this rank needs: those with a block that overlaps one of its own (by sharded key)."""

    def __init__(self, mine: Dict[str, Any]):
        self.boxes: Dict[str, List[Tuple[List[int], List[int]]]] = {}
        for entries in mine["tensors"].values():
            for e in entries:
                self.boxes.setdefault(e[0], []).append((e[2], e[3]))
        self.maps: Dict[str, Dict[str, Any]] = {}

    def _map(self, d: str, trees: Dict[str, Any]) -> Dict[str, Any]:
        if d not in self.maps:
            self.maps[d] = _checked(trees.get(f"{d}/{SHARDMAP}"), f"{d}/{SHARDMAP}")
        return self.maps[d]

    def _param(self, smap: Dict[str, Any], name: Any) -> bool:
        path = smap["params"].get(name) if isinstance(name, str) else None
        return path is None or self.overlaps(smap["tensors"][path])     # unknown: read it (restore says why)

    def overlaps(self, entries: List[Entry]) -> bool:
        return any(_meets(e[2], e[3], box) for e in entries for box in self.boxes.get(e[0], ()))

    def model(self, d: str) -> Callable[[Tuple[Any, ...], Any, Dict[str, Any]], bool]:
        def pick(path: Tuple[Any, ...], tree: Any, trees: Dict[str, Any]) -> bool:
            smap = self._map(d, trees)
            if len(path) == 2 and isinstance(path[0], str) and path[0].startswith("model") and isinstance(path[1], str):
                entries = smap["tensors"].get(f"{path[0]}/{path[1]}")
                return entries is not None and self.overlaps(entries)   # unmapped: the reshard does not use it
            if path[:1] == ("rng_state",):
                return False            # RNG states are not carried over to another layout
            if path[:1] == ("optimizer",):
                rest, j = path[1:], 0
                if rest and type(rest[0]) is int:            # a ChainedOptimizer's list
                    j, rest = rest[0], rest[1:]
                if len(rest) == 3 and rest[0] == "state" and type(rest[1]) is int and j < len(smap["opt_params"]):
                    names = smap["opt_params"][j]
                    if names is not None and rest[1] < len(names):
                        return self._param(smap, names[rest[1]])
            return True                 # anything else (a grad scaler's state): small, read it
        return pick

    def distopt(self, d: str) -> Callable[[Tuple[Any, ...], Any, Dict[str, Any]], bool]:
        def pick(path: Tuple[Any, ...], tree: Any, trees: Dict[str, Any]) -> bool:
            if len(path) == 4 and type(path[0]) is int and path[1] == "params" and type(path[2]) is int:
                try:
                    entry = tree[path[0]]["params"][path[2]]
                except (KeyError, IndexError, TypeError):
                    raise CheckpointError(f"{d}: a DistributedOptimizer shard is not easyckpt's list of shards") from None
                return self._param(self._map(d, trees), entry.get("name") if isinstance(entry, dict) else None)
            return True
        return pick


def is_reshard(trees: Dict[str, Any]) -> bool:
    """Whether ``needed`` above chose these files (a plain load of the torch layout reads no map)."""
    return any(rel.endswith("/" + SHARDMAP) for rel in trees)


def _ints(value: Any, what: str) -> List[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(f"{what}: not a list of non-negative integers")
    return value


def _checked(tree: Any, rel: str) -> Dict[str, Any]:
    """The sharding map read from storage: every field of the right type before any is used."""
    if not isinstance(tree, dict) or tree.get("version") != VERSION:
        raise CheckpointError(f"{rel}: not an easyckpt sharding map of version {VERSION}")
    tensors, params, opt_params = tree.get("tensors"), tree.get("params"), tree.get("opt_params")
    if not isinstance(tensors, dict) or not isinstance(params, dict) or not isinstance(opt_params, list):
        raise CheckpointError(f"{rel}: tensors, params or opt_params missing or of the wrong type")
    for path, entries in tensors.items():
        if not isinstance(path, str) or "/" not in path or not isinstance(entries, list):
            raise CheckpointError(f"{rel}: bad entry for {path!r}")
        for e in entries:
            if not (isinstance(e, list) and len(e) == 7 and isinstance(e[0], str) and type(e[4]) is int
                    and type(e[5]) is int and e[4] >= 0 and e[5] >= -1 and isinstance(e[6], bool)):
                raise CheckpointError(f"{rel}: bad sharding entry for {path}")
            shape, offset, sizes = (_ints(e[i], f"{rel}: {path}") for i in (1, 2, 3))
            if not len(shape) == len(offset) == len(sizes) or any(
                    o + n > g for o, n, g in zip(offset, sizes, shape)):
                raise CheckpointError(f"{rel}: {path}'s block lies outside its global shape")
    if not all(isinstance(k, str) and isinstance(v, str) and v in tensors for k, v in params.items()):
        raise CheckpointError(f"{rel}: params must name mapped tensors")
    for names in opt_params:
        if names is not None and not (isinstance(names, list) and all(n in params for n in names)):
            raise CheckpointError(f"{rel}: opt_params must list mapped parameters")
    return tree


def _block(t: torch.Tensor, e: Entry, what: str) -> torch.Tensor:
    """The part of local tensor ``t`` that entry ``e`` describes, shaped as its block of the global tensor
    (a view: a destination is written through it)."""
    sizes, first, rows = e[3], e[4], e[5]
    numel = 1
    for n in sizes:
        numel *= n
    part = t if rows == -1 else (t.reshape(t.shape[0], -1)[first:first + rows] if t.dim() else None)
    if part is None or part.numel() != numel:
        raise CheckpointError(f"{what}: {tuple(t.shape)} does not hold the block {e[0]} {sizes} (rows {first}+{rows})")
    return part.view(sizes)


class Pieces:
    """Every saved block of every global tensor, by (kind, sharded key); the steps by key."""

    def __init__(self) -> None:
        self.blocks: Dict[Tuple[str, str], List[Tuple[List[int], List[int], torch.Tensor]]] = {}
        self.steps: Dict[str, torch.Tensor] = {}

    def add(self, kind: str, t: torch.Tensor, entries: List[Entry], what: str) -> None:
        if t.is_meta:
            return          # not read: no block of it overlaps this rank's (fill checks the coverage)
        for e in entries:
            self.blocks.setdefault((kind, e[0]), []).append((e[1], e[2], _block(t, e, what)))

    def fill(self, kind: str, dst: torch.Tensor, entries: List[Entry], what: str) -> None:
        """Copy into ``dst`` (this rank's tensor) every overlapping saved block; all of it must be covered
        (a padded vocabulary may grow or shrink where Megatron allows it: the rows beyond stay)."""
        for e in entries:
            key, shape, offset = e[0], e[1], e[2]
            view = _block(dst, e, what)
            saved = self.blocks.get((kind, key)) or (self.blocks.get(("model", key)) if kind == "param" else None)
            if not saved:
                raise CheckpointError(f"the checkpoint has no {kind} of {key} ({what})")
            limit = list(shape)
            covered = torch.zeros(view.shape, dtype=torch.bool)
            for s_shape, s_offset, src in saved:
                if s_shape != shape:
                    if not e[6] or len(s_shape) != len(shape):
                        raise CheckpointError(f"{key} was saved with global shape {s_shape}; this run has {shape}")
                    limit = [min(a, b) for a, b in zip(limit, s_shape)]
                lo = [max(a, b) for a, b in zip(offset, s_offset)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(offset, view.shape, s_offset, src.shape)]
                if any(l >= h for l, h in zip(lo, hi)):
                    continue
                d = tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, offset))
                view[d].copy_(src[tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, s_offset))])
                covered[d] = True
            need = tuple(slice(0, max(0, min(n, m - a))) for n, m, a in zip(view.shape, limit, offset))
            if not bool(covered[need].all()):
                raise CheckpointError(f"the saved blocks of {key} do not cover this rank's part ({what})")

    def step(self, entries: List[Entry], what: str) -> torch.Tensor:
        for e in entries:
            if e[0] in self.steps:
                return self.steps[e[0]]
        raise CheckpointError(f"the checkpoint has no optimizer step for {what}")


def _saved_pieces(trees: Dict[str, Any], dirs: List[str], saved_layout: str) -> Tuple[Pieces, bool]:
    """Everything the old ranks saved, as blocks of global tensors; whether it had a DistributedOptimizer."""
    pieces = Pieces()
    maps: Dict[str, Dict[str, Any]] = {}
    states: Dict[str, Dict[str, Any]] = {}

    def local(d: str, path: str) -> torch.Tensor:
        state = states[d]
        part, _, name = path.partition("/")
        t = state.get(part, {}).get(name) if isinstance(state.get(part), dict) else None
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{d}/model_optim_rng.pt has no tensor {path} (its sharding map names it)")
        return t

    for d in dirs:
        maps[d], states[d] = _checked(trees[f"{d}/{SHARDMAP}"], f"{d}/{SHARDMAP}"), trees[f"{d}/model_optim_rng.pt"]
        if not isinstance(states[d], dict):
            raise CheckpointError(f"{d}/model_optim_rng.pt does not hold Megatron's state dict")
        for path, entries in maps[d]["tensors"].items():
            pieces.add("model", local(d, path), entries, f"{d} {path}")
    groups, distributed = _distopt_groups(trees, dirs, expert_split(saved_layout))
    if distributed:
        _add_distopt(pieces, groups, maps, local)
        return pieces, True
    _add_plain_optimizer(pieces, dirs, maps, states, local)
    return pieces, False


Local = Callable[[str, str], torch.Tensor]      # (directory, tensor path) -> the saved local tensor
Groups = Dict[Tuple[int, str], List[Tuple[str, Dict[str, Any]]]]


def _distopt_groups(trees: Dict[str, Any], dirs: List[str], split: bool) -> Tuple[Groups, bool]:
    """The DistributedOptimizer's flat shards, grouped per (optimizer, owner) to be joined per parameter over
    its data-parallel group: within a directory, and for dense parameters with the experts split, over every
    EP rank's directory of a (tp, pp); and whether the checkpoint had a DistributedOptimizer at all."""
    groups: Groups = {}
    distributed = False
    for d in dirs:
        files = sorted(r for r in trees if DISTOPT_FILE.fullmatch(r) and r.startswith(f"{d}/"))
        for rel in files:
            distributed = True
            shard = trees[rel]
            if not isinstance(shard, list) or not all(isinstance(s, dict) and isinstance(s.get("params"), list)
                                                       for s in shard):
                raise CheckpointError(f"{rel}: not easyckpt's list of DistributedOptimizer shards")
            for i, s in enumerate(shard):
                if split and not isinstance(s.get("expert"), bool):
                    raise CheckpointError(f"{rel}: a shard saved with split experts must say whether it holds them")
                owner = d if s.get("expert") or not split else d.rsplit("_", 1)[0]
                # parameters whose tensors were not read (meta: this rank needs none of their blocks)
                s = dict(s, params=[p for p in s["params"] if not (isinstance(p, dict) and any(
                    isinstance(v, torch.Tensor) and v.is_meta for v in p.values()))])
                groups.setdefault((i, owner), []).append((d, s))
    return groups, distributed


def _add_distopt(pieces: Pieces, groups: Groups, maps: Dict[str, Dict[str, Any]], local: Local) -> None:
    for (_, owner), members in sorted(groups.items()):
        d = members[0][0]      # dense parameters: the same names and map in every EP rank's directory
        try:
            whole = _state.assemble([s for _, s in members])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{owner}: malformed DistributedOptimizer shards ({exc!r})") from None
        for name, full in whole.items():
            path = maps[d]["params"].get(name)
            if path is None:
                raise CheckpointError(f"{d}: the optimizer shards hold {name}, which its sharding map lacks")
            shape, entries = local(d, path).shape, maps[d]["tensors"][path]
            for kind in KINDS:
                if kind not in full or torch.isnan(full[kind]).any():
                    raise CheckpointError(f"{owner}: the saved optimizer shards do not cover {kind} of {name}")
                pieces.add(kind, full[kind].view(shape), entries, f"{d} {name}")
            if "step" in full:
                pieces.steps.setdefault(entries[0][0], full["step"])


def _add_plain_optimizer(pieces: Pieces, dirs: List[str], maps: Dict[str, Dict[str, Any]],
                         states: Dict[str, Dict[str, Any]], local: Local) -> None:
    for d in dirs:
        smap, state = maps[d], states[d]
        if state.get("optimizer") is None:
            continue
        saved = state["optimizer"] if isinstance(state["optimizer"], list) else [state["optimizer"]]
        for names, opt in zip(smap["opt_params"], saved):
            if names is None:
                raise EasyCkptError(f"{d}: the saved optimizer keeps its own copies of the parameters "
                                    f"(fp16/bf16 without the DistributedOptimizer); the torch layout does "
                                    f"not reshard it: use ckpt_format='torch_dist'")
            per_param = opt.get("state", {}) if isinstance(opt, dict) else {}
            for index, name in enumerate(names):
                s = per_param.get(index)
                if not isinstance(s, dict):
                    continue            # a parameter the optimizer had not stepped yet
                path = smap["params"][name]
                shape, entries = local(d, path).shape, smap["tensors"][path]
                for kind in KINDS[1:]:
                    if not isinstance(s.get(kind), torch.Tensor):
                        raise CheckpointError(f"{d}: the optimizer state of {name} has no {kind}")
                    pieces.add(kind, s[kind].view(shape), entries, f"{d} {name}")
                if isinstance(s.get("step"), torch.Tensor) and not s["step"].is_meta:
                    pieces.steps.setdefault(entries[0][0], s["step"])


def restore(trees: Dict[str, Any], where: _state.Parallel, model: Any, optimizer: Any, scheduler: Any,
            layout: str, saved_layout: str) -> Dict[str, Any]:
    """Load a torch-layout checkpoint saved on other TP/PP/EP sizes (``saved_layout``) into this rank's live
    objects."""
    dirs = sorted(rel.split("/")[0] for rel in trees if rel.endswith("/" + SHARDMAP))
    pieces, distributed = _saved_pieces(trees, dirs, saved_layout)
    mine = shard_map(model, optimizer, layout)
    wrapped = _state.chunks(model)
    with torch.no_grad():
        live = live_tensors(wrapped)
        for path, t in live.items():
            if path not in mine["tensors"]:
                raise CheckpointError(f"{path} is not in megatron-core's sharded state dict: it cannot be resharded")
            pieces.fill("model", t, mine["tensors"][path], path)
        ref = trees[f"{where.mp_dir}/model_optim_rng.pt"] if f"{where.mp_dir}/{SHARDMAP}" in trees else \
            trees[f"{dirs[0]}/model_optim_rng.pt"]
        if optimizer is not None and ref.get("optimizer") is not None:
            _restore_optimizer(optimizer, ref["optimizer"] if distributed else None, pieces, mine, live,
                               _state.param_names(wrapped))
    if scheduler is not None and "opt_param_scheduler" in ref:
        scheduler.load_state_dict(ref["opt_param_scheduler"])
    return ref


def _fit_common(common: Any, optimizer: Any) -> Any:
    """The saved optimizers' common state for this run's: across an EP change, one optimizer saved and
    a ChainedOptimizer now (dense and expert parameters apart) or the other way round, as Megatron's
    torch_dist reader fits it (distopt.fit_chain)."""
    from easyckpt.megatron import distopt

    opts = _state.optimizers(optimizer)
    saved = common if isinstance(common, list) else [common]
    if len(saved) == len(opts):
        return common
    holder = {"optimizer": saved[0] if len(saved) == 1 else dict(enumerate(saved))}
    distopt.fit_chain(holder, optimizer)
    fitted = holder["optimizer"]
    return [fitted[i] for i in range(len(opts))] if len(opts) > 1 else fitted


def _restore_optimizer(optimizer: Any, common: Any, pieces: Pieces, mine: Dict[str, Any],
                       live: Dict[str, torch.Tensor], names: Dict[Any, str]) -> None:
    opts = _state.optimizers(optimizer)
    if common is not None and all(_state.is_distributed(o) for o in opts):
        # the DistributedOptimizer's param groups and grad scaler (it keeps this run's parameters in them)
        optimizer.load_state_dict(_fit_common(common, optimizer))
    for opt, order in zip(opts, mine["opt_params"]):
        if _state.is_distributed(opt):
            full = {}
            for _, model_param, _ in _state._distopt_params(opt):
                path = mine["params"][names[model_param]]
                entries = mine["tensors"][path]
                whole = {k: torch.empty(live[path].shape, dtype=torch.float32) for k in KINDS}
                for kind in KINDS:
                    pieces.fill(kind, whole[kind], entries, path)
                full[names[model_param]] = dict({k: v.reshape(-1) for k, v in whole.items()},
                                                step=pieces.step(entries, path))
            _state.distopt_set_whole(opt, full, names)
            continue
        if order is None:
            raise EasyCkptError("this run's optimizer keeps its own copies of the parameters (fp16/bf16 without "
                                "the DistributedOptimizer); the torch layout does not reshard it: use "
                                "ckpt_format='torch_dist'")
        sd = opt.state_dict()
        state = {}
        for index, name in enumerate(order):
            path = mine["params"][name]
            entries = mine["tensors"][path]
            s = {"step": pieces.step(entries, path).clone()}
            for kind in KINDS[1:]:
                s[kind] = torch.empty_like(live[path])
                pieces.fill(kind, s[kind], entries, path)
            state[index] = s
        sd["state"] = state
        opt.load_state_dict(sd)
