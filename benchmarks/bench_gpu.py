"""easyckpt on a GPU: what a snapshot of device state costs a training step, measured in one run.

    python benchmarks/bench_gpu.py [--gb 1,4] [--steps 20] [--rounds 2] [--out results/gpu.json]

For each training-state size (GB = 1e9 bytes: a float32 MLP on the GPU and its Adam moments, the
parameters a third of the bytes) it measures, in one process:

limit      a device-to-host copy of the same bytes into page-locked host memory and into pageable memory
           (torch's own copies: what any snapshot of device state pays at least)
step time  a compute-bound training step without checkpoints, and with easyckpt snapshotting through its
           real node agent: every step synchronously (snapshot_overlap=False), every step overlapped with
           the next forward/backward (the default on a GPU: side stream, page-locked slots), and every
           10th step overlapped. Modes run in rotated order, --rounds times; each mode is compared with the
           no-checkpoint steps of its own round (a GPU's clocks drift between minutes)

It prints each figure and the ratios (step time with snapshots / without; the extra time per snapshot
against the page-locked copy of the same bytes), and writes them as JSON. Nothing is persisted (the
storage interval is beyond the run); the job's slots in /dev/shm and its temporary save directory are
removed at the end.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from easyckpt.config import Config  # noqa: E402
from easyckpt.engine.checkpointer import Checkpointer  # noqa: E402
from easyckpt.pytorch import PytorchState  # noqa: E402

TRACE = False
MODES: List[Tuple[str, Optional[int], Optional[bool]]] = [
    ("none", None, None), ("sync/1", 1, False), ("overlap/1", 1, True), ("overlap/10", 10, True)]


def model_of(gb: float) -> Tuple[torch.nn.Module, int]:
    """A float32 MLP whose parameters are a third of ``gb`` (Adam's two moments the rest), and its batch."""
    params = gb * 1e9 / 3 / 4
    layers = 5
    hidden = int(math.sqrt(params / layers)) // 64 * 64
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]).cuda()
    return mlp, 4096


def d2h_seconds(nbytes: int, pinned: bool) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del src, dst
    return min(times)


def run_mode(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int, steps: int, interval: Optional[int],
             overlap: Optional[bool], work: Path) -> List[float]:
    ckpt = None
    if interval is not None:
        ckpt = Checkpointer(Config(save_dir=str(work / f"ckpt-{interval}-{overlap}"), save_mem_interval=interval,
                                   save_storage_interval=interval * 1_000_000, max_ckpt_num=1,
                                   autocheckpoint_on_sigterm=False, snapshot_overlap=overlap))
    x = torch.randn(batch, model[0].in_features, device="cuda")
    times = []
    warm = 2 * (interval or 1) + 1    # the first two snapshots allocate and page-lock the slots: not timed
    host_opt = []
    try:
        for step in range(1, warm + steps + 1):
            if step == warm + 1:
                torch.cuda.synchronize()
                t = time.perf_counter()
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            h = time.perf_counter()
            opt.step()           # (its pre-hook waits for the previous snapshot's copy, where it must)
            host_opt.append(time.perf_counter() - h)
            if ckpt is not None:
                ckpt.save(step, PytorchState(ckpt, model, opt, None, step, None), optimizer=opt)
            # what a loop that logs its loss waits for: the compute stream, not the side stream's copy
            # (torch.cuda.synchronize() would wait for that copy too, and time an overlap as a stall)
            loss.item()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / steps)
        if TRACE:
            print(f"    [{interval}/{overlap}] host time in optimizer.step, median {statistics.median(host_opt[warm:]):.4f} s")
    finally:
        if ckpt is not None:
            ckpt.finalize(persist=False)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", default="1,4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--capturable", action="store_true", help="Adam(capturable=True): its state all on the GPU")
    p.add_argument("--trace", action="store_true", help="print the host's time inside optimizer.step per mode")
    args = p.parse_args()
    global TRACE
    TRACE = args.trace
    if not torch.cuda.is_available():
        print("no GPU: this benchmark measures device-to-host snapshots (benchmarks/bench_checkpoint.py is the CPU one)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="easyckpt-bench-gpu-"))
    results: Dict[str, Dict[str, float]] = {}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        for gb in (float(g) for g in args.gb.split(",")):
            model, batch = model_of(gb)
            # capturable: Adam's step counters on the GPU too (else they are host tensors, and the optimizer's
            # pre-hook must wait on the host for the copy of those before the step)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=args.capturable)
            loss = model(torch.randn(batch, model[0].in_features, device="cuda")).square().mean()
            loss.backward()
            opt.step()           # the moments exist: the state is its full size from the first snapshot
            state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + \
                sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
            row: Dict[str, float] = {"state_bytes": state,
                                     "d2h_pinned_s": d2h_seconds(state, True), "d2h_pageable_s": d2h_seconds(state, False)}
            per_round: Dict[str, List[float]] = {m: [] for m, _, _ in MODES}
            for r in range(args.rounds):
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                got = {name: statistics.median(run_mode(model, opt, batch, args.steps, interval, overlap, work))
                       for name, interval, overlap in order}
                for name in got:
                    per_round[name].append(got[name] / got["none"])
                row.update({f"step_s_{name}_round{r}": s for name, s in got.items()})
            for name, interval, _ in MODES[1:]:
                ratio = statistics.median(per_round[name])
                row[f"ratio_{name}"] = ratio
                base = statistics.median(row[f"step_s_none_round{r}"] for r in range(args.rounds))
                assert interval is not None
                row[f"extra_per_snapshot_s_{name}"] = (ratio - 1) * base * interval
            results[f"{gb:g}GB"] = row
            print(f"\n{gb:g} GB of state ({state / 1e9:.2f} GB): D2H page-locked {row['d2h_pinned_s']:.3f} s "
                  f"({state / row['d2h_pinned_s'] / 1e9:.1f} GB/s), pageable {row['d2h_pageable_s']:.3f} s")
            print(f"  step without checkpoints (median of rounds): "
                  f"{statistics.median(row[f'step_s_none_round{r}'] for r in range(args.rounds)):.4f} s")
            for name, _, _ in MODES[1:]:
                extra = row[f"extra_per_snapshot_s_{name}"]
                print(f"  {name:<11} step time x{row[f'ratio_{name}']:.3f}; extra per snapshot {extra:.4f} s "
                      f"= {extra / row['d2h_pinned_s']:.2f} x the page-locked copy")
            del model, opt
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
