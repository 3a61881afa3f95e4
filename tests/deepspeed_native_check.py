"""Run under torchrun: DeepSpeed's own ``engine.load_checkpoint(save_dir)`` reads easyckpt's newest
checkpoint (through ``latest``), and restores exactly what easyckpt's loader restores.

    torchrun --nproc_per_node 2 tests/deepspeed_native_check.py SAVE_DIR ZERO
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "deepspeed"))
import train  # noqa: E402

import easyckpt.deepspeed as eds  # noqa: E402


def tensors(tree, path=""):
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from tensors(v, f"{path}/{i}")


def main() -> int:
    save_dir, zero = sys.argv[1], sys.argv[2]
    args = train.parse(["--save-dir", save_dir, "--zero", zero])
    native, ours = train.build(args), train.build(args)
    path, client = native.load_checkpoint(save_dir)            # DeepSpeed alone, via `latest`
    assert path is not None, f"DeepSpeed found no checkpoint in {save_dir}"
    eds.initialize_easyckpt(save_dir, max_ckpt_num=None)
    our_path, our_client = eds.load_checkpoint(ours)
    assert native.global_steps == ours.global_steps > 0, (native.global_steps, ours.global_steps)
    assert client["data_pos"] == our_client["data_pos"] == native.global_steps
    a, b = dict(tensors(native.optimizer.state_dict())), dict(tensors(ours.optimizer.state_dict()))
    assert a.keys() == b.keys() and a, "optimizer state trees differ"
    for k in a:
        assert torch.equal(a[k], b[k]), f"optimizer state {k} differs"
    for (n, p), (_, q) in zip(native.module.named_parameters(), ours.module.named_parameters()):
        assert torch.equal(p.data, q.data), f"parameter {n} differs"
    assert native.lr_scheduler.state_dict() == ours.lr_scheduler.state_dict()
    eds.finalize_easyckpt()
    print(f"rank {torch.distributed.get_rank()}: step {native.global_steps}: {len(a)} optimizer tensors equal")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
