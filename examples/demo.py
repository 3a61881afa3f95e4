"""The easyckpt demo: train under torchrun with 2 ranks, kill -9 every trainer mid-run, relaunch.

It prints how many iterations the crash cost with easyckpt (at most save_mem_interval) against what a
classic every-N-iterations torch.save would have lost, and the training stall per checkpoint.

    .venv/bin/python examples/demo.py [--iters 60] [--mem-interval 1] [--storage-interval 10]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "pytorch" / "train.py"


def launch(args, save_dir: Path, loss: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN),
           "--save-dir", str(save_dir), "--iters", str(args.iters), "--mem-interval", str(args.mem_interval),
           "--storage-interval", str(args.storage_interval), "--hidden", str(args.hidden),
           "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", str(args.step_sleep)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def read_losses(loss: Path):
    out, starts = {}, []
    if Path(f"{loss}.rank0").exists():
        for line in Path(f"{loss}.rank0").read_text().splitlines():
            if line.startswith("# start"):
                starts.append(int(line.split()[2]))
            elif line:
                it, val = line.split()
                out[int(it)] = float.fromhex(val)
    return out, starts


def kill_trainers(proc: subprocess.Popen) -> None:
    """kill -9 torchrun and its workers (they live in sessions of their own); the node agent, a separate
    process like a node-level daemon, is not touched."""
    victims, todo = [], [proc.pid]
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            agent = b"easyckpt.agent" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if not agent:
            children.setdefault(ppid, []).append(int(pid))
    while todo:
        pid = todo.pop()
        victims.append(pid)
        todo.extend(children.get(pid, []))
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--mem-interval", type=int, default=1)
    p.add_argument("--storage-interval", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    rnd = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="easyckpt-demo-"))
    save_dir, loss, log = work / "ckpt", work / "loss", work / "audit.jsonl"
    try:
        print(f"training a {args.hidden}-wide MLP on 2 ranks (torchrun, gloo) for {args.iters} iterations; "
              f"snapshot every {args.mem_interval}, persist every {args.storage_interval}")
        ref = launch(args, work / "ref-ckpt", work / "ref-loss", work / "ref-audit.jsonl")
        if ref.wait(timeout=600) != 0:
            raise SystemExit("the uninterrupted reference run failed")
        reference, _ = read_losses(work / "ref-loss")

        kill_at = rnd.randint(args.iters // 4, 3 * args.iters // 4)
        run = launch(args, save_dir, loss, log)
        deadline = time.monotonic() + 600
        while max(read_losses(loss)[0], default=0) < kill_at:
            if run.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the training ended before the planned kill")
            time.sleep(0.005)
        kill_trainers(run)
        reached = max(read_losses(loss)[0])
        print(f"kill -9 of every trainer after iteration {reached}")
        run = launch(args, save_dir, loss, log)
        if run.wait(timeout=600) != 0:
            raise SystemExit("the resumed run failed")
        losses, starts = read_losses(loss)
        resumed = starts[-1]
        events = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
        source = next(e["source"] for e in reversed(events) if e["event"] == "load")
        stalls = sorted(e["seconds"] for e in events if e["event"] == "snapshot")
        nbytes = max(e["bytes"] for e in events if e["event"] == "snapshot")
        classic = reached - (reached // args.storage_interval) * args.storage_interval
        same = all(losses[i] == reference[i] for i in reference)
        print(f"resumed from iteration {resumed} ({source})")
        print(f"iterations lost with easyckpt:                     {reached - resumed}  "
              f"(at most save_mem_interval={args.mem_interval})")
        print(f"iterations a torch.save every {args.storage_interval} would have lost: {classic}")
        print(f"stall per checkpoint: median {stalls[len(stalls) // 2] * 1e3:.2f} ms for {nbytes / 1e6:.1f} MB "
              f"per rank ({len(stalls)} snapshots)")
        print(f"losses after the resume equal the uninterrupted run: {'yes' if same else 'NO'}")
        return 0 if same and reached - resumed <= args.mem_interval else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
