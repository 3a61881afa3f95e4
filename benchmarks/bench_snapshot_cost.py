"""The fixed cost of a memory snapshot: what the training thread pays for a snapshot of a tiny state, end to end,
and where it goes.

    .venv/bin/python benchmarks/bench_snapshot_cost.py [--hidden 128] [--calls 3000]

It runs easyckpt.pytorch on an MLP (AdamW; --hidden 128: 0.4 MB of state) in this process, with
``max_overhead=None`` so that every ``save_checkpoint_if_needed`` snapshots, and times each call; then the same
calls on a step that takes no snapshot (the call's own cost, paid every step); ``--overlap`` with the
overlapped copy (a thread per snapshot). It prints the medians, the
goal (a snapshot of a state <= 1 MB costs the training thread <= 0.2 ms) with PASS/MISS, and a breakdown of
one snapshot by part, from timing each part alone on the same objects (collect: the state dicts and the RNG
state; flatten: the trees into a skeleton and tensors, through each shape's plan; meta: the slot's JSON; copy: the tensors into the
slot; the rest: slot choice, header, the audit log's line, the persist bookkeeping). Last, the part that the
torch-format shards of Megatron, DeepSpeed and the HF Trainer pay instead of flatten (torchpickle.flatten_pickled: the
shard pickled as torch.save pickles it), timed on the same optimizer state and on an RNG state like the Trainer's
rng_state.pth (Python's 625-number state, numpy's, torch's).

``--without ROUNDS``: what each part costs the call where it runs, by taking it out: in ROUNDS rounds, 80 calls each
with the whole snapshot and with each part taken out in turn (the audit log's line, model.state_dict and the
optimizer's state_dict handed back as kept, the copy into the slot), in this process, one after the other; a part's
figure is the median over the rounds of what its round took less than the whole one's beside it. Timed alone, a part
costs a third to a quarter of what it costs among the rest of a snapshot on the test VM.

``--between-steps``: a training step (forward, backward, AdamW's step on a batch of 32) before every call, as in
a loop, and the parts timed in place, inside those calls (each of our functions wrapped in a timer for the
run): what a snapshot costs among the loop's own work, with the caches the step left, rather than in a tight
loop of snapshots. The parts then are: collect (the adapter's, RNG included) and, within it, the RNG state;
flatten, meta, slot choice, copy, publish (the header and the slot's JSON written), the audit log's line; the rest
is the engine's own bookkeeping between them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import easyckpt.pytorch as ep  # noqa: E402
from easyckpt.engine.save import rng  # noqa: E402
from easyckpt.engine.save.background import copy_all  # noqa: E402
from easyckpt.engine.save.metajson import KeptJson, encode_meta  # noqa: E402
from easyckpt.engine.shards.torchpickle import flatten_pickled  # noqa: E402
from easyckpt.engine.shards.tree import flatten  # noqa: E402
from easyckpt.engine.shards.treeplan import Flattener  # noqa: E402
from easyckpt.ipc import shm  # noqa: E402

GOAL = 0.2e-3


def timed(call: Callable[[], object], n: int) -> float:
    """Median seconds of ``call`` over ``n`` calls."""
    out: List[float] = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--overlap", action="store_true",
                   help="snapshot_overlap=True: the optimizer's tensors copied by a thread started per snapshot "
                        "(default: the synchronous copy, which auto picks when every core computes)")
    p.add_argument("--without", type=int, default=0, metavar="ROUNDS",
                   help="each part's cost where it runs, by taking it out (see above)")
    p.add_argument("--between-steps", action="store_true",
                   help="a training step before every call; the parts timed in place (see above)")
    args = p.parse_args()
    torch.set_num_threads(1)
    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, h))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, h)).sum().backward()
    opt.step()
    with tempfile.TemporaryDirectory() as where:
        ep.initialize_easyckpt(where, save_storage_interval=10 ** 9, max_overhead=None,
                               snapshot_overlap=args.overlap)
        ep.load_checkpoint(model, opt)
        engine = ep._default.require().engine
        step = [0]

        def save() -> None:
            step[0] += 1
            ep.save_checkpoint_if_needed(step[0], model, opt)
        for _ in range(200):
            save()
        if args.between_steps or args.without:
            if args.between_steps:
                in_place(model, opt, engine, save, args.calls, h)
            else:
                taken_out(model, opt, engine, save, args.without)
            ep.finalize_easyckpt()
            return
        snapshot = timed(save, args.calls)
        nbytes = engine.last.nbytes if engine.last is not None else 0
        # the same call on steps that take no snapshot: between two multiples of a large save_mem_interval
        interval = engine.cfg.save_mem_interval
        object.__setattr__(engine.cfg, "save_mem_interval", 10 ** 9)
        plain = timed(save, args.calls)
        object.__setattr__(engine.cfg, "save_mem_interval", interval)
        parts = breakdown(model, opt, engine, args.calls)
        ep.finalize_easyckpt()
    print(f"state {nbytes / 1e6:.2f} MB: a call with a snapshot {snapshot * 1e3:.3f} ms, without {plain * 1e6:.1f} us "
          f"(median of {args.calls}); goal <= {GOAL * 1e3:.1f} ms: {'PASS' if snapshot <= GOAL else 'MISS'}")
    rest = snapshot - sum(parts.values())
    for name, seconds in list(parts.items()) + [("the rest", rest)]:
        print(f"  {name:28s} {seconds * 1e6:7.1f} us  {seconds / snapshot:6.1%}")
    pickled = torch_shard(opt, args.calls)
    print("torch-format shard (Megatron, DeepSpeed, HF Trainer layouts), flatten_pickled: "
          + ", ".join(f"{name} {seconds * 1e6:.1f} us" for name, seconds in pickled.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bytes": nbytes, "snapshot": snapshot, "plain": plain, "parts": parts, "pickled": pickled},
                      f, indent=1)


def breakdown(model: torch.nn.Module, opt: torch.optim.Optimizer, engine: object, n: int) -> Dict[str, float]:
    """Each part of one snapshot, timed alone on the same objects (medians)."""
    snap = engine.snapshotter            # type: ignore[attr-defined]
    trees = [model.state_dict(), {"optimizer": opt.state_dict(), "lr_scheduler": None},
             {"iteration": 1, "rng": rng.capture(), "extra": None}]
    flat = [flatten(t) for t in trees]
    srcs = [t for _, ts in flat for _, t in ts]
    dsts = [torch.empty_like(t) for t in srcs]      # the same copies into warm memory of the same sizes
    skeletons = {str(i): f[0] for i, f in enumerate(flat)}
    plans = Flattener()         # as the snapshots flatten: through the plan of each tree's shape (treeplan.py)
    for i, t in enumerate(trees):
        plans.flatten(str(i), t)
    kept = KeptJson()       # as the snapshots keep it: each skeleton's JSON while it does not change
    return {
        "collect: model.state_dict": timed(model.state_dict, n),
        "collect: optimizer": timed(opt.state_dict, n),
        "collect: RNG state": timed(rng.capture, n),
        "flatten (each shape's plan)": timed(lambda: [plans.flatten(str(i), t) for i, t in enumerate(trees)], n),
        "meta (slot JSON)": timed(lambda: encode_meta(snap.layout.json, 1, skeletons, {}, kept), n),
        "copy into the slot": timed(lambda: copy_all(dsts, srcs), n),
    }


def in_place(model: torch.nn.Module, opt: torch.optim.Optimizer, engine: Any, save: Callable[[], None],
             n: int, hidden: int) -> None:
    """--between-steps: ``n`` calls, each after a training step, with each part timed where it runs (medians)."""
    import easyckpt.engine.save.snapshot as snapshot_module
    took: Dict[str, List[float]] = collections.defaultdict(list)

    def timer(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                took[name].append(time.perf_counter() - t)
        return run
    snap, saver = engine.snapshotter, engine.saver
    # (instance attributes and module names the snapshot looks up at each call: put back below)
    wrapped = [(ep.PytorchState, "collect"), (rng, "capture"), (snap._flattener, "flatten"),
               (snapshot_module, "encode_meta"), (snap, "_pick_slot"), (snapshot_module, "copy_all"),
               (saver, "_done"), (shm.Slot, "publish")]
    names = ["collect (RNG included)", "  of it the RNG state", "flatten (3 shards)", "meta (slot JSON)",
             "slot choice", "copy into the slot", "audit line, figures", "publish (header, JSON)"]
    # what each owner held itself (None: an instance's method, found on its class: the wrapper is deleted after)
    kept = [(owner, attr, vars(owner).get(attr)) for owner, attr in wrapped]
    for (owner, attr), name in zip(wrapped, names):
        setattr(owner, attr, timer(name, getattr(owner, attr)))
    x = torch.randn(32, hidden)
    calls: List[float] = []
    try:
        for _ in range(n):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            t = time.perf_counter()
            save()
            calls.append(time.perf_counter() - t)
    finally:
        for owner, attr, own in kept:
            if own is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)
    whole = statistics.median(calls)
    print(f"between training steps: a call with a snapshot {whole * 1e3:.3f} ms (median of {n}); goal <= "
          f"{GOAL * 1e3:.1f} ms: {'PASS' if whole <= GOAL else 'MISS'}")
    # (flatten runs once per shard: its median times the calls per snapshot)
    parts = {name: statistics.median(took[name]) * len(took[name]) / n for name in names if took[name]}
    inside = sum(v for k, v in parts.items() if not k.startswith("  "))
    for name, seconds in list(parts.items()) + [("the rest", whole - inside)]:
        print(f"  {name:28s} {seconds * 1e6:7.1f} us  {seconds / whole:6.1%}")


def taken_out(model: torch.nn.Module, opt: torch.optim.Optimizer, engine: Any, save: Callable[[], None],
              rounds: int) -> None:
    """--without: each part's cost where it runs, as what a round of calls without it took less (see above)."""
    import easyckpt.engine.save.snapshot as snapshot_module
    model_sd, opt_sd = model.state_dict(), opt.state_dict()
    parts: Dict[str, Callable[[], None]] = {
        "the whole snapshot": lambda: None,
        "the audit log's line": lambda: setattr(engine.log, "record", lambda *a, **k: None),
        "model.state_dict": lambda: setattr(model, "state_dict", lambda: model_sd),
        "the optimizer's state_dict": lambda: setattr(opt, "state_dict", lambda: opt_sd),
        "the copy into the slot": lambda: setattr(snapshot_module, "copy_all", lambda dsts, srcs: None),
    }
    copy_all_ = snapshot_module.copy_all
    took: Dict[str, List[float]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, take_out in parts.items():
            take_out()
            try:
                took[name].append(timed(save, 80))
            finally:      # each put back (instance attributes dropped: the class's method again)
                for owner in (engine.log, model, opt):
                    for attr in ("record", "state_dict"):
                        vars(owner).pop(attr, None)
                snapshot_module.copy_all = copy_all_
    whole = took.pop("the whole snapshot")
    print(f"a call with a snapshot {statistics.median(whole) * 1e3:.3f} ms (median of {rounds} rounds of 80); what "
          f"each part costs it where it runs (the round without it, less the whole one's beside it):")
    for name, seconds in took.items():
        saved = statistics.median(w - t for w, t in zip(whole, seconds))
        print(f"  {name:28s} {saved * 1e6:7.1f} us  {saved / statistics.median(whole):6.1%}")


def torch_shard(opt: torch.optim.Optimizer, n: int) -> Dict[str, float]:
    """flatten_pickled's cost (medians) on the optimizer's state and on an RNG state like rng_state.pth."""
    import random

    import numpy as np
    rng_state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    state = opt.state_dict()
    return {"optimizer": timed(lambda: flatten_pickled(state), n),
            "rng_state": timed(lambda: flatten_pickled(rng_state), n)}


if __name__ == "__main__":
    main()
