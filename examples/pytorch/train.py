"""A small model trained with plain PyTorch (DDP under torchrun, or a single process) using easyckpt.

    torchrun --standalone --nproc_per_node 2 examples/pytorch/train.py --save-dir /tmp/ckpt --iters 50

Relaunch the same command after killing it (even with kill -9): it resumes from the newest complete
state. The three easyckpt calls are initialize_easyckpt, load_checkpoint and save_checkpoint_if_needed
(every iteration; easyckpt decides when to snapshot and when to persist), then finalize_easyckpt.

Every iteration's loss goes to ``--loss-file`` (one per rank, as exact float hex) so runs can be compared.
The batch, the dropout masks and a numpy/python-random noise term all draw from the global RNGs, so
losses match an uninterrupted run only if easyckpt restores the RNG states too.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

import easyckpt


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-dir", required=True, help="a directory, or s3://BUCKET/PREFIX (an object store)")
    p.add_argument("--endpoint-url", default=None, help="endpoint_url: an S3-compatible store's endpoint")
    p.add_argument("--local-dir", default=None,
                   help="local_dir: this node's own files (audit and agent logs); default: the save dir, or "
                        "~/.cache/easyckpt/<job id> for an s3:// one")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--mem-interval", type=int, default=1, help="save_mem_interval: snapshot to host memory")
    p.add_argument("--storage-interval", type=int, default=5, help="save_storage_interval: also persist")
    p.add_argument("--max-ckpt", type=int, default=3, help="max_ckpt_num: committed checkpoints kept")
    p.add_argument("--local-interval", type=int, default=None,
                   help="save_local_interval: also copy the snapshot to the local tier (under --local-dir)")
    p.add_argument("--log-file", default=None, help="the audit log (every save, commit, load, delete)")
    p.add_argument("--loss-file", default=None, help="prefix; rank r appends to PREFIX.rank{r}")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to leave time for a kill")
    p.add_argument("--job-name", default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-resume", action="store_true", help="start from scratch (a new run in the same save dir)")
    p.add_argument("--start-fresh", action="store_true",
                   help="on_no_valid_checkpoint='start_fresh': when no committed step of this job can be restored, "
                        "set them aside and start from scratch (default: stop, listing each step and why)")
    p.add_argument("--no-exit-on-sigterm", action="store_true",
                   help="after the SIGTERM checkpoint, train on (default: exit, as before a maintenance)")
    p.add_argument("--grace", type=float, default=300.0, help="grace deadline after SIGTERM, seconds")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="snapshot_overlap: copy the optimizer's tensors during the next forward/backward")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 (torch.distributed.fsdp.fully_shard) instead of DDP: "
                        "checkpoints are then torch DCP's layout, each rank writing its own shards")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model and its optimizer live (cuda: this process's GPU, LOCAL_RANK; the "
                        "snapshot copies device to host on a side stream into page-locked slots)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="draw the batches through a torch DataLoader with N worker processes "
                        "(0: in this process); default: from the global RNG, no DataLoader")
    return p


class Hooks:
    """Where a program built on this loop (tests/worker_pytorch.py) adds to it; here they do nothing."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def settings(self) -> dict:
        """More keyword arguments for initialize_easyckpt."""
        return {}

    def loaded(self, model: torch.nn.Module, rank: int) -> None:
        """After load_checkpoint."""

    def loader_args(self) -> dict:
        """More keyword arguments for the DataLoader."""
        return {}

    def before_optimizer_step(self, it: int) -> None:
        pass

    def stepped(self, it: int, rank: int) -> None:
        """After the optimizer and scheduler step, before the iteration's loss is recorded."""

    def after_optimizer_step(self, it: int, rank: int, model: torch.nn.Module, optimizer) -> int:
        """The iteration to pass to save_checkpoint_if_needed."""
        return it

    def stop_after(self, it: int) -> bool:
        return False

    def finalize(self) -> bool:
        return True


