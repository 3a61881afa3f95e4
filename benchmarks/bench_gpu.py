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

Peers on the same device, at the same intervals (--peers): torch DCP's ``async_save`` as its documentation
shows it (default stager, one save in flight, written to a directory in /dev/shm, so that neither side pays a
disk), every step and every 10th; DLRover's flash checkpoint to memory (``--dlrover SITE``: a folder that holds
the ``dlrover`` package, launched by its own ``dlrover-run`` through dlrover_launch.py), every step and every
10th, in a process of its own with its own no-checkpoint steps. --trace adds each mode's GPU timeline from CUDA
events on the training stream: forward+backward, the optimizer step (which waits for an overlapped copy there),
and the gap between steps (the GPU idle, waiting for the host).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from easyckpt.config import Config  # noqa: E402
from easyckpt.engine.checkpointer import Checkpointer  # noqa: E402
from easyckpt.pytorch import PytorchState  # noqa: E402

TRACE = False
SYNC_BY_STREAM = False
LOSS_PINNED = False
HERE = Path(__file__).resolve().parent
# (name, interval, overlap): overlap None for a peer's mode (its name says which)
Mode = Tuple[str, Optional[int], Optional[bool]]
MODES: List[Mode] = [
    ("none", None, None), ("sync/1", 1, False), ("overlap/1", 1, True), ("overlap/10", 10, True)]
DCP_MODES: List[Mode] = [("dcp/1", 1, None), ("dcp/10", 10, None)]
DLROVER_MODES: List[Mode] = [("none", None, None), ("dlrover/1", 1, None), ("dlrover/10", 10, None)]


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


_DLROVER: Dict[str, Any] = {"step": 0}


def _dlrover_checkpointer(work: Path) -> Any:
    """DLRover's checkpointer, one per process (each holds a saver and shared memory of its agent's)."""
    if "ckpt" not in _DLROVER:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
        _DLROVER["ckpt"] = DdpCheckpointer(str(work / "dlrover"))
    return _DLROVER["ckpt"]


class _Saver:
    """What a mode does after each optimizer step: nothing, easyckpt's save, DCP's async_save or DLRover's."""

    def __init__(self, name: str, interval: Optional[int], overlap: Optional[bool], work: Path):
        self.name, self.interval = name, interval
        self.ckpt: Optional[Checkpointer] = None
        self.pending: List[Any] = []
        self.dlrover: Any = None
        self.dcp_dir = None
        if name.startswith("dcp"):
            self.dcp_dir = tempfile.mkdtemp(prefix="easyckpt-bench-gpu-dcp-", dir="/dev/shm")
        elif name.startswith("dlrover"):
            self.dlrover = _dlrover_checkpointer(work)
        elif interval is not None:
            self.ckpt = Checkpointer(Config(save_dir=str(work / f"ckpt-{interval}-{overlap}"), save_mem_interval=interval,
                                            save_storage_interval=interval * 1_000_000, max_ckpt_num=1,
                                            autocheckpoint_on_sigterm=False, snapshot_overlap=overlap))

    def __call__(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if self.ckpt is not None:
            self.ckpt.save(step, PytorchState(self.ckpt, model, opt, None, step, None), optimizer=opt)
        elif self.interval is None or step % self.interval:
            return
        elif self.dcp_dir is not None:
            import torch.distributed.checkpoint as dcp
            if self.pending:
                self.pending.pop().result()      # one save in flight at a time, as DCP's documentation shows
            self.pending.append(dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                               checkpoint_id=self.dcp_dir, no_dist=True))
        elif self.dlrover is not None:
            from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType
            _DLROVER["step"] += 1       # one checkpointer for the process: its steps only grow
            self.dlrover.save_checkpoint(_DLROVER["step"], {"model": model.state_dict(), "optimizer": opt.state_dict()},
                                         storage_type=StorageType.MEMORY)

    def close(self) -> None:
        for p in self.pending:
            p.result()
        if self.ckpt is not None:
            self.ckpt.finalize(persist=False)
        if self.dcp_dir is not None:
            shutil.rmtree(self.dcp_dir, ignore_errors=True)


