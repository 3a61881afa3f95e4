"""A small GPT pretrained with megatron-core: TP / PP / DP, Megatron DDP, the Megatron optimizer
(optionally the distributed optimizer), an OptimizerParamScheduler and megatron's pipeline schedules.

On a CPU-only machine (gloo, with the switches of ``cpu_compat.py``)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 examples/megatron/pretrain_gpt.py \\
        --cpu --tp 2 --iters 10 --loss-file /tmp/loss
    ... --cpu --pp 2 ...                               # pipeline parallel, 2 stages
    ... --cpu --use-distributed-optimizer ...          # TP=1, DP=2, optimizer state sharded over DP

On GPUs drop ``--cpu`` (NCCL, one GPU per rank). The data-parallel size is
``world_size / (tp * pp)``.

The model is tiny (2 layers, hidden 64, 4 heads, vocab 128, sequence 32, no dropout) and the data are
synthetic: every sample is an arithmetic progression of token ids modulo the vocabulary (random start
and stride), which the model learns within a few iterations. A sample is drawn from a generator seeded
with (seed, iteration, global sample index); a data-parallel rank takes its slice of the global batch.
So a run is reproducible, the data of iteration i do not depend on earlier iterations (a resumed run
needs no data-loader state), and every parallel layout sees the same global batches.

``--loss-file PREFIX``: every rank of the last pipeline stage appends "iteration loss.hex()" lines to
PREFIX.rank{r} (the loss averaged over the global batch: all data-parallel ranks write the same
value). Ranks of other pipeline stages do not know the loss and write no file (with --pp 2 on two
processes, only PREFIX.rank1 exists).

Checkpointing is easyckpt's (``easyckpt.megatron``'s verbs, with Megatron-LM's signatures): ``--save DIR``
turns it on (``--ckpt-format torch_dist`` or ``torch``, ``--save-mem-interval`` / ``--save-storage-interval``),
a relaunch with the same command resumes; without ``--save`` the model trains without checkpoints.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from typing import Iterator, List

import numpy as np
import torch
import torch.distributed as dist

# Without Transformer Engine / Apex, megatron-core warns at import that it falls back to torch's own
# optimizer (torch.optim.AdamW, also under the DistributedOptimizer) and local multi-tensor helpers.
# That is expected here; keep the output readable.
# Likewise the local layer spec falls back to torch's LayerNorm without Apex, and TransformerConfig warns
# about a deprecated default of cuda_graph_scope that this script does not use.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")
# The DistributedOptimizer's zero_grad reads `.grad` of its parameter-shard views (non-leaf tensors),
# and megatron calls torch.distributed.reduce_scatter_tensor / all_gather_into_tensor, which torch 2.13
# deprecates. Both are megatron's, harmless, and not ours to fix.
warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                        "is deprecated", category=FutureWarning)

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_compat  # noqa: E402

import easyckpt.megatron as easyckpt_megatron  # noqa: E402

VOCAB_SIZE = 128
SEQ_LENGTH = 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    p.add_argument("--vp", type=int, default=1,
                   help="virtual pipeline chunks per stage (the interleaved schedule; needs --pp > 1)")
    p.add_argument("--num-layers", type=int, default=2, help="transformer layers (a multiple of pp * vp)")
    p.add_argument("--num-experts", type=int, default=0, help="MoE: experts per MLP layer (0: a dense MLP)")
    p.add_argument("--ep", type=int, default=1, help="expert-model-parallel size (with --num-experts)")
    p.add_argument("--iters", type=int, default=10, help="train until this iteration (inclusive)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration over all data-parallel ranks (default 8)")
    g.add_argument("--num-microbatches", type=int, default=None,
                   help="microbatches per iteration per data-parallel rank (instead of --global-batch-size)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine"])
    p.add_argument("--lr-warmup-iters", type=int, default=0)
    p.add_argument("--lr-decay-iters", type=int, default=100,
                   help="length of the decay (kept apart from --iters so that the schedule of a run does "
                        "not depend on where it stops)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo (enables cpu_compat)")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--loss-file", default=None, help="prefix; rank r appends to PREFIX.rank{r}")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each iteration")
    p.add_argument("--quiet", action="store_true", help="no per-iteration log line")
    ck = p.add_argument_group("checkpointing (easyckpt)")
    ck.add_argument("--save", default=None, help="checkpoint directory, or s3://BUCKET/PREFIX; none: no checkpoints")
    ck.add_argument("--local-dir", default=None,
                    help="local_dir: this node's own files (audit and agent logs) for an s3:// --save")
    ck.add_argument("--save-mem-interval", type=int, default=1)
    ck.add_argument("--save-storage-interval", type=int, default=5)
    ck.add_argument("--max-ckpt-num", type=int, default=3)
    ck.add_argument("--ckpt-log", default=None, help="easyckpt audit log (JSON lines)")
    ck.add_argument("--agent-idle-timeout", type=float, default=60.0)
    ck.add_argument("--replication-factor", type=int, default=2,
                    help="copies of each node's snapshot in other nodes' memory, its own included (1: none)")
    ck.add_argument("--no-exit-on-sigterm", action="store_true",
                    help="after the SIGTERM checkpoint, train on (default: exit, as before a maintenance)")
    ck.add_argument("--no-finalize", action="store_true", help="exit without finalize_easyckpt()")
    ck.add_argument("--ckpt-format", default="torch", choices=["torch", "torch_dist"],
                    help="checkpoint layout: Megatron's torch_dist (resumes on any TP/PP/DP layout) or torch")
    ck.add_argument("--dump-state", default=None, metavar="PREFIX",
                    help="(tests) write this rank's chunks of the model and optimizer state, as global tensors' "
                         "pieces, to PREFIX.loaded.rankR.pt after the load and PREFIX.final.rankR.pt at the end")
    ck.add_argument("--concat", action="store_true",
                    help="resume a checkpoint saved with another data-parallel size")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------
# distributed setup
# ----------------------------------------------------------------------------------------------------

def initialize(args: argparse.Namespace) -> None:
    """Process group, megatron's model-parallel groups, batch geometry and the random seeds."""
    # Megatron recommends (and warns without it) one CUDA connection, so that its tensor-parallel
    # communication is ordered with the computation; it must be set before CUDA is initialised.
    # Irrelevant but harmless on the CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if args.cpu:
        cpu_compat.enable()
        backend = "gloo"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    dist.init_process_group(backend)
    world = dist.get_world_size()
    if world % (args.tp * args.pp):
        raise SystemExit(f"world size {world} is not divisible by tp*pp = {args.tp * args.pp}")

    if args.num_layers % (args.pp * args.vp) or (args.vp > 1 and args.pp == 1):
        raise SystemExit(f"--num-layers {args.num_layers} must be a multiple of pp * vp = {args.pp * args.vp}, "
                         f"and --vp needs --pp > 1")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vp if args.vp > 1 else None,
        expert_model_parallel_size=args.ep)
    args.dp = parallel_state.get_data_parallel_world_size()
    if args.num_microbatches is not None:
        args.global_batch_size = args.micro_batch_size * args.num_microbatches * args.dp
    else:
        if args.global_batch_size is None:
            args.global_batch_size = 8
        per_step = args.micro_batch_size * args.dp
        if args.global_batch_size % per_step:
            raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                             f"micro-batch-size * dp = {per_step}")
        args.num_microbatches = args.global_batch_size // per_step

    # Like Megatron-LM: a different seed per pipeline stage (its layers are different weights), the
    # same within a stage; then megatron's RNG tracker (default / tensor-parallel / expert states).
    # With cpu_compat the "CUDA" generator is the CPU one, so model_parallel_cuda_manual_seed re-seeds
    # the CPU generator with `seed` (its data-parallel state) as well.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def device(args: argparse.Namespace) -> torch.device:
    return torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())


