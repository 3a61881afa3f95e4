"""easyckpt's torch_dist checkpoints against Megatron's own torch_dist save, on the same megatron-core model.

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/bench_megatron.py \
        [--hidden 1024 --layers 8 --vocab 32768] [--saves 4] [--distributed-optimizer]

One process (gloo, CPU; megatron-core on the CPU through examples/megatron/cpu_compat.py), a GPT whose
model + Adam state is a few GB, trained a few iterations so that the optimizer has its state. Then, in one
run, each way of saving the same state, to the same disk:

- easyckpt, ckpt_format="torch_dist", a storage save at every iteration: the stall is the time
  ``save_checkpoint_if_needed`` takes in the loop (the first save apart: after ``load_checkpoint``, with
  nothing to load, a thread reserves the slots while the next iteration runs), and
  "committed" the time from the call to the commit of that iteration (durable: fsync'd, renamed).
- Megatron's ``dist_checkpointing.save`` (torch_dist, synchronous): the training loop waits for all of it.
- Megatron's ``--async-save`` (``async_sharded_save=True`` and its AsyncCallsQueue): the stall is the time
  until ``save`` returns; "durable" the time until the queue's finalize returns.
- Loading each back through Megatron's reader (``dist_checkpointing.load`` on the same layout, page cache
  dropped first where this process may drop it).

It prints the figures and their ratios, and writes them to benchmarks/results/megatron.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "megatron"))
sys.path.insert(0, str(ROOT))

import cpu_compat  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

import easyckpt.megatron as em  # noqa: E402
from easyckpt.megatron import state as mstate  # noqa: E402
from easyckpt.megatron import torchdist  # noqa: E402

SEQ = 64


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--saves", type=int, default=4, help="saves of each kind (the first easyckpt one apart)")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary dir in /tmp)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "megatron.txt"))
    return p.parse_args()


def build(args: argparse.Namespace):
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                            params_dtype=torch.float32, pipeline_dtype=torch.float32)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=args.distributed_optimizer)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp, module=model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, params_dtype=torch.float32,
                                                 use_distributed_optimizer=args.distributed_optimizer), [model])
    return model, opt


def train_step(model, opt) -> None:
    model.zero_grad_buffer()
    opt.zero_grad()
    tokens = torch.randint(0, model.module.vocab_size, (1, SEQ))
    pos = torch.arange(SEQ).unsqueeze(0)
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    model.finish_grad_sync()
    opt.step()


def state_bytes(model, opt) -> int:
    sd = torchdist.sharded_state_dict(0, [model], opt, None, 0.0, None, mstate.parallel(), False)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    return sum(s.data.numel() * s.data.element_size() for s in nested_values(sd) if isinstance(s, ShardedTensor))


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    args = parse()
    cpu_compat.enable()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model, opt = build(args)
    for _ in range(2):
        train_step(model, opt)
    nbytes = state_bytes(model, opt)
    work = Path(args.dir or tempfile.mkdtemp(prefix="easyckpt-bench-megatron-"))
    work.mkdir(parents=True, exist_ok=True)
    out: Dict[str, Any] = {"state_gb": nbytes / 1e9, "distributed_optimizer": args.distributed_optimizer}
    iteration = 2

    # ---- easyckpt ----------------------------------------------------------------------------------
    em.initialize_easyckpt(1, 1, 2, False, save_dir=str(work / "easyckpt"), ckpt_format="torch_dist",
                           agent_idle_timeout=30)
    # as every Megatron job does before its first iteration: nothing to load here, and the snapshot slots
    # get reserved on a thread while the next iteration runs
    t0 = time.perf_counter()
    em.load_checkpoint([model], opt, None)
    out["easyckpt_load_nothing_s"] = time.perf_counter() - t0
    stalls: List[float] = []
    committed: List[float] = []
    for _ in range(args.saves + 1):
        train_step(model, opt)
        iteration += 1
        t0 = time.perf_counter()
        em.save_checkpoint_if_needed(iteration, [model], opt, None)
        stalls.append(time.perf_counter() - t0)
        em._default.require().wait_committed(iteration, 600)
        committed.append(time.perf_counter() - t0)
    em.finalize_easyckpt()
    out["easyckpt_first_save_s"] = stalls[0]
    out["easyckpt_stall_s"] = statistics.median(stalls[1:])
    out["easyckpt_committed_s"] = statistics.median(committed[1:])
    ours = work / "easyckpt" / f"iter_{iteration:07d}"

    # ---- Megatron's own torch_dist save, synchronous and asynchronous ---------------------------------
    def fresh_state(kind: str, n: int):
        """One more iteration, its sharded state dict (Megatron-LM's generate_state_dict) and an empty dir."""
        nonlocal iteration
        train_step(model, opt)
        iteration += 1
        target = work / f"megatron-{kind}-{n}"
        target.mkdir()
        return target, torchdist.sharded_state_dict(iteration, [model], opt, None, 0.0, None, mstate.parallel(),
                                                    False)

    sync: List[float] = []
    for n in range(args.saves):
        target, sd = fresh_state("sync", n)
        t0 = time.perf_counter()
        dist_checkpointing.save(sd, str(target))
        os.sync()          # Megatron's writer does not fsync: count the flush to disk, as easyckpt's commit does
        sync.append(time.perf_counter() - t0)
        if n < args.saves - 1:
            shutil.rmtree(target)
    out["megatron_sync_s"] = statistics.median(sync)
    theirs = work / f"megatron-sync-{args.saves - 1}"

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    queue = AsyncCallsQueue()
    astall: List[float] = []
    adone: List[float] = []
    for n in range(args.saves):
        target, sd = fresh_state("async", n)
        t0 = time.perf_counter()
        request = dist_checkpointing.save(sd, str(target), async_sharded_save=True)
        queue.schedule_async_request(request)
        astall.append(time.perf_counter() - t0)
        queue.maybe_finalize_async_calls(blocking=True)
        os.sync()
        adone.append(time.perf_counter() - t0)
        shutil.rmtree(target)
    queue.close()
    out["megatron_async_stall_s"] = statistics.median(astall)
    out["megatron_async_durable_s"] = statistics.median(adone)

    # ---- loading each through Megatron's reader --------------------------------------------------------
    cold = drop_caches()
    for name, path in (("easyckpt", ours), ("megatron", theirs)):
        drop_caches()
        sd = torchdist.sharded_state_dict(0, [model], opt, None, 0.0, None, mstate.parallel(), True)
        t0 = time.perf_counter()
        dist_checkpointing.load(sd, str(path))
        out[f"load_{name}_s"] = time.perf_counter() - t0
    out["load_page_cache"] = "dropped" if cold else "warm (not root)"

    lines = [
        f"megatron-core GPT hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}: "
        f"{out['state_gb']:.2f} GB of model + Adam state, 1 rank, CPU, "
        f"{'DistributedOptimizer' if args.distributed_optimizer else 'plain optimizer'}; medians of {args.saves}",
        f"  easyckpt torch_dist: load_checkpoint with nothing to load {out['easyckpt_load_nothing_s']:.3f} s, "
        f"first save {out['easyckpt_first_save_s']:.3f} s, stall per save "
        f"{out['easyckpt_stall_s']:.3f} s, snapshot -> committed {out['easyckpt_committed_s']:.3f} s",
        f"  ratio first save / steady stall: {out['easyckpt_first_save_s'] / out['easyckpt_stall_s']:.2f}",
        f"  Megatron torch_dist sync save (+ sync to disk): {out['megatron_sync_s']:.3f} s",
        f"  Megatron torch_dist --async-save: stall {out['megatron_async_stall_s']:.3f} s, durable "
        f"{out['megatron_async_durable_s']:.3f} s",
        f"  ratio stall easyckpt / Megatron sync save:    {out['easyckpt_stall_s'] / out['megatron_sync_s']:.3f}",
        f"  ratio stall easyckpt / Megatron async stall:  "
        f"{out['easyckpt_stall_s'] / out['megatron_async_stall_s']:.3f}",
        f"  ratio committed easyckpt / Megatron sync:     {out['easyckpt_committed_s'] / out['megatron_sync_s']:.3f}",
        f"  ratio committed easyckpt / Megatron async durable: "
        f"{out['easyckpt_committed_s'] / out['megatron_async_durable_s']:.3f}",
        f"  load through Megatron's reader ({out['load_page_cache']} page cache): easyckpt's checkpoint "
        f"{out['load_easyckpt_s']:.3f} s, Megatron's {out['load_megatron_s']:.3f} s",
    ]
    print("\n".join(lines), flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
