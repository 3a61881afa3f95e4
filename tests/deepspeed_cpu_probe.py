"""DeepSpeed's start on a CPU with a build lock left by an interrupted op build (tests/test_deepspeed.py).

    python deepspeed_cpu_probe.py bare|switch SECONDS

Run with TORCH_EXTENSIONS_DIR holding ``deepspeed_shm_comm/lock`` and ``fused_adam/lock`` that no process
holds. ``bare``: DeepSpeed alone; ``deepspeed.init_distributed`` waits on the shm op's lock, and after
SECONDS the stacks are dumped and the process exits (so the test sees where it waits, never for ever).
``switch``: ``easyckpt.deepspeed.cpu.deepspeed_on_cpu()`` first; init_distributed must return, then loading the
fused Adam op must fail with EasyCkptError naming its lock. A single process, its own rendezvous.
"""
from __future__ import annotations

import faulthandler
import os
import sys


def main() -> int:
    mode, seconds = sys.argv[1], float(sys.argv[2])
    faulthandler.dump_traceback_later(seconds, exit=True)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", sys.argv[3] if len(sys.argv) > 3 else "29533")
    if mode == "switch":
        from easyckpt.deepspeed.cpu import deepspeed_on_cpu
        assert deepspeed_on_cpu() is True
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    print("init_distributed returned", flush=True)
    from deepspeed.ops.op_builder import FusedAdamBuilder

    from easyckpt.errors import EasyCkptError
    try:
        FusedAdamBuilder().load()
    except EasyCkptError as exc:
        print(f"EasyCkptError: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
