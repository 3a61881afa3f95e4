"""Run under torchrun: train examples/megatron/pretrain_gpt.py's model WITHOUT easyckpt for ``--iters``
iterations and, after iteration SAVE_AT, write the checkpoint the way Megatron-LM's own ``save_checkpoint``
does with ``--ckpt-format torch`` (megatron/training/checkpointing.py, core_v0.16): on every
expert-data-parallel rank 0, ``torch.save`` of generate_state_dict's keys to
``iter_{N:07d}/mp_rank_TT[_PPP]/model_optim_rng.pt``; with the DistributedOptimizer,
``optimizer.save_parameter_state(.../distrib_optim.pt)``; a barrier, then rank 0 writes
``latest_checkpointed_iteration.txt``. With ``--ckpt-format torch_dist``: megatron.core.dist_checkpointing.save
of the sharded state dict, the DistributedOptimizer ``dp_reshardable`` (Megatron-LM's default sharding).
megatron.training itself is not part of the megatron-core wheel, so
its few lines are repeated here with megatron-core's own objects. The run's own losses (--loss-file) are
those of a run that never stopped.

    torchrun ... tests/megatron_native_save.py SAVE_DIR SAVE_AT -- <pretrain_gpt.py arguments>
"""
import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "megatron"))
import pretrain_gpt as P  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402

from easyckpt.megatron import state as S  # noqa: E402  (rng_capture: Megatron-LM's get_rng_state keys


def save_torch_dist(step_dir, iteration, model, optimizer, scheduler, args):
    """``--ckpt-format torch_dist`` as Megatron-LM saves it: generate_state_dict's sharded form, the
    DistributedOptimizer in Megatron-LM's default ``dp_reshardable`` sharding (``fully_reshardable`` with
    NATIVE_OPTIM_SHARDING=fully_reshardable, as ``--dist-ckpt-optim-fully-reshardable`` saves), and the
    options recorded as the checkpoint's content metadata (common.pt)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    where = S.parallel()
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        meta["distrib_optim_sharding_type"] = os.environ.get("NATIVE_OPTIM_SHARDING", "dp_reshardable")
    with_group = dict(meta, dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True))
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": unwrap_model(model)[0].sharded_state_dict(metadata=with_group)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=with_group)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = ShardedObject("rng_state", [S.rng_capture()], (where.pp_size, where.tp_size),
                                       (where.pp, where.tp), replica_id=where.dp)
    state["num_floating_point_operations_so_far"] = 1234.0
    if dist.get_rank() == 0:
        os.makedirs(step_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, step_dir, content_metadata=meta)


def save(save_dir, iteration, model, optimizer, scheduler, args):
    where = S.parallel()
    step_dir = os.path.join(save_dir, f"iter_{iteration:07d}")
    if getattr(args, "ckpt_format", "torch") == "torch_dist":
        save_torch_dist(step_dir, iteration, model, optimizer, scheduler, args)
        _tracker(save_dir, iteration)
        return
    if args.use_distributed_optimizer:
        path = os.path.join(step_dir, where.mp_dir, "distrib_optim.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        optimizer.save_parameter_state(path)
    if mpu.get_data_parallel_rank() == 0:
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                 "model": model[0].state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                 "opt_param_scheduler": scheduler.state_dict(), "rng_state": [S.rng_capture()],
                 "num_floating_point_operations_so_far": 1234.0}
        path = os.path.join(step_dir, where.model_file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    _tracker(save_dir, iteration)


def _tracker(save_dir, iteration):
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def main():
    save_dir, save_at = sys.argv[1], int(sys.argv[2])
    args = P.parse_args(sys.argv[4:])
    assert args.save is None, "this script trains without easyckpt"
    P.initialize(args)
    model, optimizer, scheduler = P.build_model_and_optimizer(args)

    # the loop's checkpoint hook (called after each iteration when args.save is set) saves as Megatron does
    def save_checkpoint_if_needed(iteration, model, optimizer, scheduler):
        if iteration == save_at:
            save(save_dir, iteration, model, optimizer, scheduler, args)

    P.easyckpt_megatron = types.SimpleNamespace(save_checkpoint_if_needed=save_checkpoint_if_needed)
    args.save = save_dir
    P.train(model, optimizer, scheduler, 0, args)
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
