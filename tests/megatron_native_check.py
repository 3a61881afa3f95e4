"""Run under torchrun (DP=2, DistributedOptimizer) against a committed easyckpt Megatron checkpoint whose
DistributedOptimizer shards were converted with ``easyckpt convert megatron-distopt``.

Loads it twice into fresh megatron-core objects: (A) with easyckpt.megatron.load_checkpoint, (B) the way
Megatron-LM's torch-format loader does (torch.load of model_optim_rng.pt, model.load_state_dict,
optimizer.load_state_dict, optimizer.load_parameter_state(distrib_optim.pt)); checks the native keys
one by one against what megatron-core's objects produce, and that A and B hold identical states.
Prints NATIVE OK on success.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "megatron"))
import pretrain_gpt as P  # noqa: E402

import easyckpt.megatron as em  # noqa: E402
from easyckpt.megatron import state as S  # noqa: E402


def keys(tree, prefix=""):
    if isinstance(tree, dict):
        out = set()
        for k, v in tree.items():
            out |= keys(v, f"{prefix}/{k}")
        return out or {prefix}
    if isinstance(tree, (list, tuple)) and tree and isinstance(tree[0], dict):
        return set().union(*(keys(v, f"{prefix}/{i}") for i, v in enumerate(tree)))
    return {prefix}


def main():
    save = sys.argv[1]
    concat = "--concat" in sys.argv[2:]
    # pretrain_gpt.py arguments after "--" (MoE: --num-experts 2 --ep 2, a ChainedOptimizer)
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    args = P.parse_args(["--cpu", "--use-distributed-optimizer", "--quiet", *extra])
    P.initialize(args)
    (model_a,), opt_a, sched_a = P.build_model_and_optimizer(args)     # one chunk each (no --vp)
    (model_b,), opt_b, sched_b = P.build_model_and_optimizer(args)

    em.initialize_easyckpt(1, 1, None, save_dir=save, args=args, agent_idle_timeout=1)
    iteration, _ = em.load_checkpoint([model_a], opt_a, sched_a, concat=concat)
    assert iteration > 0, "nothing loaded"

    where = S.parallel()
    step_dir = os.path.join(save, f"iter_{iteration:07d}")
    native = torch.load(os.path.join(step_dir, where.model_file), weights_only=False)
    fresh_model = set(model_b.state_dict_for_save_checkpoint())
    assert set(native["model"]) == fresh_model, (set(native["model"]) ^ fresh_model)
    assert keys(native["optimizer"]) == keys(opt_a.state_dict()), keys(native["optimizer"]) ^ keys(opt_a.state_dict())
    assert set(native["opt_param_scheduler"]) == set(sched_b.state_dict())
    model_b.load_state_dict(native["model"], strict=True)
    inner_b = [o.optimizer for o in S.optimizers(opt_b)]
    with torch.no_grad():
        opt_b.load_state_dict(native["optimizer"])
        # megatron-core on CPU (torch Adam, no TE/Apex) keeps a per-parameter "step" that its dp_zero
        # loader does not expect: set it aside around load_parameter_state, as a CPU run of Megatron-LM
        # has to; the step count itself comes from the param groups of model_optim_rng.pt
        steps = {id(p): inner.state[p].pop("step") for inner in inner_b for g in inner.param_groups
                 for p in g["params"] if "step" in inner.state[p]}
        # a ChainedOptimizer's own load_parameter_state: each optimizer's DP rank 0 reads its entry
        opt_b.load_parameter_state(os.path.join(step_dir, where.mp_dir, "distrib_optim.pt"))
        for inner in inner_b:
            for g in inner.param_groups:
                for p in g["params"]:
                    if id(p) in steps:
                        inner.state[p]["step"] = steps[id(p)].clone()
    sched_b.load_state_dict(native["opt_param_scheduler"])

    for (na, pa), (nb, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    assert len(S.optimizers(opt_a)) == len(S.optimizers(opt_b)) == (2 if args.ep > 1 else 1)
    for da, db in zip(S.optimizers(opt_a), S.optimizers(opt_b)):
        for (_, mp_a, _), (_, mp_b, _) in zip(S._distopt_params(da), S._distopt_params(db)):
            ta, tb = da._get_main_param_and_optimizer_states(mp_a), db._get_main_param_and_optimizer_states(mp_b)
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ta[k], tb[k]), k
    em.finalize_easyckpt()
    print(f"rank {dist.get_rank()}: NATIVE OK at iteration {iteration}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
