"""The trainer the tests drive: examples/pytorch/train.py's training, unchanged, plus the flags only tests
need — faults at a chosen iteration (--inject, --crash-at), ranks that disagree (--misreport), slow steps,
per-iteration state dumps, an exit without finalize, and the agent's timeouts — all through the
example's hooks, so the loop a user copies is the loop every test runs. tests/harness.py's train_cmd
launches it.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "pytorch"))
import train  # noqa: E402  (the example)


def parser() -> argparse.ArgumentParser:
    p = train.parser()
    p.description = __doc__
    p.add_argument("--stop-at", type=int, default=None, help="exit normally after this iteration")
    p.add_argument("--no-finalize", action="store_true", help="exit without finalize_easyckpt()")
    p.add_argument("--crash-at", type=int, default=None, help="raise an exception at this iteration")
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--dump-dir", default=None, help="save the model's and optimizer's state_dict per iteration here")
    p.add_argument("--dump-loaded", default=None, help="save the loaded model's state_dict here")
    p.add_argument("--dump-final", default=None, help="save the model's full state_dict here after training "
                                                      "(gathered from every rank under FSDP)")
    p.add_argument("--slow-step", default=None, metavar="IT:SECONDS",
                   help="iteration IT takes SECONDS longer (before its optimizer step), on every rank")
    p.add_argument("--inject", default="", metavar="IT[@RANK]:HOW,...",
                   help="at iteration IT (on RANK, default 0) HOW = raise | kill | exit | term (SIGTERM to "
                        "itself) | fork-term (fork a helper and end it with SIGTERM, as a multiprocessing.Pool's "
                        "terminate() does); each fires once per --once-dir")
    p.add_argument("--once-dir", default=None)
    p.add_argument("--misreport", default=None, metavar="IT@RANK:STEP",
                   help="at iteration IT, RANK passes STEP to save_checkpoint_if_needed (ranks disagree)")
    p.add_argument("--commit-timeout", type=float, default=600.0)
    p.add_argument("--replication-factor", type=int, default=2, help="peer replicas (1: none)")
    p.add_argument("--replica-bandwidth", type=float, default=1e9, help="bytes/s cap of replication (0: none)")
    p.add_argument("--replica-interval", type=int, default=1, help="replicate every this many snapshots at most")
    p.add_argument("--worker-start", choices=("fork", "spawn", "forkserver"), default=None,
                   help="the DataLoader workers' multiprocessing start method (default: torch's)")
    return p


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


class TestHooks(train.Hooks):
    def settings(self) -> dict:
        return {"agent_idle_timeout": self.args.idle_timeout, "commit_timeout": self.args.commit_timeout,
                "replication_factor": self.args.replication_factor, "replica_bandwidth": self.args.replica_bandwidth,
                "replica_interval": self.args.replica_interval}

    def loaded(self, model: torch.nn.Module, rank: int) -> None:
        self.model, self.rank = model, rank
        if self.args.dump_loaded:
            full_state(model, rank, self.args.dump_loaded)

    def loader_args(self) -> dict:
        return {"multiprocessing_context": self.args.worker_start if self.args.workers else None}

    def before_optimizer_step(self, it: int) -> None:
        if self.args.slow_step and int(self.args.slow_step.split(":")[0]) == it:
            time.sleep(float(self.args.slow_step.split(":")[1]))

    def stepped(self, it: int, rank: int) -> None:
        if self.args.crash_at == it and rank == self.args.crash_rank:
            raise RuntimeError(f"injected crash at iteration {it} on rank {rank}")

    def after_optimizer_step(self, it: int, rank: int, model: torch.nn.Module, optimizer) -> int:
        args = self.args
        if args.inject:
            inject(args.inject, args.once_dir, it, rank)
        if args.dump_dir and rank == 0:
            torch.save(model.state_dict(), os.path.join(args.dump_dir, f"model_{it}.pt"))
            torch.save(optimizer.state_dict(), os.path.join(args.dump_dir, f"optim_{it}.pt"))
        if args.misreport and args.misreport.split(":")[0] == f"{it}@{rank}":
            return int(args.misreport.split(":")[1])
        return it

    def stop_after(self, it: int) -> bool:
        return self.args.stop_at == it

    def finalize(self) -> bool:
        if self.args.dump_final:
            full_state(self.model, self.rank, self.args.dump_final)
        return not self.args.no_finalize


def full_state(model: torch.nn.Module, rank: int, path: str) -> None:
    """The model's whole state dict, saved by rank 0 (under FSDP a gather: every rank calls it)."""
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    if rank == 0:
        torch.save(state, path)


if __name__ == "__main__":
    sys.exit(train.main(p=parser(), make_hooks=TestHooks))
