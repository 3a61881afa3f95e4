"""Restore from memory against restore from storage, for one state, measured in one run.

    .venv/bin/python benchmarks/bench_restore.py [--hidden 400000] [--nproc 2]

Trains ``examples/pytorch/train.py`` (its state grows with --hidden: 16·hidden + 2·hidden weights,
AdamW's two moments) for 4 iterations under torchrun and exits without finalize, as a crash would:
the node agent persists the last step and keeps the snapshots. The relaunch loads from memory; after
the agent has left, a third launch loads the same step from storage. Prints both load times (rank 0,
as the trainer measured them around load_checkpoint) and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "pytorch" / "train.py"


def launch(args, save_dir: Path, loss: Path, log: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(TRAIN), "--save-dir", str(save_dir), "--iters", "4", "--storage-interval", "4",
           "--hidden", str(args.hidden), "--loss-file", str(loss), "--log-file", str(log),
           "--idle-timeout", "120", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def last_load(log: Path) -> dict:
    loads = [json.loads(line) for line in log.read_text().splitlines() if '"event": "load"' in line]
    return [e for e in loads if e.get("rank") == 0][-1]


def wait_agent_gone(save_dir: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from easyckpt.config import Config
    from easyckpt.engine.client import one_shot
    job = Config(save_dir=str(save_dir)).job_id
    while one_shot(job, {"op": "status"}) is not None:
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=400000)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        ckpt, loss, log = work / "ckpt", work / "loss", work / "audit.jsonl"
        launch(args, ckpt, loss, log, "--no-finalize")                # "crash": the agent keeps the snapshot
        launch(args, ckpt, loss, log, "--no-finalize", "--stop-at", "4")
        memory = last_load(log)
        # make the agent leave (it frees the slots): a restart on another node sees storage only
        from easyckpt.config import Config
        from easyckpt.engine.client import one_shot
        one_shot(Config(save_dir=str(ckpt)).job_id, {"op": "status"})
        pid = [json.loads(line) for line in log.read_text().splitlines() if '"agent_start"' in line][-1]["pid"]
        os.kill(pid, 15)
        wait_agent_gone(ckpt)
        launch(args, ckpt, loss, log)
        storage = last_load(log)
    assert memory["source"] == "memory" and storage["source"] == "storage", (memory, storage)
    mb = memory["bytes"] / 1e6
    print(f"{'restore of step ' + str(memory['step']) + f' ({mb:.1f} MB on rank 0)':<40} {'seconds':>9} {'GB/s':>7}")
    for name, e in (("from memory (agent alive)", memory), ("from storage (verified)", storage)):
        print(f"{name:<40} {e['seconds']:>9.4f} {e['bytes'] / max(e['seconds'], 1e-9) / 1e9:>7.2f}")
    print(f"storage / memory: {storage['seconds'] / max(memory['seconds'], 1e-9):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
