"""A small model trained with a plain DeepSpeed engine (ZeRO 0-3) using easyckpt's DeepSpeed verbs.

    torchrun --standalone --nproc_per_node 2 examples/deepspeed/train.py --save-dir /tmp/ds --zero 2

Relaunch the same command after killing it: it resumes from the newest complete state (memory or
storage). With a different ``--nproc_per_node`` it resumes through DeepSpeed's universal checkpoint.
The checkpoints are DeepSpeed's own: ``engine.load_checkpoint(save_dir)`` reads them too.
Runs on GPUs as is, and on CPU (gloo) when CUDA is absent. Each iteration's loss goes to
``--loss-file`` (per rank, exact float hex) so runs can be compared.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch

import easyckpt.deepspeed as eds
from easyckpt.deepspeed.cpu import deepspeed_on_cpu


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-dir", required=True, help="a directory, or s3://BUCKET/PREFIX (an object store)")
    p.add_argument("--local-dir", default=None,
                   help="local_dir: this node's own files (audit and agent logs) for an s3:// save dir")
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1, help="0 makes runs on different rank counts comparable")
    p.add_argument("--global-batch", type=int, default=16, help="kept fixed when the rank count changes")
    p.add_argument("--mem-interval", type=int, default=1)
    p.add_argument("--storage-interval", type=int, default=5)
    p.add_argument("--max-ckpt", type=int, default=3)
    p.add_argument("--log-file", default=None)
    p.add_argument("--loss-file", default=None, help="prefix; rank r appends to PREFIX.rank{r}")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to leave time for a kill")
    p.add_argument("--no-exit-on-sigterm", action="store_true",
                   help="after the SIGTERM checkpoint, train on (default: exit, as before a maintenance)")
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--replication-factor", type=int, default=2,
                   help="copies of each node's snapshot in other nodes' memory, its own included (1: none)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dump-weights", default=None,
                   help="after the last iteration, torch.save the full weights as the engine sees them (rank 0)")
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """The DeepSpeed engine of this example (also used by the tests to build a second, fresh one)."""
    deepspeed_on_cpu()   # no-op with CUDA
    import deepspeed
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    torch.manual_seed(args.seed)   # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1))
    config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.global_batch // world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                    "warmup_num_steps": 10}},
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10 ** 9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def dump_weights(engine, path: str) -> None:
    """The model's full weights (gathered under ZeRO-3; a collective, so every rank calls it), saved by rank 0:
    an independent ground truth for checkpoint converters."""
    import deepspeed
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=engine.zero_optimization_stage() == 3):
        if torch.distributed.get_rank() == 0:
            named = [*module.named_parameters(), *module.named_buffers()]
            torch.save({name: t.detach().clone() for name, t in named}, path)


def main() -> int:
    args = parse()
    engine = build(args)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)

    eds.initialize_easyckpt(args.save_dir, save_mem_interval=args.mem_interval,
                            save_storage_interval=args.storage_interval, max_ckpt_num=args.max_ckpt,
                            log_file_path=args.log_file, agent_idle_timeout=args.idle_timeout,
                            exit_after_ondemand_checkpoint=not args.no_exit_on_sigterm, local_dir=args.local_dir,
                            replication_factor=args.replication_factor)
    t0 = time.perf_counter()
    path, client = eds.load_checkpoint(engine)
    load_s = time.perf_counter() - t0
    start = engine.global_steps
    if path is not None and client.get("data_pos") != start:
        raise RuntimeError(f"client state does not match the step: {client} vs {start}")
    losses = open(f"{args.loss_file}.rank{rank}", "a", buffering=1) if args.loss_file else None
    if losses:
        losses.write(f"# start {start} load_s {load_s:.6f} world {world}\n")

    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(args.seed))   # the task, fixed
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    for it in range(start + 1, args.iters + 1):
        # the global batch of iteration `it` is the same whatever the rank count: each rank takes its rows
        g = torch.Generator().manual_seed(args.seed * 1000 + it)
        x = torch.randn(args.global_batch, 16, generator=g)
        y = x @ w
        rows = slice(rank * (args.global_batch // world), (rank + 1) * (args.global_batch // world))
        out = engine(x[rows].to(engine.device, dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y[rows].to(engine.device))
        engine.backward(loss)
        engine.step()
        if losses:
            losses.write(f"{it} {loss.item().hex()}\n")
        eds.save_checkpoint_if_needed(engine, client_state={"data_pos": it})
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if args.dump_weights:
        dump_weights(engine, args.dump_weights)
    eds.finalize_easyckpt()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
