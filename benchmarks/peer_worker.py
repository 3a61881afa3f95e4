"""One rank of the head-to-head with DLRover's flash checkpoint (benchmarks/bench_peer.py launches it).

    torchrun ... peer_worker.py --framework easyckpt --gb 1 --dir D --out O
    dlrover_launch.py ... peer_worker.py --framework dlrover --gb 1 --dir D --out O   (DLRover's own venv)

Every rank holds its own training state of ``--gb`` GB (an nn.Module and a real Adam state: parameters a
third of the bytes, as common.build_state), like the shards of an FSDP or Megatron job, and saves it the
way each library's users do:

- easyckpt: a ``Checkpointer`` with the plain-PyTorch state of this rank, ``load`` first (nothing to
  load: it reserves the slots), then ``save`` each step (memory) and ``save_now`` + ``wait_committed``
  (durable); snapshots synchronous (``snapshot_overlap=False``: this loop has no forward/backward to hide
  a copy behind, so the whole copy is counted as stall)
- DLRover: ``DdpCheckpointer(local_shard_num=ranks on the node, global_shard_num=world)``, its
  ``load_checkpoint`` first, then ``save_checkpoint(..., StorageType.MEMORY)`` each step and
  ``StorageType.DISK`` to persist; durable = its tracker file names the step (polled every 10 ms, its own
  wait polls every 3 s) and then every file of the step fsynced, which DLRover does not do itself

Between the load and the first save, and between two saves, runs the cheapest possible iteration, one
Adam step over the state, on both (untimed between saves). Figures are seconds of this rank, written as
JSON to ``--out``/<framework>-rank<N>.json.
This file runs under DLRover's venv too: it imports nothing of easyckpt's at module level.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import build_state, median  # noqa: E402

DURABLE_TIMEOUT = 600.0     # seconds for one persist, on either library


class Params(torch.nn.Module):
    """The benchmark's parameters as a module (names without dots: they are attributes)."""

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t))


def build(gb: float) -> Tuple[Params, torch.optim.Adam]:
    """A module and an Adam optimizer whose state (step, exp_avg, exp_avg_sq of every parameter) is set,
    as after the first step, from common.build_state's random tensors: every page is really backed."""
    tensors, optim = build_state(gb)
    model = Params(tensors)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p, name in zip(model.parameters(), tensors):
        st = optim["state"][name]
        opt.state[p] = {"step": torch.tensor(float(st["step"])), "exp_avg": st["exp_avg"],
                        "exp_avg_sq": st["exp_avg_sq"]}
        p.grad = torch.zeros_like(p)
    return model, opt


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- easyckpt ----------------------------------------------------------------------------------------

def run_easyckpt(args: argparse.Namespace, model: Params, opt: torch.optim.Adam, rank: int) -> Dict[str, Any]:
    from easyckpt import Checkpointer, Config
    from easyckpt.engine.save import estimate
    from easyckpt.engine.checkpointer import FrameworkState
    from easyckpt.engine.load.reads import Read
    from easyckpt.engine.save.snapshot import ShardSpec

    class RankState(FrameworkState[int]):
        """This rank's own shard of the job's state (every rank persists its own files)."""

        def __init__(self, ckpt: Checkpointer):
            self.ckpt = ckpt

        def collect(self) -> List[ShardSpec]:
            return [ShardSpec(f"model_rank{rank:05d}.safetensors", model.state_dict()),
                    ShardSpec(f"optim_rank{rank:05d}.safetensors", opt.state_dict())]

        def snapshot_bytes(self) -> int:
            return estimate.tensor_bytes(model.state_dict()) + estimate.optimizer_bytes(opt)

        def needed(self, manifest: Dict[str, Any]) -> List[Read]:
            return [Read(f"model_rank{rank:05d}.safetensors"), Read(f"optim_rank{rank:05d}.safetensors")]

        def restore(self, loaded: Any) -> int:
            raise AssertionError("the benchmark's save directory was fresh: nothing should load")

    t0 = time.perf_counter()
    ckpt = Checkpointer(Config(save_dir=args.dir, save_mem_interval=1, save_storage_interval=10**9,
                               max_ckpt_num=2, log_file_path=os.path.join(args.out, f"easyckpt-{rank}.log"),
                               snapshot_overlap=False, autocheckpoint_on_sigterm=False))
    out: Dict[str, Any] = {"init": time.perf_counter() - t0}     # the agent started and answering
    state = RankState(ckpt)
    try:
        out["load"] = timed(lambda: ckpt.load(state))
        out["first_iteration"] = timed(opt.step)
        out["first_save"] = timed(lambda: ckpt.save(1, state, persist=False))
        out["saves"], out["skipped"] = [], []
        for step in range(2, 2 + args.saves):
            opt.step()                   # an iteration between two saves, as in training (not timed)
            dist.barrier()
            t0 = time.perf_counter()
            taken = ckpt.save(step, state, persist=False)
            out["saves"].append(time.perf_counter() - t0)
            if taken is None:            # its second slot still being prepared: skipped after a short wait
                out["skipped"].append(step)
        step = 2 + args.saves
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save_now(step, state)
        out["durable_blocking"] = time.perf_counter() - t0
        ckpt.wait_committed(step, DURABLE_TIMEOUT)     # committed: every rank's files fsynced, manifest renamed
        out["durable"] = time.perf_counter() - t0
        out["durable_no_fsync"] = None                 # the commit includes the fsyncs
    finally:
        ckpt.finalize(persist=False)
    return out