class Batches(torch.utils.data.Dataset):
    """Batch ``it`` of one rank, the same whichever process makes it and whether or not the run resumed:
    the data position is the iteration, as Megatron's consumed samples are."""

    def __init__(self, seed: int, rank: int, first: int, last: int):
        self.seed, self.rank, self.first, self.last = seed, rank, first, last

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def __getitem__(self, k: int) -> torch.Tensor:
        it = self.first + k
        return torch.randn(32, 16, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.rank * 10_007 + it))


def main(argv: Optional[List[str]] = None, p: Optional[argparse.ArgumentParser] = None,
         make_hooks: Callable[[argparse.Namespace], Hooks] = Hooks) -> int:
    args = (p or parser()).parse_args(argv)
    hooks = make_hooks(args)
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if world > 1 or args.fsdp:
        # easyckpt's own collectives are on CPU tensors (gloo); the model's, on a GPU, through NCCL
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)

    torch.manual_seed(args.seed)   # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(args.hidden, 1)).to(device)
    torch.manual_seed(args.seed + rank)
    # find_unused_parameters=True keeps DDP's gradient buckets as built: by default DDP re-orders them after the
    # first iteration of every process, so on 3+ ranks a resumed run's first iteration would add the gradients in
    # another order than the uninterrupted run's (a float ulp apart). With it, a resume is bitwise identical.
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if world > 1 and not args.fsdp \
        else model
    if args.fsdp:      # each Linear its own FSDP unit, then the root: parameters become DTensors, sharded over ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)

    easyckpt.initialize_easyckpt(args.save_dir, save_mem_interval=args.mem_interval,
                                 save_storage_interval=args.storage_interval, max_ckpt_num=args.max_ckpt,
                                 log_file_path=args.log_file, job_name=args.job_name, grace_deadline=args.grace,
                                 exit_after_ondemand_checkpoint=not args.no_exit_on_sigterm,
                                 snapshot_overlap={"auto": None, "on": True, "off": False}[args.overlap],
                                 on_no_valid_checkpoint="start_fresh" if args.start_fresh else "error",
                                 endpoint_url=args.endpoint_url, local_dir=args.local_dir,
                                 save_local_interval=args.local_interval, **hooks.settings())
    t0 = time.perf_counter()
    # extra: what the loop needs besides the model, optimizer and scheduler (here the data position)
    start, extra = (0, None) if args.no_resume else easyckpt.load_checkpoint(ddp, optimizer, scheduler)
    load_s = time.perf_counter() - t0
    hooks.loaded(model, rank)
    if start and extra["data_pos"] != start:
        raise RuntimeError(f"extra does not match the iteration: {extra} vs {start}")
    losses = open(f"{args.loss_file}.rank{rank}", "a", buffering=1) if args.loss_file else None
    if losses:
        losses.write(f"# start {start} load_s {load_s:.6f}\n")

    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(args.seed)).to(device)   # the task, fixed
    batches = None
    if args.workers is not None:
        # its own generator: drawing the workers' base seed from the global RNG would shift the dropout masks
        # of a resumed run against an uninterrupted one
        loader = torch.utils.data.DataLoader(Batches(args.seed, rank, start + 1, args.iters), batch_size=None,
                                             num_workers=args.workers, generator=torch.Generator().manual_seed(0),
                                             **hooks.loader_args())
        batches = iter(loader)
    for it in range(start + 1, args.iters + 1):
        x = (next(batches) if batches is not None else torch.randn(32, 16)).to(device)
        y = x @ w + 0.1 * float(np.random.randn()) + 0.01 * random.random()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        hooks.before_optimizer_step(it)
        optimizer.step()
        scheduler.step()
        hooks.stepped(it, rank)
        if losses:
            losses.write(f"{it} {loss.item().hex()}\n")
        told = hooks.after_optimizer_step(it, rank, model, optimizer)
        easyckpt.save_checkpoint_if_needed(told, ddp, optimizer, scheduler, extra={"data_pos": it})
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if hooks.stop_after(it):
            break
    if hooks.finalize():
        easyckpt.finalize_easyckpt()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