# ----------------------------------------------------------------------------------------------------
# model, optimizer, scheduler
# ----------------------------------------------------------------------------------------------------

def build_model_and_optimizer(args: argparse.Namespace):
    """Returns (model, optimizer, scheduler): the list of DDP-wrapped GPTModel chunks of this pipeline
    stage (one, or --vp with the interleaved schedule), the Megatron optimizer over them, and the
    learning-rate / weight-decay scheduler."""
    if args.cpu and args.num_experts:
        cpu_compat.moe_without_te()
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=64,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vp if args.vp > 1 else None,
        # gloo pairs point-to-point messages between two ranks in the order they are posted: a batch that
        # sends both ways to one peer (the interleaved schedule at pp 2) would swap activations and
        # gradients; megatron-core's unbatched order (even ranks send first) pairs them right
        batch_p2p_comm=not args.cpu,
        pipeline_dtype=torch.float32,   # required when pp > 1: dtype of the tensors sent between stages
        params_dtype=torch.float32,
        # On the CPU the weights must be created on the CPU (the GPU path initialises on the device).
        # For TP it creates the full weight from the CPU RNG and keeps this rank's slice.
        use_cpu_initialization=args.cpu,
        # MoE (--num-experts): top-1 routing, no load-balancing loss, tokens gathered to every expert rank
        # (the allgather dispatcher: plain collectives, fine with gloo); experts split over --ep ranks
        **(dict(num_moe_experts=args.num_experts, moe_router_topk=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.0,
                moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
                expert_model_parallel_size=args.ep,
                # no linear biases: megatron-core 0.16 adds an expert's bias in place on a view (an autograd
                # error) when the experts are not split (EP 1)
                add_bias_linear=False) if args.num_experts else {}),
        # The fusions (gradient accumulation, bias-gelu, masked softmax, rope, ...) default to off in
        # megatron-core's configs; they need TE/Apex/CUDA kernels and must stay off on the CPU.
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = []
    for vp_stage in range(args.vp):
        # each chunk of an interleaved stage holds every (pp * vp)-th slice of layers: Megatron numbers
        # them globally by its vp_stage
        stage = vp_stage if args.vp > 1 else None
        if args.vp > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
        chunk = GPTModel(
            config=config,
            # pure megatron-core modules, no TE
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts or None),
            vocab_size=VOCAB_SIZE,
            max_sequence_length=SEQ_LENGTH,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            # Tied input/output embeddings, the Megatron-LM default: with pp > 1 the first and the last
            # stage each hold a copy, kept equal by an all-reduce of their grads in finalize_model_grads.
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
            vp_stage=stage,
        )
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if not args.cpu:
            chunk.cuda(torch.cuda.current_device())
        # as Megatron-LM does: one bucket for the chunks after the first
        model.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                             disable_bucketing=vp_stage > 0))
    if args.vp > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=args.clip_grad,
        params_dtype=torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    # Without TE/Apex both the plain Megatron optimizer and the DistributedOptimizer wrap
    # torch.optim.AdamW. Its per-parameter state ("step", "exp_avg", "exp_avg_sq") is created lazily at
    # the first step: a DistributedOptimizer that never stepped has no Adam state to save or load into.
    optimizer = get_megatron_optimizer(opt_config, model)

    # Steps are counted in iterations (increment=1), not in samples as Megatron-LM does.
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters > 0 else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.lr_decay_iters,
        wd_incr_style="constant",
    )

    # Hooks the pipeline schedules call: loss scaling (a no-op factor of 1 in fp32) and, after the last
    # backward, the data-parallel grad reduction (all-reduce, or reduce-scatter for the distributed
    # optimizer) plus the embedding-grad all-reduce between the first and last pipeline stages.
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, scheduler


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------

