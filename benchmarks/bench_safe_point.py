"""What the SIGTERM check costs per iteration, measured in one run.

    .venv/bin/python benchmarks/bench_safe_point.py [--calls 200000]

Prints nanoseconds per call of ``save_checkpoint_if_needed`` on an iteration that takes no snapshot,
with the SIGTERM autocheckpoint on and off, and, for scale, one all-reduce of a one-element flag over
2 gloo ranks: the per-iteration price of a collective-based check (Megatron's exit-signal handler
gathers its flag from every rank each iteration).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import easyckpt  # noqa: E402


def per_call(calls: int, autocheckpoint: bool) -> float:
    model = torch.nn.Linear(4, 4)
    with tempfile.TemporaryDirectory() as d:
        easyckpt.initialize_easyckpt(d, save_mem_interval=10 ** 9, save_storage_interval=10 ** 9,
                                     autocheckpoint_on_sigterm=autocheckpoint, agent_idle_timeout=1)
        t0 = time.perf_counter()
        for it in range(1, calls + 1):
            easyckpt.save_checkpoint_if_needed(it, model)
        elapsed = time.perf_counter() - t0
        easyckpt.finalize_easyckpt()
    return elapsed / calls * 1e9


def _allreduce_worker(rank: int, port: int, calls: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    flag = torch.zeros(1)
    for _ in range(100):
        dist.all_reduce(flag)
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(flag)
    if rank == 0:
        out.put((time.perf_counter() - t0) / calls * 1e9)
    dist.destroy_process_group()


def allreduce_ns(calls: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, calls, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    value = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200000)
    args = p.parse_args()
    off = per_call(args.calls, autocheckpoint=False)
    on = per_call(args.calls, autocheckpoint=True)
    coll = allreduce_ns(min(args.calls, 5000))
    print(f"{'measurement':<58} {'ns/iteration':>12}")
    print(f"{'save_checkpoint_if_needed, no snapshot, SIGTERM check off':<58} {off:>12.0f}")
    print(f"{'save_checkpoint_if_needed, no snapshot, SIGTERM check on':<58} {on:>12.0f}")
    print(f"{'  the check itself (on - off)':<58} {on - off:>12.0f}")
    print(f"{'all_reduce of a 1-element flag, 2 gloo ranks (for scale)':<58} {coll:>12.0f}")
    print(f"check / all_reduce: {max(on - off, 0) / coll:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
