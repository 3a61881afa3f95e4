"""easyckpt's checkpoints in an object store against the raw client on the same server, in one run (ratios).

    scripts/s3-server.sh start /tmp/easyckpt-s3          # S3_STORE_BYTES=12884901888 for --hidden 1000000
    .venv/bin/python benchmarks/bench_s3_checkpoint.py --endpoint http://127.0.0.1:7480 --key K --secret S \
        [--hidden 1000000] [--dcp-python /path/to/venv-with-s3fs/bin/python]

The example training loop (examples/pytorch/train.py, one process, a model of Linear(16, H) + Linear(H, 1) with
AdamW: 3 x 4 x 18 H bytes of state) runs with its save dir in the store, then resumes from it; the audit log
gives what easyckpt did, and the same bytes are then moved by the raw client (storage/s3.py's S3Storage: the
same boto3 client, parts and threads) for the ratios of the issue's table:

  persist / raw upload       bytes/s of the agent's persist (slot -> store, checksummed, manifest and commit
                             excluded) over a multipart upload of the same bytes from memory, each a median, in
                             two conditions (goal >= 0.9 in each): while the training loop computes on the
                             machine's cores (the run's persists before its last; the raw uploads beside the same
                             loop saving to a local disk), and with the cores free (a run whose loop sleeps
                             --idle-sleep seconds after each step, so its agent persists alone; the raw uploads
                             alone)
  restore / raw ranged GET   bytes/s of the loader's restore from the store (checksummed, decoded), the median of
                             three resumes, over the raw client's parallel ranged GETs of the same objects (the
                             step's files), the median of three, each in a fresh process as a resume is
                             (goal >= 0.9)
  save -> durable            seconds from the save call until the step is committed in the store (the median of
                             the cores-free run's steps), over the same for torch DCP's async_save through its
                             fsspec writer (s3fs) to the same server (the median of three saves, nothing else
                             running), when --dcp-python names a Python with s3fs (it conflicts with boto3's
                             botocore in one venv) (goal <= 0.5); the median of the steps saved beside training
                             is printed too, and DCP again with s3fs's client set to send what easyckpt's sends
                             to this endpoint (storage/s3client.py: no CRC32; to a loopback endpoint the body's
                             hash not signed), where s3fs's defaults compute both
  stall per save             the training loop's stall per snapshot with the store as save dir over the same run
                             with a local disk (goal <= 1.1)
"""
from __future__ import annotations

import argparse
import contextlib
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
from typing import Any, Dict, Iterator, List, Tuple

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
# "matched": s3fs's client sends what easyckpt's does to this endpoint (no CRC32, the body's hash not signed)
matched = sys.argv[4:] == ["matched"]
extra = dict(config_kwargs={"request_checksum_calculation": "when_required",
                            "s3": {"payload_signing_enabled": False}}) if matched else {}
