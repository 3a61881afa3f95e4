"""The trainer the tests drive: the training of examples/pytorch/train.py (a small model, plain PyTorch,
DDP under torchrun or a single process) plus the flags only tests need — faults at a chosen iteration
(--inject, --crash-at), ranks that disagree (--misreport), slow steps, per-iteration state dumps, an exit
without finalize, and the agent's timeouts. tests/harness.py's train_cmd launches it.

Every iteration's loss goes to ``--loss-file`` (one per rank, as exact float hex) so runs can be compared.
The batch, the dropout masks and a numpy/python-random noise term all draw from the global RNGs, so
losses match an uninterrupted run only if easyckpt restores the RNG states too. Keep the training itself
the same as the example's: test_example.py runs the example against this worker's losses.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import easyckpt


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--mem-interval", type=int, default=1)
    p.add_argument("--storage-interval", type=int, default=5)
    p.add_argument("--max-ckpt", type=int, default=3)
    p.add_argument("--log-file", default=None)
    p.add_argument("--loss-file", default=None, help="prefix; rank r appends to PREFIX.rank{r}")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to leave time for a kill")
    p.add_argument("--stop-at", type=int, default=None, help="exit normally after this iteration")
    p.add_argument("--no-finalize", action="store_true", help="exit without finalize_easyckpt()")
    p.add_argument("--crash-at", type=int, default=None, help="raise an exception at this iteration")
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--job-name", default=None)
    p.add_argument("--dump-dir", default=None, help="save the model's and optimizer's state_dict per iteration here (tests)")
    p.add_argument("--dump-loaded", default=None, help="save the loaded model's state_dict here (tests)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-resume", action="store_true", help="start from scratch (a new run in the same save dir)")
    p.add_argument("--no-exit-on-sigterm", action="store_true",
                   help="after the SIGTERM checkpoint, train on (default: exit, as before a maintenance)")
    p.add_argument("--grace", type=float, default=300.0, help="grace deadline after SIGTERM, seconds")
    p.add_argument("--slow-step", default=None, metavar="IT:SECONDS",
                   help="iteration IT takes SECONDS longer (before its optimizer step), on every rank")
    p.add_argument("--inject", default="", metavar="IT[@RANK]:HOW,...",
                   help="faults for tests: at iteration IT (on RANK, default 0) HOW = raise | kill | exit | term "
                        "(SIGTERM to itself) | fork-term (fork a helper and end it with SIGTERM, as a "
                        "multiprocessing.Pool's terminate() does); each fires once per --once-dir")
    p.add_argument("--once-dir", default=None)
    p.add_argument("--misreport", default=None, metavar="IT@RANK:STEP",
                   help="tests: at iteration IT, RANK passes STEP to save_checkpoint_if_needed (ranks disagree)")
    p.add_argument("--commit-timeout", type=float, default=600.0)
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="snapshot_overlap: copy the optimizer's tensors during the next forward/backward")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="draw the batches through a torch DataLoader with N worker processes (Megatron's default "
                        "is 2; 0: in this process); default: from the global RNG, no DataLoader")
    p.add_argument("--worker-start", choices=("fork", "spawn", "forkserver"), default=None,
                   help="the DataLoader workers' multiprocessing start method (default: torch's)")
    return p.parse_args()


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


def inject(spec: str, once_dir, it: int, rank: int) -> None:
    for item in filter(None, spec.split(",")):
        where, how = item.split(":")
        at, _, r = where.partition("@")
        if int(at) != it or int(r or 0) != rank:
            continue
        if once_dir:
            try:
                os.close(os.open(os.path.join(once_dir, item.replace("@", "_").replace(":", "_")),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
        if how == "raise":
            raise RuntimeError(f"injected crash at iteration {it} on rank {rank}")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(17)
        if how == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        if how == "fork-term":
            helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
            helper.start()
            helper.terminate()
            helper.join(timeout=10)
            if helper.exitcode != -signal.SIGTERM:
                helper.kill()
                raise RuntimeError(f"a process forked from the trainer outlived SIGTERM (exit code {helper.exitcode})")


def main() -> int:
    args = parse()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)

    torch.manual_seed(args.seed)   # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(args.hidden, 1))
    torch.manual_seed(args.seed + rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)

    easyckpt.initialize_easyckpt(args.save_dir, save_mem_interval=args.mem_interval,
                                 save_storage_interval=args.storage_interval, max_ckpt_num=args.max_ckpt,
                                 log_file_path=args.log_file, agent_idle_timeout=args.idle_timeout,
                                 job_name=args.job_name, grace_deadline=args.grace,
                                 exit_after_ondemand_checkpoint=not args.no_exit_on_sigterm,
                                 commit_timeout=args.commit_timeout,
                                 snapshot_overlap={"auto": None, "on": True, "off": False}[args.overlap])
    t0 = time.perf_counter()
    start, extra = (0, None) if args.no_resume else easyckpt.load_checkpoint(ddp, optimizer, scheduler)
    load_s = time.perf_counter() - t0
    if args.dump_loaded and rank == 0:
        torch.save(model.state_dict(), args.dump_loaded)
    if start and extra["data_pos"] != start:
        raise RuntimeError(f"extra does not match the iteration: {extra} vs {start}")
    losses = open(f"{args.loss_file}.rank{rank}", "a", buffering=1) if args.loss_file else None
    if losses:
        losses.write(f"# start {start} load_s {load_s:.6f}\n")

    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(args.seed))   # the task, fixed
    slow_it, slow_s = (int(args.slow_step.split(":")[0]), float(args.slow_step.split(":")[1])) \
        if args.slow_step else (None, 0.0)
    batches = None
    if args.workers is not None:
        # its own generator: drawing the workers' base seed from the global RNG would shift the dropout masks
        # of a resumed run against an uninterrupted one
        loader = torch.utils.data.DataLoader(Batches(args.seed, rank, start + 1, args.iters), batch_size=None,
                                             num_workers=args.workers, generator=torch.Generator().manual_seed(0),
                                             multiprocessing_context=args.worker_start if args.workers else None)
        batches = iter(loader)
    for it in range(start + 1, args.iters + 1):
        x = next(batches) if batches is not None else torch.randn(32, 16)
        y = x @ w + 0.1 * float(np.random.randn()) + 0.01 * random.random()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        if it == slow_it:
            time.sleep(slow_s)
        optimizer.step()
        scheduler.step()
        if args.crash_at == it and rank == args.crash_rank:
            raise RuntimeError(f"injected crash at iteration {it} on rank {rank}")
        if losses:
            losses.write(f"{it} {loss.item().hex()}\n")
        if args.inject:
            inject(args.inject, args.once_dir, it, rank)
        if args.dump_dir and rank == 0:
            torch.save(model.state_dict(), os.path.join(args.dump_dir, f"model_{it}.pt"))
            torch.save(optimizer.state_dict(), os.path.join(args.dump_dir, f"optim_{it}.pt"))
        told = it
        if args.misreport and args.misreport.split(":")[0] == f"{it}@{rank}":
            told = int(args.misreport.split(":")[1])
        easyckpt.save_checkpoint_if_needed(told, ddp, optimizer, scheduler, extra={"data_pos": it})
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.stop_at == it:
            break
    if not args.no_finalize:
        easyckpt.finalize_easyckpt()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