# ---- DLRover -----------------------------------------------------------------------------------------

def run_dlrover(args: argparse.Namespace, model: Params, opt: torch.optim.Adam, rank: int) -> Dict[str, Any]:
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    t0 = time.perf_counter()
    ckpt = DdpCheckpointer(args.dir, local_shard_num=local, global_shard_num=dist.get_world_size())
    out: Dict[str, Any] = {"init": time.perf_counter() - t0}     # its saver runs in dlrover-run's agent
    state = lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()}
    out["load"] = timed(ckpt.load_checkpoint)
    out["first_iteration"] = timed(opt.step)
    out["first_save"] = timed(lambda: ckpt.save_checkpoint(1, state(), storage_type=StorageType.MEMORY))
    out["saves"], out["skipped"] = [], []
    for step in range(2, 2 + args.saves):
        opt.step()                       # an iteration between two saves, as in training (not timed)
        dist.barrier()
        out["saves"].append(timed(lambda: ckpt.save_checkpoint(step, state(), storage_type=StorageType.MEMORY)))
    step = 2 + args.saves
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.save_checkpoint(step, state(), storage_type=StorageType.DISK)
    out["durable_blocking"] = time.perf_counter() - t0
    tracker = os.path.join(args.dir, "dlrover_latest.txt")
    deadline = t0 + DURABLE_TIMEOUT
    while _tracked(tracker) != step:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"DLRover's tracker {tracker} did not name step {step} within {DURABLE_TIMEOUT:g} s")
        time.sleep(0.01)
    out["durable_no_fsync"] = time.perf_counter() - t0
    if rank == 0:          # the tracker is written once every rank's file is; make them durable, as a commit does
        step_dir = os.path.join(args.dir, str(step))
        for path in [os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs] + [tracker]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for d in (step_dir, args.dir):
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    dist.barrier()
    out["durable"] = time.perf_counter() - t0
    return out


def _tracked(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=("easyckpt", "dlrover"), required=True)
    p.add_argument("--gb", type=float, required=True, help="state per rank, GB (1e9 bytes)")
    p.add_argument("--dir", required=True, help="the save directory (fresh)")
    p.add_argument("--out", required=True, help="where this rank's JSON goes")
    p.add_argument("--saves", type=int, default=5, help="saves to memory after the first")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build(args.gb)
    run = run_easyckpt if args.framework == "easyckpt" else run_dlrover
    out = run(args, model, opt, rank)
    out.update(rank=rank, world=dist.get_world_size(), gb=args.gb,
               state_bytes=sum(t.numel() * t.element_size() for t in
                               list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]),
               # the saves taken: one easyckpt skipped (its second slot still being prepared after a
               # short wait; the first slot keeps the newest snapshot) is left out; second_save is the
               # save after the first, taken or skipped
               steady_save=median([sec for step, sec in enumerate(out["saves"], 2) if step not in out["skipped"]]
                                  or out["saves"]),
               second_save=out["saves"][0],
               # what the first save costs the job: easyckpt reserves its slots during the first iteration
               first_total=out["first_iteration"] + out["first_save"])
    with open(os.path.join(args.out, f"{args.framework}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
