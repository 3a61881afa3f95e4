"""Where pt10's step-time cost comes from: easyckpt's persists, or the disk writes themselves.

    .venv/bin/python benchmarks/bench_disk_share.py [--rounds 3] [--mb 14.7] [--pause 0.05]

Runs bench_overhead.py's pt10 loop (plain PyTorch, an MLP with AdamW, about 10 ms steps) in fresh processes, in
alternating order, four ways:
  none        no checkpoints
  writer      no checkpoints, while another process (no easyckpt, no torch) writes --mb MB with O_DIRECT (1 MiB
              writes) and fsyncs it, again and again with --pause seconds between: the bytes of a pt10 persist,
              back to back as the agent writes them there (one is due every 50 ms and takes longer than that)
  easyckpt    easyckpt at its default settings (save_storage_interval=5)
  no-persist  easyckpt at its defaults but persisting never (save_storage_interval far beyond the run)
and prints each one's step time over the steady part (from step 400) and its ratio to ``none`` of the same round,
with the medians. If ``writer`` costs about what ``easyckpt`` does while ``no-persist`` costs nothing, the cost
is the disk's, not easyckpt's code: on these VMs the host serves each write on the vCPUs' time.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEADY_FROM = 400
RUN_TIMEOUT = 900
MODES = ("none", "writer", "easyckpt", "no-persist")


def worker(mode: str, save_dir: str, out: str) -> None:
    """One pt10 run; writes the time each step began (and the end) to ``out``."""
    sys.path.insert(0, HERE)
    import torch

    import bench_overhead as bo
    spec = bo.REGIMES["pt10"]
    torch.manual_seed(0)
    model = bo._mlp(spec)
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    x = torch.randn(spec["batch"], spec["hidden"])
    if mode in ("easyckpt", "no-persist"):
        import easyckpt.pytorch as ep
        ep.initialize_easyckpt(save_dir, **({"save_storage_interval": 10 ** 9} if mode == "no-persist" else {}))
        ep.load_checkpoint(model, opt)
        began = bo._loop(model, opt, x, spec["steps"], lambda step: ep.save_checkpoint_if_needed(step, model, opt))
        ep.finalize_easyckpt()
    else:
        began = bo._loop(model, opt, x, spec["steps"], lambda step: None)
    with open(out, "w") as f:
        json.dump(began, f)


def writer(path: str, nbytes: int, pause: float) -> None:
    """Write ``nbytes`` to ``path`` with O_DIRECT and fsync, again and again, until killed."""
    chunk = 1 << 20
    buf = mmap.mmap(-1, chunk)            # page-aligned, as O_DIRECT wants
    buf.write(b"\x5a" * chunk)
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
        try:
            left = nbytes
            while left > 0:          # whole aligned chunks (O_DIRECT): the last one may overshoot by < 1 MiB
                left -= os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        time.sleep(pause)


def one_run(mode: str, workdir: str, args: argparse.Namespace) -> float:
    save_dir = tempfile.mkdtemp(dir=workdir)
    out = os.path.join(workdir, "began.json")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    background = None
    if mode == "writer":
        background = subprocess.Popen([sys.executable, __file__, "--writer", os.path.join(save_dir, "w.bin"),
                                       "--mb", str(args.mb), "--pause", str(args.pause)], env=env)
    try:
        subprocess.run([sys.executable, __file__, "--worker", mode, save_dir, out], env=env, check=True,
                       timeout=RUN_TIMEOUT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        if background is not None:
            background.kill()
            background.wait(timeout=30)
    with open(out) as f:
        began = json.load(f)
    return (began[-1] - began[STEADY_FROM]) / (len(began) - 1 - STEADY_FROM)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mb", type=float, default=14.7, help="MB per write (pt10's persist: 14.7)")
    p.add_argument("--pause", type=float, default=0.05, help="seconds between two writes")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--writer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.writer:
        writer(args.writer, int(args.mb * 1e6), args.pause)
        return
    steps: Dict[str, List[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
                steps[mode].append(one_run(mode, workdir, args))
            print(f"round {r + 1}: " + ", ".join(f"{m} {steps[m][-1] * 1e3:.2f} ms" for m in MODES), flush=True)
    print(f"pt10, {args.rounds} rounds, steady part from step {STEADY_FROM}; writer: {args.mb} MB O_DIRECT + fsync, "
          f"{args.pause} s apart")
    for m in MODES:
        ratios = [a / b for a, b in zip(steps[m], steps["none"])]
        print(f"  {m:11s} step {statistics.median(steps[m]) * 1e3:6.2f} ms   / none: median "
              f"{statistics.median(ratios):.3f}  ({', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