def _sample(seed: int, iteration: int, index: int) -> torch.Tensor:
    """SEQ_LENGTH + 1 token ids: an arithmetic progression mod VOCAB_SIZE, fixed by (seed, it, index)."""
    # SeedSequence mixes the three numbers into a well-spread 64-bit seed (no collisions between e.g.
    # (it=1, index=10) and (it=10, index=1) as a naive sum would give).
    mixed = int(np.random.SeedSequence([seed, iteration, index]).generate_state(2, np.uint32).view(np.uint64)[0])
    g = torch.Generator().manual_seed(mixed & ((1 << 63) - 1))
    start = torch.randint(0, VOCAB_SIZE, (1,), generator=g)
    stride = torch.randint(1, 8, (1,), generator=g)
    return (start + stride * torch.arange(SEQ_LENGTH + 1)) % VOCAB_SIZE


def microbatches(args: argparse.Namespace, iteration: int) -> Iterator[dict]:
    """This data-parallel rank's microbatches of one iteration (identical on its TP / PP peers)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = args.micro_batch_size * args.num_microbatches
    dev = device(args)
    # Causal mask, True = masked out (megatron's convention), shared by the whole batch.
    causal = torch.triu(torch.ones(SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), diagonal=1)
    causal = causal.view(1, 1, SEQ_LENGTH, SEQ_LENGTH).to(dev)
    positions = torch.arange(SEQ_LENGTH).unsqueeze(0).expand(args.micro_batch_size, -1).to(dev)
    for mb in range(args.num_microbatches):
        first = dp_rank * per_rank + mb * args.micro_batch_size
        seqs = torch.stack([_sample(args.seed, iteration, first + i) for i in range(args.micro_batch_size)])
        yield {
            "tokens": seqs[:, :-1].contiguous().to(dev),
            "labels": seqs[:, 1:].contiguous().to(dev),
            "loss_mask": torch.ones(args.micro_batch_size, SEQ_LENGTH, device=dev),
            "position_ids": positions,
            "attention_mask": causal,
        }


def forward_step(data_iterator, model):
    """megatron's forward_step_func: run one microbatch, return (output, loss function).

    Every pipeline stage draws the batch (the first uses the tokens, the last the labels; generating
    it is cheap). On the last stage the model returns the per-token loss because labels are given.
    """
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    mask = batch["loss_mask"]

    def loss_func(per_token_loss: torch.Tensor):
        loss = torch.sum(per_token_loss.float().view(-1) * mask.view(-1)) / mask.sum()
        # The schedule divides the first element by the number of microbatches IN PLACE
        # (`output_tensor /= num_microbatches`). loss.detach() shares its storage and would be divided
        # too (the reported loss came out 1/num_microbatches of the true one): report a copy.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


# ----------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------

def train(model, optimizer, scheduler, start_iteration: int, args: argparse.Namespace) -> int:
    """Train iterations start_iteration + 1 .. args.iters; returns the last iteration completed."""
    forward_backward = get_forward_backward_func()
    last_stage = parallel_state.is_pipeline_last_stage()
    rank = dist.get_rank()
    log_rank = dist.get_world_size() - 1      # always on the last pipeline stage
    losses_out = None
    if args.loss_file and last_stage:
        losses_out = open(f"{args.loss_file}.rank{rank}", "a", buffering=1)

    iteration = start_iteration
    step_times: List[float] = []
    t_loop = time.perf_counter()
    while iteration < args.iters:
        t0 = time.perf_counter()
        iteration += 1
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step,
            # the interleaved schedule takes one iterator per chunk (each chunk sees every microbatch)
            data_iterator=([microbatches(args, iteration) for _ in model] if len(model) > 1
                           else microbatches(args, iteration)),
            model=model,
            num_microbatches=args.num_microbatches,
            seq_length=SEQ_LENGTH,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=SEQ_LENGTH,
            forward_only=False,
        )
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=1)

        loss = None
        if last_stage:
            # Mean over this rank's microbatches, then over the data-parallel ranks of this stage.
            loss = torch.stack([r["lm loss"] for r in reduced]).mean()
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss = (loss / args.dp).item()
            if losses_out:
                losses_out.write(f"{iteration} {loss.hex()}\n")
        step_times.append(time.perf_counter() - t0)
        if rank == log_rank and not args.quiet:
            lr = optimizer.param_groups[0]["lr"]
            print(f"iter {iteration:5d}/{args.iters} | loss {loss:.6f} | lr {lr:.3e} | "
                  f"grad norm {grad_norm:.4f} | {1000 * step_times[-1]:.1f} ms"
                  + ("" if update_successful else " | skipped"), flush=True)

        # The optimizer and the scheduler have stepped and the loss is written, so a save here holds
        # the state after `iteration`, and a run loaded from it continues with iteration + 1.
        if args.save:
            easyckpt_megatron.save_checkpoint_if_needed(iteration, model, optimizer, scheduler)

        if args.step_sleep:
            time.sleep(args.step_sleep)

    if losses_out:
        losses_out.close()
    if rank == log_rank and step_times:
        steady = step_times[1:] or step_times
        print(f"trained iterations {start_iteration + 1}..{iteration} in {time.perf_counter() - t_loop:.2f} s "
              f"({1000 * sum(steady) / len(steady):.1f} ms/iteration after the first)", flush=True)
    return iteration


def dump_state(prefix: str, tag: str, model, optimizer, args: argparse.Namespace) -> None:
    """This rank's main-replica pieces of every tensor of the model and the optimizer, with their place in
    the global tensor (megatron-core's own sharding metadata): what a test compares across layouts. The
    DistributedOptimizer's pieces are this DP rank's flat ranges of each parameter, straight from the
    optimizer (not through a gather)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        apply_factories,
        is_main_replica,
    )

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    sd = {f"model{i}": chunk.module.sharded_state_dict(metadata={"dp_cp_group": group})
          for i, chunk in enumerate(model)}
    if not args.use_distributed_optimizer:
        # the keys Megatron-LM saves with: a ChainedOptimizer's states by parameter, no "chained_N." prefix
        sd["optimizer"] = optimizer.sharded_state_dict(sd, metadata={"dp_cp_group": group,
                                                                      "chained_optim_avoid_prefix": True})
    apply_factories(sd)
    out: dict = {}
    by_param = {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor):
            by_param[id(sh.data)] = sh
            if is_main_replica(sh.replica_id):
                sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
                out.setdefault(sh.key, []).append((tuple(sh.global_offset), sizes, tuple(sh.global_shape), 0,
                                                   sh.data.detach().reshape(-1).clone()))
    if args.use_distributed_optimizer:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            for ranges_by_dtype in opt.gbuf_ranges:
                for buckets in ranges_by_dtype.values():
                    for bucket in buckets:
                        for param, ranges in bucket["param_map"].items():
                            sh = by_param[id(param)]
                            if any(sh.replica_id[:-1]):    # a tied copy: the first stage's is dumped
                                continue
                            sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
                            states = opt._get_main_param_and_optimizer_states(param)
                            for k in ("param", "exp_avg", "exp_avg_sq"):
                                out.setdefault(f"optimizer.state.{k}.{sh.key}", []).append(
                                    (tuple(sh.global_offset), sizes, tuple(sh.global_shape), ranges["param"].start,
                                     states[k].detach().reshape(-1).clone()))
    torch.save(out, f"{prefix}.{tag}.rank{dist.get_rank()}.pt")


