"""easyckpt's checkpoints in an object store against the raw client on the same server, in one run (ratios).

    scripts/s3-server.sh start /tmp/easyckpt-s3          # S3_STORE_BYTES=12884901888 for --hidden 1000000
    .venv/bin/python benchmarks/bench_s3_checkpoint.py --endpoint http://127.0.0.1:7480 --key K --secret S \
        [--hidden 1000000] [--dcp-python /path/to/venv-with-s3fs/bin/python]

The example training loop (examples/pytorch/train.py, one process, a model of Linear(16, H) + Linear(H, 1) with
AdamW: 3 x 4 x 18 H bytes of state) runs with its save dir in the store, then resumes from it; the audit log
gives what easyckpt did, and the same bytes are then moved by the raw client (storage/s3.py's S3Storage: the
same boto3 client, parts and threads) for the ratios of the issue's table:

  persist / raw upload       bytes/s of the agent's persist (slot -> store, checksummed, manifest and commit
                             excluded; the median of the run's persists, most of them while the loop trains)
                             over a multipart upload of the same bytes from memory (goal >= 0.9); and the
                             last persist's, made at finalize when the loop no longer competes for the cores
  restore / raw ranged GET   bytes/s of the loader's restore from the store (checksummed, into the live
                             tensors) over parallel ranged GETs of the same bytes (goal >= 0.9)
  save -> durable            seconds from the save call until the step is committed in the store, over the
                             same for torch DCP's async_save through its fsspec writer (s3fs) to the same server,
                             when --dcp-python names a Python with s3fs (it conflicts with boto3's botocore in
                             one venv) (goal <= 0.5)
  stall per save             the training loop's stall per snapshot with the store as save dir over the same run
                             with a local disk (goal <= 1.1)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from easyckpt._testing.buckets import drop_bucket  # noqa: E402
from easyckpt.storage.resolve import part_bytes  # noqa: E402
from easyckpt.storage.s3 import S3Storage  # noqa: E402

EXAMPLE = ROOT / "examples" / "pytorch" / "train.py"
DCP_SAVE = r'''
import sys, time, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
h, url, endpoint = int(sys.argv[1]), sys.argv[2], sys.argv[3]
model = torch.nn.Sequential(torch.nn.Linear(16, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(4, 16)).sum().backward(); opt.step()
state = {"model": model.state_dict(), "optim": opt.state_dict()}
t = time.perf_counter()
# 8 threads, as easyckpt's writer has 8 parts in flight
fut = dcp.async_save(state, storage_writer=FsspecWriter(url, sync_files=False, thread_count=8, endpoint_url=endpoint))
fut.result()
print(time.perf_counter() - t)
'''


def events(log: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def train(save: str, local: Path, hidden: int, iters: int, env: Dict[str, str], *extra: str) -> List[Dict[str, Any]]:
    cmd = [sys.executable, str(EXAMPLE), "--save-dir", save, "--local-dir", str(local), "--hidden", str(hidden),
           "--iters", str(iters), "--storage-interval", "3", "--max-ckpt", "1", "--log-file", str(local / "a.log"),
           *extra]
    subprocess.run(cmd, check=True, env=env, timeout=1800, capture_output=True)
    return events(local / "a.log")


def local_tier_row(bucket: str, t: Path, args: argparse.Namespace, env: Dict[str, str]) -> str:
    """The same step resumed from the local tier, then (its tier removed) from the store: the loader's seconds."""
    url, local = f"s3://{bucket}/tier", t / "tier-local"
    train(url, local, args.hidden, args.iters, env, "--local-interval", "3")
    # resumed at its last step (nothing left to train): from the tier, then with the tier gone from the store
    tier = next(e for e in train(url, local, args.hidden, args.iters, env)[::-1] if e["event"] == "load")
    for d in local.glob(".easyckpt-local-*"):
        shutil.rmtree(d)
    store = next(e for e in train(url, local, args.hidden, args.iters, env)[::-1] if e["event"] == "load")
    if tier.get("source") != "local" or store.get("source") != "storage" or tier["step"] != store["step"]:
        return f"restore local tier / store    not measured (loaded {tier.get('source')} then {store.get('source')})"
    return (f"restore local tier / store  {tier['seconds'] / store['seconds']:5.2f}   ({tier['seconds']:.2f} vs "
            f"{store['seconds']:.2f} s for step {tier['step']}, {tier['bytes'] / 1e6:.0f} MB)   measured")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--hidden", type=int, default=1_000_000)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--dcp-python", default=None)
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args()
    creds = dict(AWS_ACCESS_KEY_ID=args.key, AWS_SECRET_ACCESS_KEY=args.secret, AWS_DEFAULT_REGION="us-east-1",
                 AWS_ENDPOINT_URL=args.endpoint)
    os.environ.update(creds)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    s3 = S3Storage(endpoint_url=args.endpoint, part_bytes=part_bytes())     # the agent's part size (EASYCKPT_S3_PART_MIB)
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    s3.c.create_bucket(Bucket=bucket)
    rows: List[str] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            disk = train(str(t / "disk"), t / "disk-local", args.hidden, args.iters, env)
            store = train(f"s3://{bucket}/run", t / "s3-local", args.hidden, args.iters, env)
            resumed = train(f"s3://{bucket}/run", t / "s3-local2", args.hidden, args.iters + 1, env)
            persists = [e for e in store if e["event"] == "persist"]
            nbytes = persists[-1]["bytes"]
            persist_bps = statistics.median(e["bytes"] / e["seconds"] for e in persists)
            load = next(e for e in resumed if e["event"] == "load" and e.get("source") == "storage")
            restore_bps = load["bytes"] / load["seconds"]
            # the raw client, the same bytes: one multipart upload from memory, then parallel ranged GETs
            data = os.urandom(nbytes)
            url = f"s3://{bucket}/raw/blob"
            ups, gets = [], []
            for i in range(3):
                t0 = time.perf_counter()
                w = s3.open_writer(f"{url}{i}")
                w.write(data)
                w.finish()
                w.sync()
                ups.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                piece = 32 << 20
                s3.read_ranges(f"{url}{i}", [(o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)])
                gets.append(time.perf_counter() - t0)
                s3.delete(f"{url}{i}")
            raw_up, raw_get = nbytes / min(ups), nbytes / min(gets)
            stall_s3 = statistics.median(e["seconds"] for e in store if e["event"] == "snapshot")
            stall_disk = statistics.median(e["seconds"] for e in disk if e["event"] == "snapshot")
            asked = {e["step"]: e["time"] - e["seconds"] for e in store if e["event"] == "snapshot"}
            durable = [e["time"] - asked[e["step"]] for e in store if e["event"] == "commit" and e["step"] in asked]
            rows.append(f"state per step: {nbytes / 1e6:.1f} MB (--hidden {args.hidden}), endpoint {args.endpoint}")
            rows.append(f"persist / raw upload        {persist_bps / raw_up:5.2f}   ({persist_bps / 1e6:.0f} vs "
                        f"{raw_up / 1e6:.0f} MB/s)   goal >= 0.9")
            # the last step is persisted at finalize, when the loop no longer trains: the agent and the server then
            # have the machine's cores to themselves, as the raw upload has (the median above shares them with
            # a training loop that computes on the same 2 cores)
            idle_bps = persists[-1]["bytes"] / persists[-1]["seconds"]
            rows.append(f"  the last persist alone    {idle_bps / raw_up:5.2f}   ({idle_bps / 1e6:.0f} vs "
                        f"{raw_up / 1e6:.0f} MB/s, step {persists[-1]['step']}, after the loop ended)   measured")
            rows.append(f"restore / raw ranged GET    {restore_bps / raw_get:5.2f}   ({restore_bps / 1e6:.0f} vs "
                        f"{raw_get / 1e6:.0f} MB/s)   goal >= 0.9")
            line = f"save -> durable             {statistics.median(durable):5.2f} s (snapshot to commit)"
            if args.dcp_python:
                dcp = float(subprocess.run([args.dcp_python, "-c", DCP_SAVE, str(args.hidden), f"s3://{bucket}/dcp",
                                            args.endpoint],
                                           check=True, env=env, capture_output=True, text=True, timeout=1800
                                           ).stdout.split()[-1])
                line += f" / DCP async_save via s3fs {dcp:.2f} s = {statistics.median(durable) / dcp:.2f}   goal <= 0.5"
            else:
                line += "   (no --dcp-python: the DCP comparison was not run)"
            rows.append(line)
            rows.append(f"stall per save, store/disk  {stall_s3 / stall_disk:5.2f}   ({stall_s3 * 1e3:.1f} vs "
                        f"{stall_disk * 1e3:.1f} ms per snapshot)   goal <= 1.1")
            rows.append(local_tier_row(bucket, t, args, env))
    finally:
        drop_bucket(s3, bucket)
    print("\n".join(rows))
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
