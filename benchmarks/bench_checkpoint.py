"""easyckpt against the frameworks' own savers and the machine's limits: one run, one table, one chart.

    .venv/bin/python benchmarks/bench_checkpoint.py [--sizes 0.25,1,4] [--repeats 3] [--loop-max-gb 0.25]

For each training-state size (GB = 1e9 bytes; float32 model + Adam moments, so the parameters are a
third of the bytes) it measures, in the same process and interleaved where it matters:

limits      raw copy of the same bytes into a warm buffer; raw sequential os.write + fsync, and the
            same bytes with O_DIRECT (the device's own speed, no page cache); a copy into freshly
            allocated memory (what any restore from memory pays at least)
stall       what training waits for per checkpoint: easyckpt's snapshot (synchronous, and overlapped
            with the next forward/backward in a real training loop), torch.save + fsync (Megatron's
            classic save), DCP async_save's blocking part (reused stager, process mode), the HF
            Trainer's own checkpoint save, DeepSpeed's own save_checkpoint (ZeRO-1)
persist     from a snapshot to a committed, fsynced checkpoint through the real node agent, against
            the faster raw write and DCP async_save's total (until its files are durable)
step time   a compute-bound training loop (an MLP whose state is the size) with save_mem_interval=1,
            save_storage_interval=10, against the same loop without checkpoints (sizes up to
            --loop-max-gb: the step of a compute-bound 4 GB model takes minutes on 2 cores), in
            --loop-rounds rounds of rotated order, each mode compared with the no-checkpoint loop of
            its own round (the machine's speed drifts more between minutes than the overhead)
restore     from memory (a surviving snapshot) and from storage (page cache dropped, verified), against
            torch.load of the same state (page cache dropped too)

then prints every figure, the ratios the goals are stated in with PASS/MISS, and writes a PNG chart and
the raw figures as JSON (--out). Disk measurements start from the same state (dirty pages flushed, hot
free memory: see common.py). Figures swing between runs on shared machines; the ratios are what to read.
Nothing is written outside a fresh temporary directory (--dir) and this job's /dev/shm slots, all
removed at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import baselines  # noqa: E402
from common import (  # noqa: E402
    GB,
    all_tensors,
    alloc_copy,
    build_state,
    direct_buffer,
    evict,
    median,
    nbytes_of,
    raw_copy,
    raw_read_direct,
    raw_write,
    raw_write_direct,
    remove,
    settle_disk,
    timed,
    timed_disk_op,
    warm_free_memory,
)

import easyckpt  # noqa: E402
from easyckpt.config import Config  # noqa: E402
from easyckpt.engine.load.stepread import read_step  # noqa: E402
from easyckpt.engine.save.overlap import OVERLAP_MIN_BYTES, auto_overlap  # noqa: E402
from easyckpt.engine.save.snapshot import ShardSpec  # noqa: E402
from easyckpt.engine.session import Engine  # noqa: E402

MODEL, OPTIM = "model.safetensors", "optimizer.safetensors"
LOOP_WIDTH = 2048          # the loop's MLP: Linear(2048, 2048) layers, as many as the size needs
LOOP_BATCH = 2048          # rows per step: makes the step compute-bound (6·params·batch FLOPs, ~1 s at 0.25 GB)
LOOP_STEPS = 12            # persists at step 10; the first two steps (allocation, warm-up) are not timed

GOALS = [  # (key, text, test)
    ("sync_over_copy", "sync snapshot stall / raw copy", lambda v: v <= 1.2, "<= 1.2"),
    ("overlap_over_copy", "overlapped stall / raw copy (training loop)", lambda v: v <= 0.3, "<= 0.3"),
    ("sync_over_torch_save", "sync snapshot stall / torch.save", lambda v: v <= 0.1, "<= 0.1"),
    ("overlap_over_dcp_block", "overlapped stall / DCP async_save blocking", lambda v: v <= 0.5, "<= 0.5"),
    ("sync_over_dcp_block", "sync snapshot stall / DCP async_save blocking", lambda v: v <= 0.5, "<= 0.5"),
    ("persist_over_write", "snapshot->committed / fastest raw write+fsync", lambda v: v <= 1.5, "<= 1.5"),
    ("persist_over_dcp_total", "snapshot->committed / DCP async_save total", lambda v: v <= 0.5, "<= 0.5"),
    ("step_overhead", "step-time overhead, default (mem 1, storage 10)", lambda v: v <= 0.03, "<= 3%"),
    ("storage_over_memory", "restore: storage / memory", lambda v: v >= 5, ">= 5"),
    ("first_over_steady", "first snapshot stall / steady (slots prepared)", lambda v: v <= 1.5, "<= 1.5"),
    ("storage_over_direct_read", "restore: storage (cold) / raw O_DIRECT read", lambda v: v <= 1.2, "<= 1.2"),
    ("storage_over_torch_load", "restore: storage (cold) / torch.load (cold)", lambda v: v <= 0.5, "<= 0.5"),
]


# ---- easyckpt on the synthetic state ------------------------------------------------------------

def _engine(save_dir: str, log: str) -> Engine:
    # a storage interval no step reaches: persisting is asked for explicitly (persist_now)
    return Engine(Config(save_dir=save_dir, save_mem_interval=1, save_storage_interval=10**9, max_ckpt_num=2,
                         log_file_path=log, autocheckpoint_on_sigterm=False))


def measure_easyckpt(gb: float, repeats: int, work: str) -> Dict[str, Any]:
    """Synchronous snapshot vs raw copy, persist vs raw write, restore from memory / storage / torch.load."""
    model, optimizer = build_state(gb)
    srcs = all_tensors(model, optimizer)
    nbytes = nbytes_of(srcs)
    pool = int(nbytes * 1.1) + (64 << 20)
    shards: Callable[[], List[ShardSpec]] = lambda: [ShardSpec(MODEL, model), ShardSpec(OPTIM, optimizer)]
    dsts = [torch.empty_like(t) for t in srcs]
    raw_copy(dsts, srcs)          # fault the destination in: the floor is a copy into warm memory
    out: Dict[str, Any] = {"state_bytes": nbytes, "tensors": len(srcs)}
    s: Dict[str, List[float]] = {k: [] for k in ("prepare", "first_snapshot", "snapshot", "raw_copy",
                                                 "persist", "raw_write", "raw_write_direct",
                                                 "alloc_copy", "restore_memory", "restore_storage", "torch_load",
                                                 "raw_read_direct")}
    # the first snapshot of a job, once per repeat, each in a job of its own (one sample swung 1.1-2.4x
    # the steady stall between runs)
    for rep in range(repeats):
        prep, first = _first_snapshot(os.path.join(work, f"ezck-{gb:g}-first{rep}"), nbytes, shards)
        s["prepare"].append(prep)
        s["first_snapshot"].append(first)
    save_dir = os.path.join(work, f"ezck-{gb:g}")     # a job of its own per size
    engine = _engine(save_dir, save_dir + ".log")
    step = 0
    try:
        step += 1
        engine.prepare(nbytes)
        engine.maybe_save(step, shards)
        engine.snapshotter.wait_prepared()    # the second slot: the steady snapshots below alternate both
        for rep in range(repeats):
            for pair in range(3):   # (snapshot, raw copy) pairs, alternating which goes first
                step += 1
                if pair % 2:
                    s["raw_copy"].append(timed(lambda: raw_copy(dsts, srcs))[0])
                sec, res = timed(lambda: engine.maybe_save(step, shards))
                assert res is not None and res.step == step
                s["snapshot"].append(sec)
                if not pair % 2:
                    s["raw_copy"].append(timed(lambda: raw_copy(dsts, srcs))[0])
        dsts.clear()      # the copy floor's buffer: 4 GB states need the room for the disk phase
        gc.collect()
        dbuf = direct_buffer()
        for rep in range(repeats):
            # snapshot -> committed: the agent writes the shards, fsyncs, commits (manifest, rename, fsync)
            step += 1
            settle_disk()
            warm_free_memory(pool)
            engine.persist_now(step, shards)      # the snapshot, then the request to the agent
            sec, _ = timed(lambda: engine.wait_committed(step, 600))
            s["persist"].append(sec)
            raw_path = os.path.join(work, "raw.bin")
            s["raw_write"].append(timed_disk_op(lambda: raw_write(raw_path, srcs), pool)[0])
            remove(raw_path)
            sec, written = timed_disk_op(lambda: raw_write_direct(raw_path, nbytes, dbuf), pool)
            if written:
                s["raw_write_direct"].append(sec)
            remove(raw_path)
        needed = lambda man: [(MODEL, False), (OPTIM, False)]
        step_dir = os.path.join(save_dir, engine.cfg.naming.dir_name(step))
        torch_file = os.path.join(work, "state.pt")
        with open(torch_file, "wb") as f:
            torch.save({"model": model, "optimizer": optimizer}, f)
            os.fsync(f.fileno())
        for rep in range(repeats):
            # every restore allocates the state afresh: each starts with as many hot free pages (see
            # warm_free_memory; a run measured the same fresh copy at 0.23 s and 1.0 s per GB without it)
            warm_free_memory(pool)
            s["alloc_copy"].append(_timed_dropped(lambda: alloc_copy(srcs)))
            warm_free_memory(pool)
            s["restore_memory"].append(_timed_dropped(lambda: _check_memory(engine.load(needed), step)))
            evict(step_dir)
            warm_free_memory(pool)
            s["restore_storage"].append(_timed_dropped(lambda: _check_storage(read_step(step_dir, needed))))
            evict(torch_file)
            warm_free_memory(pool)
            s["torch_load"].append(_timed_dropped(lambda: torch.load(torch_file, weights_only=True)))
            # the limit: the step's files read back with O_DIRECT, no checksum, nothing kept
            sec, got = timed(lambda: raw_read_direct(step_dir, dbuf))
            if got:
                s["raw_read_direct"].append(sec)
        dbuf.close()
        remove(torch_file)
    finally:
        engine.finalize(persist=False)
    # the agent's own seconds per persist (open, write, checksum, fsync): the rest of snapshot -> committed
    # is the hand-over, the commit and the trainer noticing it
    events = [json.loads(line) for line in open(save_dir + ".log")]
    s["agent_write"] = [e["seconds"] for e in events if e.get("event") == "persist"]
    out["samples"] = s
    out["median"] = {k: median(v) for k, v in s.items() if v}
    return out


def _first_snapshot(save_dir: str, nbytes: int, shards: Callable[[], List[ShardSpec]]) -> Tuple[float, float]:
    """What load_checkpoint does, then the first snapshot: both slots reserved and mapped on a thread while
    the first iterations run (their time, off the training thread). Returns (preparation, first snapshot)
    seconds; the job's slots and files are gone afterwards."""
    engine = _engine(save_dir, save_dir + ".log")
    try:
        t0 = time.perf_counter()
        engine.prepare(nbytes)
        engine.snapshotter.wait_prepared()
        prep = time.perf_counter() - t0
        first = timed(lambda: engine.maybe_save(1, shards))[0]
    finally:
        engine.finalize(persist=False)
        shutil.rmtree(save_dir, ignore_errors=True)
        remove(save_dir + ".log")
    gc.collect()
    return prep, first


