"""easyckpt against DLRover's flash checkpoint, its nearest peer: one run, a size sweep, 1 and 2 ranks.

    bash benchmarks/setup_dlrover.sh          # once: DLRover 0.6.1 in .venv-dlrover, on the same torch
    .venv/bin/python benchmarks/bench_peer.py [--sizes 0.25,0.5,1,2,4,8] [--ranks 1,2] [--rounds 1]

For every (ranks per node, GB of state per rank) that fits in this machine's memory it launches the same
worker (peer_worker.py) twice, once per library, each the way its users launch it: torchrun for
easyckpt, DLRover's own ``dlrover-run`` (through dlrover_launch.py's one-line shim) for DLRover, in
alternating order. A cell that does not fit is printed with the memory it would need. Per cell, the
figures are the slowest rank's (a job waits for its slowest rank):

first save  the first save of the job, after ``load`` found nothing and one Adam step ran (the first
            iteration: easyckpt reserves its slots on a thread meanwhile, so it is shown too, and the sum;
            the second save is shown alone, as it may wait for easyckpt's second slot)
stall       a steady save to memory (median); easyckpt's snapshot is synchronous here, which is what its
            default picks on a machine whose cores the training already uses (benchmarks/bench_checkpoint.py
            compares the overlapped one in a training loop)
durable     from the save call until the step is on disk and fsynced: easyckpt's commit; DLRover's
            tracker file naming the step, then its files fsynced (DLRover itself does not fsync; the
            figure without that is shown too)

It prints the ratios of the issue's goals with PASS/MISS, each cost in seconds per GB across the sizes
(its growth), writes peer.json and, with matplotlib, peer.png (--out). Temporary files go under --dir
and are removed; DLRover's own leftovers (its /dev/shm segments, /tmp/ckpt_sock/<job>, /tmp/dlrover)
are removed when they appeared during its run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import GB, median, settle_disk, warm_free_memory  # noqa: E402

FIGURES = ("init", "load", "first_iteration", "first_save", "first_total", "second_save", "steady_save",
           "durable_blocking", "durable_no_fsync", "durable")
GROWTH = ("first_save", "first_total", "steady_save", "durable")   # the costs whose growth is judged
CHARTED = {"first_total": "first iteration + first save", "steady_save": "steady save (stall)",
           "durable": "save -> durable (fsync'd)"}
RUN_TIMEOUT = 1800          # seconds for one launch (an 8 GB state persisted twice over on a slow disk)
# what one rank holds at its peak, in units of its state: the state, its gradients (a third: the
# parameters' size) and, for easyckpt, both snapshot slots; DLRover keeps one shared-memory copy
PEAK = {"easyckpt": 1 + 1 / 3 + 2, "dlrover": 1 + 1 / 3 + 1}
PER_RANK_OVERHEAD = 0.6 * GB   # a python process with torch and the launchers' processes

GOALS = [  # (key, text, test, target)
    ("stall_ratio", "stall per save / DLRover's blocking save", lambda v: v <= 0.5, "<= 0.5"),
    ("durable_ratio", "snapshot -> committed / DLRover save -> durable (fsync'd)", lambda v: v <= 0.25, "<= 0.25"),
    ("first_ratio", "first save of a job / DLRover's first save", lambda v: v <= 1.0, "<= 1.0"),
]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def needs(ranks: int, gb: float) -> int:
    """Bytes of memory a cell needs at its peak (the larger of the two libraries': they run in turn)."""
    return int(ranks * (max(PEAK.values()) * gb * GB + PER_RANK_OVERHEAD))


def launch(framework: str, ranks: int, gb: float, args: argparse.Namespace, work: str) -> Dict[str, Any]:
    """Run one library's job; returns the slowest rank's figures and every rank's."""
    out = tempfile.mkdtemp(prefix=f"{framework}-out-", dir=work)
    save_dir = os.path.join(work, f"{framework}-ckpt")
    worker = [os.path.join(HERE, "peer_worker.py"), "--framework", framework, "--gb", str(gb),
              "--dir", save_dir, "--out", out, "--saves", str(args.saves)]
    if framework == "easyckpt":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] + worker
    else:
        cmd = [args.dlrover_python, os.path.join(HERE, "dlrover_launch.py"), "--standalone",
               f"--nproc_per_node={ranks}"] + worker
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    settle_disk()
    warm_free_memory(min(needs(ranks, gb), mem_available() // 2))
    before = _dlrover_leftovers()
    log = os.path.join(work, f"{framework}-{ranks}x{gb:g}.log")
    try:
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bench_peer: {framework} at {ranks} x {gb:g} GB ran past {RUN_TIMEOUT} s; log: {_tail(log)}")
    finally:
        if framework == "dlrover":      # easyckpt cleans up after itself: a leftover of its would be a bug
            _clean(before)
        shutil.rmtree(save_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_peer: {framework} at {ranks} x {gb:g} GB failed (exit {proc.returncode}):\n{_tail(log)}")
    per_rank = []
    for r in range(ranks):
        with open(os.path.join(out, f"{framework}-rank{r}.json")) as f:
            per_rank.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    slowest = {k: max(x[k] for x in per_rank) if per_rank[0].get(k) is not None else None for k in FIGURES}
    return {"slowest": slowest, "ranks": per_rank}


def _tail(path: str, n: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def _dlrover_leftovers() -> set:
    """What DLRover leaves behind, by its own naming: its shared-memory segments (``<job>_ckpt_shm_<n>``)
    and its hard-coded socket and event directories. Only what appears during a DLRover run is removed
    after it: another job's files on this machine are never touched."""
    found = {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if "_ckpt_shm_" in n}
    for d in ("/tmp/ckpt_sock", "/tmp/dlrover"):
        if os.path.isdir(d) and not os.path.islink(d):
            found |= {d} | {os.path.join(d, n) for n in os.listdir(d)}
    return found


def _clean(before: set) -> None:
    for path in sorted(_dlrover_leftovers() - before, key=len, reverse=True):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def measure(args: argparse.Namespace, work: str) -> Tuple[List[Dict[str, Any]], List[str]]:
    cells, skipped = [], []
    order = ["easyckpt", "dlrover"]
    for ranks in args.ranks:
        for gb in args.sizes:
            need, have = needs(ranks, gb), mem_available()
            if need > have * 0.9 or 2.2 * ranks * gb * GB > shutil.disk_usage("/dev/shm").free:
                skipped.append(f"{ranks} rank(s) x {gb:g} GB: needs about {need / GB:.1f} GB of memory at its peak "
                               f"(state, gradients, snapshot slots), this machine has {have / GB:.1f} GB available")
                print(f"[{ranks} x {gb:g} GB] skipped: {skipped[-1]}", flush=True)
                continue
            runs: Dict[str, List[Dict[str, Any]]] = {f: [] for f in order}
            for rnd in range(args.rounds):
                for fw in order:
                    print(f"[{ranks} x {gb:g} GB] round {rnd + 1}/{args.rounds}: {fw}", flush=True)
                    runs[fw].append(launch(fw, ranks, gb, args, work))
                order.reverse()     # the next cell (or round) starts with the other library
            cell = {"ranks": ranks, "gb": gb, "state_bytes": runs["easyckpt"][0]["ranks"][0]["state_bytes"],
                    "runs": runs}
            for fw in runs:
                cell[fw] = {k: median([r["slowest"][k] for r in runs[fw]]) if runs[fw][0]["slowest"][k] is not None
                            else None for k in FIGURES}
            e, d = cell["easyckpt"], cell["dlrover"]
            cell["ratios"] = {"stall_ratio": e["steady_save"] / d["steady_save"],
                              "durable_ratio": e["durable"] / d["durable"],
                              "first_ratio": e["first_save"] / d["first_save"],
                              # easyckpt reserves its slots while the first iteration runs: that
                              # iteration and the save together, against the same two of DLRover's
                              "first_total_ratio": e["first_total"] / d["first_total"]}
            cells.append(cell)
    return cells, skipped


def growth(cells: List[Dict[str, Any]], ranks: int, fw: str, key: str) -> Optional[Tuple[List[float], float]]:
    """Seconds per GB of one cost at each size from 1 GB on, and the largest over the smallest."""
    per_gb = [c[fw][key] / c["gb"] for c in cells if c["ranks"] == ranks and c["gb"] >= 1]
    if len(per_gb) < 2:
        return None
    return per_gb, max(per_gb) / min(per_gb)


def report(cells: List[Dict[str, Any]], skipped: List[str], args: argparse.Namespace) -> None:
    print(f"\nDLRover 0.6.1 under dlrover-run vs easyckpt under torchrun; {os.cpu_count()} CPUs; "
          f"medians of {args.rounds} round(s); the slowest rank of each job; seconds; GB = 1e9 bytes per rank")
    head = f"{'ranks':>5} {'GB':>6}  {'':9}" + "".join(f"{k:>17}" for k in FIGURES)
    print(head)
    for c in cells:
        for fw in ("easyckpt", "dlrover"):
            vals = "".join(f"{c[fw][k]:>17.4f}" if c[fw][k] is not None else f"{'-':>17}" for k in FIGURES)
            print(f"{c['ranks']:>5} {c['gb']:>6g}  {fw:<9}{vals}")
    print(f"\n{'goal':<58}" + "".join(f"{c['ranks']}x{c['gb']:g}GB".rjust(12) for c in cells) + "   target")
    for key, text, test, target in GOALS:
        cells_txt = "".join(f"{c['ratios'][key]:>7.3f} {'PASS' if test(c['ratios'][key]) else 'MISS'}" for c in cells)
        print(f"{text:<58}{cells_txt}   {target}")
    note = "  (first iteration + first save) / DLRover's, not a goal"
    print(f"{note:<58}"
          + "".join(f"{c['ratios']['first_total_ratio']:>12.3f}" for c in cells))
    print("\ngrowth from 1 GB on: seconds per GB at each size, and the largest over the smallest (goal: within 1.3x)")
    for ranks in sorted({c["ranks"] for c in cells}):
        for fw in ("easyckpt", "dlrover"):
            for key in GROWTH:
                g = growth(cells, ranks, fw, key)
                if g is None:
                    continue
                per_gb, spread = g
                print(f"  {ranks} rank(s) {fw:<9}{key:<13}" + " ".join(f"{v:8.4f}" for v in per_gb)
                      + f"   {spread:5.2f}x {'PASS' if spread <= 1.3 else 'MISS'}")
    for c in cells:
        for fw in ("easyckpt", "dlrover"):
            steps = sorted({st for run in c["runs"][fw] for r in run["ranks"] for st in r.get("skipped", [])})
            if steps:      # not in steady_save: a snapshot skipped while the second slot was prepared
                print(f"{c['ranks']} x {c['gb']:g} GB: {fw} skipped the memory save of step(s) "
                      f"{', '.join(map(str, steps))} (second slot still being prepared)")
    for s in skipped:
        print(f"not measured: {s}")


def chart(cells: List[Dict[str, Any]], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (EXTRAS=all,test,bench bash scripts/bootstrap.sh): no chart"
    rank_counts = sorted({c["ranks"] for c in cells})
    fig, axes = plt.subplots(1, len(CHARTED), figsize=(5 * len(CHARTED), 4.5))
    sizes = sorted({c["gb"] for c in cells})
    for ax, (key, title) in zip(axes, CHARTED.items()):
        for ranks in rank_counts:
            row = [c for c in cells if c["ranks"] == ranks]
            for fw, style in (("easyckpt", "-o"), ("dlrover", "--s")):
                ax.plot([c["gb"] for c in row], [c[fw][key] for c in row], style, label=f"{fw}, {ranks} rank(s)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{g:g}" for g in sizes])
        ax.minorticks_off()
        ax.set_xlabel("state per rank, GB")
        ax.set_ylabel("seconds (slowest rank)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("easyckpt vs DLRover flash checkpoint (one run)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return None


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.25,0.5,1,2,4,8", help="GB of state per rank, comma-separated")
    p.add_argument("--ranks", default="1,2", help="ranks on the node, comma-separated")
    p.add_argument("--rounds", type=int, default=1, help="launches per library and cell (medians)")
    p.add_argument("--saves", type=int, default=5, help="saves to memory per launch after the first")
    p.add_argument("--dlrover-python", default=os.path.join(ROOT, ".venv-dlrover", "bin", "python"),
                   help="the python of DLRover's venv (benchmarks/setup_dlrover.sh makes .venv-dlrover)")
    p.add_argument("--dir", default=None, help="where temporary files go (default: the system's temp dir)")
    p.add_argument("--out", default="benchmarks/results", help="directory for peer.json and peer.png")
    args = p.parse_args(argv)
    try:
        args.sizes = [float(x) for x in args.sizes.split(",") if x]
        args.ranks = [int(x) for x in args.ranks.split(",") if x]
    except ValueError:
        p.error("--sizes and --ranks: numbers separated by commas, e.g. --sizes 0.25,1,4 --ranks 1,2")
    if not args.sizes or min(args.sizes) <= 0 or not args.ranks or min(args.ranks) < 1 or args.rounds < 1 \
            or args.saves < 1:
        p.error("--sizes must be positive; --ranks, --rounds and --saves at least 1")
    if not os.access(args.dlrover_python, os.X_OK):
        p.error(f"no DLRover python at {args.dlrover_python}: run `bash benchmarks/setup_dlrover.sh` first, "
                f"or pass --dlrover-python")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="easyckpt-peer-", dir=args.dir)
    t0 = time.time()
    try:
        cells, skipped = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(cells, skipped, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "peer.json"), "w") as f:
        json.dump({"args": vars(args), "cells": cells, "skipped": skipped, "seconds": time.time() - t0}, f, indent=1)
    problem = chart(cells, os.path.join(args.out, "peer.png")) if cells else "nothing measured"
    print(f"\nfigures: {os.path.join(args.out, 'peer.json')}; chart: {problem or os.path.join(args.out, 'peer.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