def main(argv=None) -> int:
    args = parse_args(argv)
    initialize(args)
    if dist.get_rank() == dist.get_world_size() - 1:
        print(f"world {dist.get_world_size()}: tp {args.tp} pp {args.pp} dp {args.dp} | micro batch "
              f"{args.micro_batch_size} x {args.num_microbatches} microbatches x dp = global batch "
              f"{args.global_batch_size} | distributed optimizer {args.use_distributed_optimizer} | "
              f"{'cpu/gloo' if args.cpu else 'cuda/nccl'}", flush=True)

    model, optimizer, scheduler = build_model_and_optimizer(args)
    start_iteration = 0

    # The loop continues with start_iteration + 1. The data need no state (they are a function of the
    # iteration), so iteration and RNG/model/optimizer/scheduler states are all a resume needs.
    if args.save:
        easyckpt_megatron.initialize_easyckpt(args.save_mem_interval, args.save_storage_interval,
                                              args.max_ckpt_num, args.ckpt_log, save_dir=args.save, args=args,
                                              agent_idle_timeout=args.agent_idle_timeout, local_dir=args.local_dir,
                                              exit_after_ondemand_checkpoint=not args.no_exit_on_sigterm,
                                              replication_factor=args.replication_factor)
        start_iteration, _ = easyckpt_megatron.load_checkpoint(model, optimizer, scheduler, concat=args.concat)
        if args.dump_state and start_iteration:
            dump_state(args.dump_state, "loaded", model, optimizer, args)
        if args.loss_file and parallel_state.is_pipeline_last_stage():
            with open(f"{args.loss_file}.rank{dist.get_rank()}", "a") as f:
                f.write(f"# start {start_iteration}\n")

    train(model, optimizer, scheduler, start_iteration, args)
    if args.dump_state:
        dump_state(args.dump_state, "final", model, optimizer, args)
    if args.save and not args.no_finalize:
        easyckpt_megatron.finalize_easyckpt()

    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # The guard matters: megatron's dist_checkpointing starts helper processes (a multiprocessing
    # Manager / spawn), which re-import this file.
    sys.exit(main())