def _timed_dropped(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` took; what it returned is freed before the next measurement allocates (a 4 GB
    state restored three ways at once would not fit in memory)."""
    t0 = time.perf_counter()
    out = fn()
    sec = time.perf_counter() - t0
    del out
    gc.collect()
    return sec


def _check_memory(loaded: Any, step: int) -> Any:
    assert loaded is not None and loaded.source == "memory" and loaded.step == step, loaded
    return loaded


def _check_storage(read: Any) -> Any:
    assert read[1] is None, read[1]
    return read


# ---- the training loop ---------------------------------------------------------------------------

def training_loop(gb: float, mode: str, work: str) -> Dict[str, Any]:
    """Seconds per step of a compute-bound MLP; ``mode``: none | sync | overlap."""
    torch.manual_seed(0)
    layers = max(1, round(gb * GB / 12 / LOOP_WIDTH**2))
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(LOOP_WIDTH, LOOP_WIDTH, bias=False),
                                                      torch.nn.ReLU()) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(LOOP_BATCH, LOOP_WIDTH)
    log = os.path.join(work, f"loop-{mode}-{gb:g}.log")
    save_dir = os.path.join(work, f"loop-{mode}-{gb:g}")
    if mode != "none":
        easyckpt.initialize_easyckpt(save_dir, save_mem_interval=1, save_storage_interval=10, max_ckpt_num=2,
                                     log_file_path=log, autocheckpoint_on_sigterm=False,
                                     snapshot_overlap=mode == "overlap")
    times = []
    try:
        for it in range(1, LOOP_STEPS + 1):
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            if mode != "none":
                easyckpt.save_checkpoint_if_needed(it, model, opt)
            times.append(time.perf_counter() - t0)
    finally:
        if mode != "none":
            easyckpt.finalize_easyckpt()
    out: Dict[str, Any] = {"layers": layers, "step_seconds": times[2:], "mean_step": sum(times[2:]) / len(times[2:])}
    state = [p.detach() for p in model.parameters()] + [v for st in opt.state.values() for v in st.values()
                                                       if isinstance(v, torch.Tensor) and v.dim()]
    out["state_bytes"] = nbytes_of(state)
    if mode != "none":
        events = [json.loads(line) for line in open(log) if '"event": "snapshot"' in line]
        out["stalls"] = [e["seconds"] for e in events if e["step"] > 2]
        out["stall"] = median(out["stalls"])
    else:   # the floor the stalls are compared with: a raw copy of this loop's own state
        dsts = [torch.empty_like(t) for t in state]
        raw_copy(dsts, state)
        out["raw_copy"] = median([timed(lambda: raw_copy(dsts, state))[0] for _ in range(3)])
    shutil.rmtree(save_dir, ignore_errors=True)
    return out


# ---- one size --------------------------------------------------------------------------------------

def measure_size(gb: float, args: argparse.Namespace, work: str) -> Dict[str, Any]:
    r: Dict[str, Any] = {"gb": gb}
    say = lambda what: print(f"[{gb:g} GB] {what}", flush=True)
    say("easyckpt: snapshot, persist, restore")
    r["easyckpt"] = measure_easyckpt(gb, args.repeats, work)
    gc.collect()
    nbytes = r["easyckpt"]["state_bytes"]
    model, optimizer = build_state(gb)
    state = {"model": model, "optimizer": optimizer}
    say("torch.save + fsync")
    r["torch_save"] = baselines.torch_save(state, work, args.repeats)
    say("DCP async_save")
    r["dcp"] = baselines.dcp_async_save(state, work, args.repeats)
    del model, optimizer, state
    gc.collect()
    if "hf" not in args.skip:
        say("HF Trainer save")
        r["hf"] = baselines.hf_trainer_save(nbytes, work, args.repeats)
        gc.collect()
    if "deepspeed" not in args.skip:
        say("DeepSpeed save_checkpoint")
        r["deepspeed"] = baselines.deepspeed_save(nbytes, work, args.repeats)
        gc.collect()
    if gb <= args.loop_max_gb:
        # a shared 2-core machine drifts by 10-15% within a minute, more than the overhead measured: each
        # round runs the three loops back to back, in a rotated order, and the overhead is the median
        # over rounds of each round's own ratio
        modes = ("none", "overlap", "sync")
        runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
        for rnd in range(args.loop_rounds):
            for mode in modes[rnd % 3:] + modes[:rnd % 3]:
                say(f"training loop, round {rnd + 1}/{args.loop_rounds}, {mode}")
                runs[mode].append(training_loop(gb, mode, work))
                gc.collect()
        r["loop"] = {mode: _merge_rounds(runs[mode], runs["none"]) for mode in modes}
        # what snapshot_overlap=None (the default) picks for this loop on this machine (its state is far above
        # OVERLAP_MIN_BYTES: asked of an optimizer that holds that much)
        r["loop"]["auto_overlap"], r["loop"]["auto_reason"] = auto_overlap(
            torch.optim.SGD([torch.zeros(OVERLAP_MIN_BYTES // 4)]), 1)
    r["ratios"] = ratios(r)
    return r


def _merge_rounds(rounds: List[Dict[str, Any]], baseline: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One mode's loop figures over all rounds: medians, and its step time relative to the loop without
    checkpoints of the same round."""
    out = dict(rounds[0], rounds=rounds)
    out["mean_step"] = median([x["mean_step"] for x in rounds])
    out["relative_step"] = median([x["mean_step"] / b["mean_step"] for x, b in zip(rounds, baseline)])
    if "stalls" in rounds[0]:
        out["stalls"] = [v for x in rounds for v in x["stalls"]]
        out["stall"] = median(out["stalls"])
    if "raw_copy" in rounds[0]:
        out["raw_copy"] = median([x["raw_copy"] for x in rounds])
    return out


def ratios(r: Dict[str, Any]) -> Dict[str, float]:
    m = r["easyckpt"]["median"]
    dcp = [x for x in r["dcp"] if not x.get("warmup")]
    dcp_block, dcp_total = median([x["blocking"] for x in dcp]), median([x["total"] for x in dcp])
    out = {"sync_over_copy": m["snapshot"] / m["raw_copy"],
           "sync_over_torch_save": m["snapshot"] / median(r["torch_save"]),
           "sync_over_dcp_block": m["snapshot"] / dcp_block,
           # the disk's limit is the faster of the two raw writes (buffered, or O_DIRECT where allowed)
           "persist_over_write": m["persist"] / min(m["raw_write"], m.get("raw_write_direct", float("inf"))),
           "persist_over_buffered_write": m["persist"] / m["raw_write"],
           "memory_over_fresh_copy": m["restore_memory"] / m["alloc_copy"],
           "persist_over_dcp_total": m["persist"] / dcp_total,
           "storage_over_memory": m["restore_storage"] / m["restore_memory"],
           "first_over_steady": m["first_snapshot"] / m["snapshot"],
           "storage_over_torch_load": m["restore_storage"] / m["torch_load"]}
    if m.get("raw_read_direct"):
        out["storage_over_direct_read"] = m["restore_storage"] / m["raw_read_direct"]
    loop = r.get("loop")
    if loop:
        out["overlap_over_copy"] = loop["overlap"]["stall"] / loop["none"]["raw_copy"]
        # the loop's state is the size rounded to whole layers: compare per byte
        scale = r["easyckpt"]["state_bytes"] / loop["none"]["state_bytes"]
        out["overlap_over_dcp_block"] = loop["overlap"]["stall"] * scale / dcp_block
        out["step_overhead_overlap"] = loop["overlap"]["relative_step"] - 1
        out["step_overhead_sync"] = loop["sync"]["relative_step"] - 1
        out["step_overhead"] = out["step_overhead_overlap" if loop["auto_overlap"] else "step_overhead_sync"]
    return out


# ---- report ----------------------------------------------------------------------------------------

def rows_of(r: Dict[str, Any]) -> List[tuple]:
    """(group, name, seconds, bytes) of every figure of one size."""
    e, m = r["easyckpt"], r["easyckpt"]["median"]
    nb = e["state_bytes"]
    dcp = [x for x in r["dcp"] if not x.get("warmup")]
    rows = [("limit", "raw copy into a warm buffer", m["raw_copy"], nb),
            ("limit", "raw write + fsync", m["raw_write"], nb)]
    if "raw_write_direct" in m:
        rows.append(("limit", "raw write + fsync, O_DIRECT", m["raw_write_direct"], nb))
    rows += [("limit", "copy into fresh memory (restore floor)", m["alloc_copy"], nb),
             ("stall", "easyckpt snapshot (synchronous)", m["snapshot"], nb),
             ("stall", "torch.save + fsync", median(r["torch_save"]), nb),
             ("stall", "DCP async_save (blocking part)", median([x["blocking"] for x in dcp]), nb)]
    for key, name in (("hf", "HF Trainer save (+ fsync)"), ("deepspeed", "DeepSpeed save_checkpoint (+ fsync)")):
        if key in r:
            runs = r[key]["runs"]
            rows.append(("stall", name, median([x["save_fsync"] for x in runs]), r[key]["state_bytes"]))
    loop = r.get("loop")
    if loop:
        lb = loop["none"]["state_bytes"]
        rows += [("loop", "easyckpt snapshot, overlapped (loop)", loop["overlap"]["stall"], lb),
                 ("loop", "easyckpt snapshot, synchronous (loop)", loop["sync"]["stall"], lb),
                 ("loop", "raw copy of the loop's state", loop["none"]["raw_copy"], lb),
                 ("loop", "step, no checkpoint", loop["none"]["mean_step"], 0),
                 ("loop", "step, easyckpt overlapped", loop["overlap"]["mean_step"], 0),
                 ("loop", "step, easyckpt synchronous", loop["sync"]["mean_step"], 0)]
    rows += [("persist", "easyckpt snapshot -> committed", m["persist"], nb),
             ("persist", "  of which the agent's write (its log)", m["agent_write"], nb),
             ("persist", "DCP async_save until durable", median([x["total"] for x in dcp]), nb),
             ("restore", "easyckpt from memory", m["restore_memory"], nb),
             ("restore", "easyckpt from storage (verified)", m["restore_storage"], nb),
             ("restore", "torch.load", m["torch_load"], nb)] + \
        ([("restore", "raw O_DIRECT read of the step's files", m["raw_read_direct"], nb)]
         if m.get("raw_read_direct") else [])
    return rows


def print_report(results: List[Dict[str, Any]], repeats: int) -> None:
    print(f"\nmedians of {repeats} repeats (3x as many for the copies); GB = 1e9 bytes; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")
    for r in results:
        e = r["easyckpt"]
        print(f"\n== state {e['state_bytes'] / GB:.3f} GB, {e['tensors']} tensors "
              f"(slots prepared off the training thread in {e['median']['prepare']:.3f} s; first snapshot "
              f"{e['median']['first_snapshot']:.3f} s; medians of {len(e['samples']['first_snapshot'])} jobs)")
        print(f"{'':9}{'measurement':<42}{'seconds':>10}{'GB/s':>9}")
        for group, name, sec, nb in rows_of(r):
            bw = f"{nb / sec / GB:9.2f}" if nb else f"{'':>9}"
            print(f"{group:<9}{name:<42}{sec:>10.4f}{bw}")
    print(f"\n{'goal':<52}" + "".join(f"{r['gb']:>9g} GB" for r in results) + "   target")
    for key, text, test, target in GOALS:
        cells = []
        for r in results:
            v = r["ratios"].get(key)
            if v is None:
                cells.append(f"{'-':>12}")
            else:
                shown = f"{100 * v:.1f}%" if key == "step_overhead" else f"{v:.3f}"
                cells.append(f"{shown:>7} {'PASS' if test(v) else 'MISS':<4}")
        print(f"{text:<52}" + "".join(cells) + f"   {target}")
    for r in results:
        if "loop" in r:
            ra, loop = r["ratios"], r["loop"]
            print(f"step-time overhead at {r['gb']:g} GB: synchronous {100 * ra['step_overhead_sync']:.1f}%, "
                  f"overlapped {100 * ra['step_overhead_overlap']:.1f}%; the default (auto) picks "
                  f"{'overlapped' if loop['auto_overlap'] else 'synchronous'} here: {loop['auto_reason']}")
    print("snapshot->committed / buffered raw write+fsync: "
          + ", ".join(f"{r['ratios']['persist_over_buffered_write']:.3f}" for r in results)
          + "; restore from memory / copy into fresh memory: "
          + ", ".join(f"{r['ratios']['memory_over_fresh_copy']:.2f}" for r in results)
          + "  (restoring from memory is bounded by the kernel handing out fresh pages, storage by the disk)")


def chart(results: List[Dict[str, Any]], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the 'bench' extra): no chart"
    names = [name for group, name, _, _ in rows_of(results[0]) if group in ("limit", "stall", "persist", "restore")]
    loop_names = ["easyckpt snapshot, overlapped (loop)"]
    fig, ax = plt.subplots(figsize=(12, 6))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        rows = {name: sec for _, name, sec, _ in rows_of(r)}
        shown = names + [n for n in loop_names if n in rows]
        xs = [j + i * width for j in range(len(shown))]
        ax.bar(xs, [rows.get(n, float("nan")) for n in shown], width, label=f"{r['easyckpt']['state_bytes'] / GB:.2f} GB")
    labels = names + loop_names
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log scale)")
    ax.set_title("easyckpt vs the frameworks' own savers and the machine's limits (one run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.25,1,4", help="state sizes in GB (1e9 bytes), comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop-max-gb", type=float, default=0.25,
                   help="run the training loop for sizes up to this (its step grows with the size)")
    p.add_argument("--loop-rounds", type=int, default=3,
                   help="rounds of the three training loops (none, overlapped, synchronous), in rotated order")
    p.add_argument("--skip", default="", help="comma-separated: hf, deepspeed")
    p.add_argument("--dir", default=None, help="where temporary files go (default: the system's temp dir)")
    p.add_argument("--out", default="benchmarks/results", help="directory for checkpoint.png and checkpoint.json")
    args = p.parse_args(argv)
    try:
        args.sizes = [float(x) for x in args.sizes.split(",") if x]
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: expected numbers separated by commas, e.g. 0.25,1,4")
    if not args.sizes or min(args.sizes) <= 0 or args.repeats < 1 or args.loop_rounds < 1:
        p.error("--sizes must be positive, --repeats and --loop-rounds at least 1")
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def check_space(sizes: List[float], work: str) -> None:
    from common import free_bytes

    from easyckpt.ipc import shm
    big = max(sizes) * GB
    problems = []
    if free_bytes(shm.SHM_DIR) < 2.2 * big:
        problems.append(f"{shm.SHM_DIR} has {free_bytes(shm.SHM_DIR) / GB:.1f} GB free; the snapshot slots of "
                        f"{max(sizes):g} GB need {2.2 * big / GB:.1f} GB ({shm.shm_advice()})")
    if free_bytes(work) < 4 * big:
        problems.append(f"{work} has {free_bytes(work) / GB:.1f} GB free, {4 * big / GB:.1f} GB are needed "
                        f"(pass --dir on a larger file system)")
    if problems:
        sys.exit("bench_checkpoint: not enough space:\n  " + "\n  ".join(problems) + "\n  or pass smaller --sizes")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    base = args.dir or tempfile.gettempdir()
    check_space(args.sizes, base)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the finally blocks on SIGTERM too
    work = tempfile.mkdtemp(prefix="easyckpt-bench-", dir=base)
    results = []
    try:
        for gb in args.sizes:
            results.append(measure_size(gb, args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(results, args.repeats)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "checkpoint.json"), "w") as f:
        json.dump({"args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
                   "results": results}, f, indent=1, default=str)
    problem = chart(results, os.path.join(args.out, "checkpoint.png"))
    print(f"\nfigures: {os.path.join(args.out, 'checkpoint.json')}; chart: "
          f"{problem or os.path.join(args.out, 'checkpoint.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