def run_mode(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int, steps: int, mode: Mode,
             work: Path) -> List[float]:
    name, interval, overlap = mode
    if name == "dcp/1":
        steps = min(steps, 6)      # each step waits for the previous step's whole save: a few steps tell
    saver = _Saver(name, interval, overlap, work)
    x = torch.randn(batch, model[0].in_features, device="cuda")
    times = []
    warm = 2 * (interval or 1) + 1    # the first two snapshots allocate and page-lock the slots: not timed
    host_opt: List[float] = []
    host_save: List[float] = []
    host_item: List[float] = []
    marks: List[Tuple[object, object, object]] = []
    pinned_loss = torch.empty((), pin_memory=True) if LOSS_PINNED else torch.empty(())
    try:
        for step in range(1, warm + steps + 1):
            if step == warm + 1:
                torch.cuda.synchronize()
                t = time.perf_counter()
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if TRACE and step > warm else None
            if e:
                e[0].record()
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            if e:
                e[1].record()
            h = time.perf_counter()
            opt.step()           # (its pre-hook waits for the previous snapshot's copy, where it must)
            host_opt.append(time.perf_counter() - h)
            if e:
                e[2].record()
                marks.append((e[0], e[1], e[2]))
            h = time.perf_counter()
            saver(step, model, opt)
            host_save.append(time.perf_counter() - h)
            # what a loop that logs its loss waits for: the compute stream, not the side stream's copy
            # (torch.cuda.synchronize() would wait for that copy too, and time an overlap as a stall)
            h = time.perf_counter()
            if SYNC_BY_STREAM:
                torch.cuda.current_stream().synchronize()      # the same wait without a device-to-host copy
            elif LOSS_PINNED:       # the loss read through a page-locked buffer: an asynchronous copy, then a wait
                pinned_loss.copy_(loss.detach(), non_blocking=True)
                torch.cuda.current_stream().synchronize()
                pinned_loss.item()
            else:
                loss.item()
            host_item.append(time.perf_counter() - h)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / steps)
        if TRACE:
            _print_timeline(name, statistics.median(host_opt[warm:]), marks)
            print(f"    [{name}] host time in save {statistics.median(host_save[warm:]) * 1e3:.1f} ms, in the wait for "
                  f"the loss {statistics.median(host_item[warm:]) * 1e3:.1f} ms", flush=True)
    finally:
        saver.close()
    return times


def _print_timeline(name: str, host_opt: float, marks: List[Tuple[object, object, object]]) -> None:
    """The training stream's timeline of a mode (medians over the timed steps, ms)."""
    fb = statistics.median(a.elapsed_time(b) for a, b, _ in marks)           # type: ignore[attr-defined]
    step = statistics.median(b.elapsed_time(c) for _, b, c in marks)         # type: ignore[attr-defined]
    gaps = [marks[i][2].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]  # type: ignore[attr-defined]
    print(f"    [{name}] GPU: forward+backward {fb:.1f} ms, optimizer step {step:.1f} ms, idle between steps "
          f"{statistics.median(gaps) if gaps else 0.0:.1f} ms (max {max(gaps, default=0.0):.1f}); host time in "
          f"optimizer.step {host_opt * 1e3:.1f} ms", flush=True)


def measure(gb: float, modes: List[Mode], args: argparse.Namespace, work: Path) -> Dict[str, float]:
    """Every mode's step time for ``gb`` of state, in rotated order, --rounds times; the ratios to "none"."""
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
    per_round: Dict[str, List[float]] = {m: [] for m, _, _ in modes}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        got = {mode[0]: statistics.median(run_mode(model, opt, batch, args.steps, mode, work)) for mode in order}
        for name in got:
            per_round[name].append(got[name] / got["none"])
        row.update({f"step_s_{name}_round{r}": s for name, s in got.items()})
    for name, interval, _ in modes[1:]:
        ratio = statistics.median(per_round[name])
        row[f"ratio_{name}"] = ratio
        base = statistics.median(row[f"step_s_none_round{r}"] for r in range(args.rounds))
        assert interval is not None
        row[f"extra_per_snapshot_s_{name}"] = (ratio - 1) * base * interval
    del model, opt
    torch.cuda.empty_cache()
    return row


def print_row(gb: float, row: Dict[str, float], modes: List[Mode], rounds: int, head: bool = True) -> None:
    if head:
        print(f"\n{gb:g} GB of state ({row['state_bytes'] / 1e9:.2f} GB): D2H page-locked {row['d2h_pinned_s']:.3f} s "
              f"({row['state_bytes'] / row['d2h_pinned_s'] / 1e9:.1f} GB/s), pageable {row['d2h_pageable_s']:.3f} s")
    print(f"  step without checkpoints (median of rounds): "
          f"{statistics.median(row[f'step_s_none_round{r}'] for r in range(rounds)):.4f} s")
    for name, _, _ in modes[1:]:
        extra = row[f"extra_per_snapshot_s_{name}"]
        print(f"  {name:<11} step time x{row[f'ratio_{name}']:.3f}; extra per snapshot {extra:.4f} s "
              f"= {extra / row['d2h_pinned_s']:.2f} x the page-locked copy", flush=True)


