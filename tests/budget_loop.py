"""A training loop whose step time is known (a sleep beside a tiny MLP's step), with or without easyckpt's
snapshots, that writes when each step began: tests/test_budget.py compares its stopwatch with what easyckpt's
snapshot budget says it costs."""
from __future__ import annotations

import argparse
import json
import time

import torch

import easyckpt.pytorch as ep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", default=None, help="easyckpt's save_dir; left out: no easyckpt")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--sleep", type=float, required=True, help="seconds each step sleeps")
    p.add_argument("--max-overhead", type=float, default=None)
    p.add_argument("--out", required=True, help="a JSON list of when each step began (seconds)")
    p.add_argument("--storage-interval", type=int, default=10 ** 6, help="0: save_storage_interval left at its default")
    p.add_argument("--metrics", default=None,
                   help="a JSON list of easyckpt.checkpoint_metrics() every 10 steps, then after finalize")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x = torch.randn(8, 64)
    if args.dir:
        given = {"save_storage_interval": args.storage_interval} if args.storage_interval else {}
        ep.initialize_easyckpt(args.dir, max_overhead=args.max_overhead, **given)
        ep.load_checkpoint(model, opt)
    began, figures = [], []
    for step in range(1, args.steps + 1):
        began.append(time.perf_counter())
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        time.sleep(args.sleep)
        opt.step()
        if args.dir:
            ep.save_checkpoint_if_needed(step, model, opt)
            if step % 10 == 0:
                figures.append(ep.checkpoint_metrics())
    began.append(time.perf_counter())
    if args.dir:
        ep.finalize_easyckpt()
        figures.append(ep.checkpoint_metrics())
    if args.metrics:
        with open(args.metrics, "w") as f:
            json.dump(figures, f)
    with open(args.out, "w") as f:
        json.dump(began, f)


if __name__ == "__main__":
    main()