model = torch.nn.Sequential(torch.nn.Linear(16, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(4, 16)).sum().backward(); opt.step()
state = {"model": model.state_dict(), "optim": opt.state_dict()}
for i in range(3):     # three saves, each to a prefix of its own: their median is compared
    t = time.perf_counter()
    # 8 threads, as easyckpt's writer has 8 parts in flight
    fut = dcp.async_save(state, storage_writer=FsspecWriter(f"{url}/{i}", sync_files=False, thread_count=8,
                                                            endpoint_url=endpoint, **extra))
    fut.result()
    print(time.perf_counter() - t)
'''
# the raw client's parallel ranged GETs of a step's objects (each object in 32 MiB ranges, as the loader's, all at
# once through the store's pool), timed in a process of its own as a resume's reads are
RAW_GET = r'''
import sys, time
from concurrent.futures import ThreadPoolExecutor
from easyckpt.storage.s3 import S3Storage
step, endpoint = sys.argv[1], sys.argv[2]
s3 = S3Storage(endpoint_url=endpoint)
objects = s3.files(step)       # the client made and a connection open, as the loader's listing leaves them
t = time.perf_counter()
with ThreadPoolExecutor(len(objects)) as each:
    list(each.map(lambda o: s3.read_ranges(f"{step}/{o[0]}",
                                           [(p, min(32 << 20, o[1] - p)) for p in range(0, o[1], 32 << 20)]), objects))
print(time.perf_counter() - t, sum(n for _, n in objects))
'''


def events(log: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def train(save: str, local: Path, hidden: int, iters: int, env: Dict[str, str], *extra: str) -> List[Dict[str, Any]]:
    cmd = [sys.executable, str(EXAMPLE), "--save-dir", save, "--local-dir", str(local), "--hidden", str(hidden),
           "--iters", str(iters), "--storage-interval", "3", "--max-ckpt", "1", "--log-file", str(local / "a.log"),
           *extra]
    subprocess.run(cmd, check=True, env=env, timeout=1800, capture_output=True)
    # its agent leaves after the trainer (a due copy to the local tier may be its last work): the next run
    # starts when it has left, as a resume after a finished job does
    deadline = time.monotonic() + 300
    while True:
        log = events(local / "a.log")
        kinds = [e["event"] for e in log]
        if kinds.count("agent_start") <= kinds.count("agent_exit"):
            return log
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent of the run did not leave in 300 s (its audit log: {local / 'a.log'})")
        time.sleep(0.1)


def durable_seconds(log: List[Dict[str, Any]]) -> List[float]:
    """For each committed step of a run's audit log: seconds from the start of its snapshot to its commit."""
    asked = {e["step"]: e["time"] - e["seconds"] for e in log if e["event"] == "snapshot"}
    return [e["time"] - asked[e["step"]] for e in log if e["event"] == "commit" and e["step"] in asked]


def raw_uploads(s3: S3Storage, url: str, data: bytes) -> List[float]:
    """Seconds of three multipart uploads of ``data`` from memory by the raw client (its parts sent from ``data``,
    not copied, as the agent's are from the snapshot's slot)."""
    ups = []
    for i in range(3):
        t0 = time.perf_counter()
        w = s3.open_writer(f"{url}{i}")
        w.write_mapped(memoryview(data), 0, len(data))
        w.finish()
        w.sync()
        ups.append(time.perf_counter() - t0)
        s3.delete(f"{url}{i}")
    return ups


def raw_gets(step: str, env: Dict[str, str]) -> Tuple[List[float], int]:
    """Seconds of three reads of committed step ``step``'s objects by the raw client (RAW_GET), and their bytes."""
    runs = [subprocess.run([sys.executable, "-c", RAW_GET, step, env["AWS_ENDPOINT_URL"]], check=True, env=env,
                           capture_output=True, text=True, timeout=600).stdout.split() for _ in range(3)]
    return [float(r[0]) for r in runs], int(runs[0][1])


@contextlib.contextmanager
def training_beside(hidden: int, env: Dict[str, str], t: Path) -> Iterator[None]:
    """The example's training loop, as the store run has it (snapshots included) but with its save dir on the local
    disk and no persist, training for the duration of the block (from its first snapshot on), then stopped by
    SIGTERM. Its agent then persists the agreed step to the local disk: the block ends only when that agent has
    left (its agent_exit in the audit log), so that no write of its overlaps what is timed next (DCP's saves)."""
    log = t / "beside.log"
    cmd = [sys.executable, str(EXAMPLE), "--save-dir", str(t / "beside"), "--hidden", str(hidden), "--iters",
           "100000", "--storage-interval", "100000", "--max-ckpt", "1", "--log-file", str(log)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and '"snapshot"' in log.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the training loop beside the raw uploads did not start (exit {proc.poll()})")
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 300
        while log.exists() and '"agent_exit"' not in log.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent of the training loop beside the raw uploads did not leave in 300 s "
                                   f"(its audit log: {log})")
            time.sleep(0.1)


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
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--idle-sleep", type=float, default=2.0,
                   help="seconds the loop of the cores-free run sleeps after each step (longer than a persist)")
    p.add_argument("--dcp-python", default=None)
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args()
    creds = dict(AWS_ACCESS_KEY_ID=args.key, AWS_SECRET_ACCESS_KEY=args.secret, AWS_DEFAULT_REGION="us-east-1",
                 AWS_ENDPOINT_URL=args.endpoint)
    os.environ.update(creds)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    # the agent's part size (EASYCKPT_S3_PART_MIB)
    s3 = S3Storage(endpoint_url=args.endpoint, part_bytes=part_bytes())
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    s3.c.create_bucket(Bucket=bucket)
    rows: List[str] = []
    try:
        # DCP first, on the fresh server: later, the gateway is also busy freeing what the runs' pruning deleted
        # (its garbage collector), which slowed DCP's saves by up to half when they came last
        dcp_saves: List[float] = []
        for how in ("", "matched") if args.dcp_python else ():
            dcp_saves.append(statistics.median(map(float, subprocess.run(
                [args.dcp_python, "-c", DCP_SAVE, str(args.hidden), f"s3://{bucket}/dcp{how}", args.endpoint,
                 *how.split()], check=True, env=env, capture_output=True, text=True,
                timeout=1800).stdout.split()[-3:])))
            s3.delete(f"s3://{bucket}/dcp{how}")       # room in the store (memstore holds what it stores in RAM)
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            disk = train(str(t / "disk"), t / "disk-local", args.hidden, args.iters, env)
            store = train(f"s3://{bucket}/run", t / "s3-local", args.hidden, args.iters, env)
            # the same run with its loop asleep after each step: its agent persists with the cores free
            idle = train(f"s3://{bucket}/idle", t / "idle-local", args.hidden, args.iters, env, "--step-sleep",
                         str(args.idle_sleep))
            # three resumes, each from the step the one before committed (the same bytes each time)
            loads = []
            for more in (1, 2, 3):
                resumed = train(f"s3://{bucket}/run", t / f"s3-local{more}", args.hidden, args.iters + more, env)
                loads.append(next(e for e in resumed if e["event"] == "load" and e.get("source") == "storage"))
            # the raw reads: the objects of the step the last resume committed (the same files as those loaded)
            gets, got = raw_gets([e for e in resumed if e["event"] == "commit"][-1]["path"], env)
            busy = [e for e in store if e["event"] == "persist"][:-1]    # the last one is made at finalize
            alone = [e for e in idle if e["event"] == "persist"]
            nbytes = alone[-1]["bytes"]
            restore_bps = statistics.median(e["bytes"] / e["seconds"] for e in loads)
            data = os.urandom(nbytes)
            ups = raw_uploads(s3, f"s3://{bucket}/raw/blob", data)
            with training_beside(args.hidden, env, t):
                ups_busy = raw_uploads(s3, f"s3://{bucket}/raw/busy", data)
            raw_up, raw_busy = (nbytes / statistics.median(x) for x in (ups, ups_busy))
            raw_get = got / statistics.median(gets)
            rows.append(f"state per step: {nbytes / 1e6:.1f} MB (--hidden {args.hidden}), endpoint {args.endpoint}")
            for what, persists, raw in (("cores free", alone, raw_up), ("beside training", busy, raw_busy)):
                bps = statistics.median(e["bytes"] / e["seconds"] for e in persists)
                rows.append(f"persist / raw upload, {what:15} {bps / raw:5.2f}   ({bps / 1e6:.0f} vs {raw / 1e6:.0f} "
                            f"MB/s, medians of {len(persists)} and {len(ups)})   goal >= 0.9")
            rows.append(f"restore / raw ranged GET    {restore_bps / raw_get:5.2f}   ({restore_bps / 1e6:.0f} vs "
                        f"{raw_get / 1e6:.0f} MB/s, medians of {len(loads)} and {len(gets)})   goal >= 0.9")
            stall_s3 = statistics.median(e["seconds"] for e in store if e["event"] == "snapshot")
            stall_disk = statistics.median(e["seconds"] for e in disk if e["event"] == "snapshot")
            durable, busy_durable = (statistics.median(durable_seconds(run)) for run in (idle, store))
            line = (f"save -> durable             {durable:5.2f} s (snapshot to commit, cores free; "
                    f"{busy_durable:.2f} s beside training)")
            if dcp_saves:
                dcp, matched = dcp_saves
                line += (f" / DCP async_save via s3fs {dcp:.2f} s = {durable / dcp:.2f}   goal <= 0.5   (DCP with "
                         f"s3fs sending what easyckpt sends here, no CRC32 and the body's hash not signed: "
                         f"{matched:.2f} s = {durable / matched:.2f})")
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