def dlrover_worker(args: argparse.Namespace) -> int:
    """Under dlrover-run: DLRover's modes with their own no-checkpoint steps, as JSON on stdout's last line."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    work = Path(tempfile.mkdtemp(prefix="easyckpt-bench-gpu-dlrover-"))
    try:
        rows = {f"{gb:g}GB": measure(gb, DLROVER_MODES, args, work) for gb in (float(g) for g in args.gb.split(","))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()
    print("DLROVER-RESULT " + json.dumps(rows), flush=True)
    return 0


def run_dlrover(args: argparse.Namespace) -> Optional[Dict[str, Dict[str, float]]]:
    """DLRover's modes in a process of its own, under its launcher; its leftovers removed after."""
    sys.path.insert(0, str(HERE))
    import bench_peer
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.dlrover, str(HERE.parent)]))
    cmd = [sys.executable, str(HERE / "dlrover_launch.py"), "--standalone", "--nproc_per_node=1", __file__,
           "--dlrover-worker", "--gb", args.gb, "--steps", str(args.steps), "--rounds", str(args.rounds)]
    if args.trace:
        cmd.append("--trace")
    before = bench_peer._dlrover_leftovers()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.dlrover_timeout)
    except subprocess.TimeoutExpired:
        print(f"DLRover: no result within {args.dlrover_timeout} s: not compared")
        return None
    finally:
        bench_peer._clean(before)
    for line in done.stdout.splitlines():
        if line.startswith("    ["):
            print(line)
        if line.startswith("DLROVER-RESULT "):
            return json.loads(line[len("DLROVER-RESULT "):])
    print(f"DLRover: its run ended with {done.returncode} and no result: not compared\n{done.stderr[-3000:]}")
    return None


def _feed_at_once(background: Any) -> None:
    """The background copy as shipped until 2026-11-30, for comparison (issue 50's item 7): the feeding thread makes
    its copy calls at once, two pieces in flight, without first waiting for this step's kernels on the host. On the
    H200 of that day it hid none of the copy when the loop read its loss with loss.item() (x1.454)."""
    plain_init = background._PacedDeviceCopy.__init__

    class _Now:
        def synchronize(self) -> None:
            pass

    def init(self: Any, pairs: Any) -> None:
        plain_init(self, pairs)
        self.ready = _Now()
    background._PacedDeviceCopy.__init__ = init
    background.IN_FLIGHT = 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", default="1,4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--capturable", action="store_true", help="Adam(capturable=True): its state all on the GPU")
    p.add_argument("--trace", action="store_true", help="print each mode's GPU timeline and host time in optimizer.step")
    p.add_argument("--peers", action="store_true", help="also torch DCP's async_save, every step and every 10th")
    p.add_argument("--dlrover", metavar="SITE", help="also DLRover's flash checkpoint, from this folder's dlrover")
    p.add_argument("--dlrover-timeout", type=int, default=300)
    p.add_argument("--dlrover-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--modes", help="only these of easyckpt's modes (none is always run), e.g. overlap/1")
    p.add_argument("--sync-by-stream", action="store_true",
                   help="wait for the training stream instead of loss.item() (no device-to-host copy of the loss)")
    p.add_argument("--loss-pinned", action="store_true",
                   help="read the loss through a page-locked buffer (an asynchronous copy) instead of loss.item()")
    p.add_argument("--feed-at-once", action="store_true",
                   help="the background copy as shipped until 2026-11-30: two pieces in flight, fed at once")
    p.add_argument("--piece-mb", type=int, help="the background copy's piece size (default 64)")
    p.add_argument("--in-flight", type=int, help="the background copy's pieces queued beyond the running one (default 0)")
    args = p.parse_args()
    global TRACE, SYNC_BY_STREAM, LOSS_PINNED
    TRACE, SYNC_BY_STREAM, LOSS_PINNED = args.trace, args.sync_by_stream, args.loss_pinned
    from easyckpt.engine.save import background
    if args.piece_mb:
        background.PIECE_BYTES = args.piece_mb << 20
    if args.feed_at_once:
        _feed_at_once(background)
    if args.in_flight is not None:      # 0: each piece's copy call made once the piece before it has ended
        background.IN_FLIGHT = args.in_flight
    if not torch.cuda.is_available():
        print("no GPU: this benchmark measures device-to-host snapshots (benchmarks/bench_checkpoint.py is the CPU one)")
        return 2
    if args.dlrover_worker:
        return dlrover_worker(args)
    work = Path(tempfile.mkdtemp(prefix="easyckpt-bench-gpu-"))
    results: Dict[str, Dict[str, float]] = {}
    modes = MODES + (DCP_MODES if args.peers else [])
    if args.modes:
        modes = [m for m in modes if m[0] == "none" or m[0] in args.modes.split(",")]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    try:
        for gb in (float(g) for g in args.gb.split(",")):
            results[f"{gb:g}GB"] = measure(gb, modes, args, work)
            print_row(gb, results[f"{gb:g}GB"], modes, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.dlrover:
        peer = run_dlrover(args)
        for gb in (float(g) for g in args.gb.split(",")):
            if peer and f"{gb:g}GB" in peer:
                print(f"\n{gb:g} GB, DLRover's flash checkpoint (its own process, its own no-checkpoint steps):")
                print_row(gb, peer[f"{gb:g}GB"], DLROVER_MODES, args.rounds, head=False)
                results[f"{gb:g}GB_dlrover"] = peer[f"{gb:g}GB"]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
