"""Peer replicas (issue 19, section 5) measured in one run: ratios against the machine and against storage.

    sudo .venv/bin/python benchmarks/bench_replicas.py [--quick] [--trials 20] [--slot-mb 512] [--hidden 200000]

throughput  one rank's slot of --slot-mb MB (shm-backed, random bytes) sent by the real code path
            (Replicas._replicate, with its handshake, CRC, seqlock trailer and pinning, to a PeerServer on
            127.0.0.1, replica_bandwidth=0) against a raw sendall / recv_into of as many bytes between two
            shm-backed buffers over loopback; in process, no namespaces; best of --repeats each
recovery    2 simulated nodes x 1 rank (tests/nodes.py), a state of --hidden (examples/pytorch/train.py's MLP:
            216 bytes per unit of width with AdamW), node 1 lost and replaced, the job relaunched: rank 1's
            "load" seconds and the seconds from the relaunch until both ranks trained a new iteration,
            from a peer's memory (replication_factor 2) against from storage (replication_factor 1, the
            save dir's pages evicted from the page cache first)
step time   the same job with save_mem_interval=1 and no step sleep, replication on (factor 2) against off
            (factor 1), in alternating runs; the step time is the spacing of each rank's snapshot events
lost        --trials seeded trials (random.Random(seed)): node 1 killed after a random delay, replaced, the job
            relaunched; lost = rank 1's last iteration before the kill - the step the job resumed from;
            save_mem_interval=2, a storage interval no trial reaches (only memory and peers can serve)

Needs root (Linux namespaces, like the multi-node tests). Prints every figure and the ratios the goals are
stated in with PASS/MISS, and writes the raw figures as JSON (--out). Everything runs under a fresh
temporary directory; every namespace is removed and the in-process slots (a private directory under
/dev/shm) are deleted at the end, also on failure. MB means 10**6 bytes.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import nodes  # noqa: E402  (tests/nodes.py: simulated nodes)
from common import evict  # noqa: E402
from harness import committed_steps, events, last_iteration, starts  # noqa: E402

from easyckpt.agent.peerserve import PeerServer  # noqa: E402
from easyckpt.agent.replicas import Replicas, Table  # noqa: E402
from easyckpt.config import Config  # noqa: E402
from easyckpt.formats.manifest import ALGO, Hasher  # noqa: E402
from easyckpt.ipc import shm  # noqa: E402
from easyckpt.storage.auditlog import AuditLog  # noqa: E402

MB = 10**6
# this run's namespaces and files under names of its own: the multi-node tests check that none of theirs
# (eckn-*) and no easyckpt-* segment outlive them, and may run on the same machine meanwhile
nodes.PREFIX = "eckb"
SECRET = "b3" * 32
STATE_PER_HIDDEN = 216          # bytes of train.py's state per unit of --hidden: (16h + h + h + 1) floats x 3 (AdamW)
TIMEOUT = 240                   # any one wait on a simulated job

GOALS = [  # (key, text, test, target)
    ("throughput", "replication / raw loopback TCP throughput", lambda v: v >= 0.7, ">= 0.7"),
    ("recovery_load", "recovery, rank 1's load: peer / storage (cold)", lambda v: v <= 0.2, "<= 0.2"),
    ("recovery_total", "recovery, relaunch -> training: peer / storage", lambda v: v <= 0.2, "<= 0.2"),
    ("step_time", "step time, replication on / off", lambda v: v <= 1.03, "<= 1.03"),
    ("step_time_later", "  the same, last 2/3 of each run (cadence learnt)", lambda v: v <= 1.03, "<= 1.03"),
    ("lost_max", "iterations lost, worst trial with a replica", lambda v: v <= 2, "<= 2 (save_mem_interval)"),
]


def say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


# ---- 1. throughput, in process --------------------------------------------------------------------

def _fill(mm: mmap.mmap, start: int, nbytes: int) -> None:
    """Random bytes (every page really backed, nothing a compressor could gain on), 64 MiB drawn once."""
    block = np.random.default_rng(0).integers(0, 256, min(nbytes, 64 << 20), dtype=np.uint8).tobytes()
    pos = 0
    while pos < nbytes:
        n = min(len(block), nbytes - pos)
        mm[start + pos:start + pos + n] = block[:n]
        pos += n


def _publish(slot: shm.Slot, nbytes: int, step: int, generation: int) -> None:
    """Rank 1's slot 0 as its trainer publishes it (tests/test_replicas.py's write_slot), holding one F32
    tensor of ``nbytes``; only the header and metadata change from one step to the next."""
    b = shm.HEADER_BYTES
    slot.begin_write(generation)
    files = [{"relpath": "model.safetensors", "persist": True, "fmt": "safetensors", "start": b, "end": b + nbytes,
              "tensors": [["w", "F32", [nbytes // 4], b, b + nbytes]]}]
    meta = json.dumps({"files": files, "step": step, "info": {},
                       "skeletons": {"model.safetensors": {"w": {"__t": "w"}}}}).encode()
    slot.publish(shm.Header(state=shm.COMPLETE, step=step, generation=generation, meta_len=len(meta),
                            meta_capacity=slot.size - b - nbytes, data_capacity=nbytes, persist=True, meta_crc=0,
                            pid=0, rank=1, world_size=2), meta)


def _raw_loopback(src: memoryview, dst: memoryview) -> float:
    """Seconds to move ``src`` into ``dst`` over a fresh loopback TCP connection: one sendall, recv_into
    until full, the receiver in a thread (both calls release the GIL)."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    got = [0]

    def receive() -> None:
        conn, _ = lsock.accept()
        with conn:
            pos = 0
            while pos < len(dst):
                n = conn.recv_into(dst[pos:])
                if not n:
                    break
                pos += n
            got[0] = pos
    t = threading.Thread(target=receive)
    t0 = time.perf_counter()
    t.start()
    with socket.create_connection(lsock.getsockname(), timeout=60) as s:
        s.sendall(src)
    t.join(60)
    sec = time.perf_counter() - t0
    lsock.close()
    assert got[0] == len(dst), f"raw loopback moved {got[0]} of {len(dst)} bytes"
    return sec


def measure_throughput(nbytes: int, repeats: int, work: str) -> Dict[str, Any]:
    nbytes -= nbytes % 4
    shm_dir = tempfile.mkdtemp(prefix="ezbench-replicas-", dir="/dev/shm")
    saved, shm.SHM_DIR = shm.SHM_DIR, shm_dir
    cfg = Config(save_dir=os.path.join(work, "throughput"), replica_bandwidth=0)
    refused: List[str] = []
    log = AuditLog(None, "agent")
    server = reps = None
    slot = None
    raw: List[mmap.mmap] = []
    out: Dict[str, Any] = {"bytes": nbytes, "replicate": [], "raw": []}
    try:
        server = PeerServer(cfg.job_id, "127.0.0.1", log, refused.append)
        server.secret = SECRET
        reps = Replicas(cfg, log)
        reps.table = Table(node=1, nnodes=2, ranks_per_node=1, secret=SECRET,
                           endpoints={0: ("127.0.0.1", server.port), 1: ("127.0.0.1", 9)}, factor=2, jump=1)
        slot = shm.Slot.create_or_grow(shm.slot_path(cfg.job_id, 1, 0), shm.HEADER_BYTES + nbytes + 4096)
        assert slot.mm is not None
        _fill(slot.mm, shm.HEADER_BYTES, nbytes)
        for name in ("raw-src", "raw-dst"):      # the raw floor's buffers: shm files too, mapped and warm
            fd = os.open(os.path.join(shm_dir, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
                raw.append(mmap.mmap(fd, nbytes))
            finally:
                os.close(fd)
            _fill(raw[-1], 0, nbytes)
        src, dst = memoryview(raw[0]), memoryview(raw[1])
        for rep in range(repeats):
            step = 10 * (rep + 1)
            _publish(slot, nbytes, step, generation=rep + 1)
            t0 = time.perf_counter()
            reps._force = True     # as a drain does: whatever the cadence says (no training runs here)
            reps._replicate()
            sec = time.perf_counter() - t0
            sent = reps.sent.get(0, {})
            assert sent.get("step") == step and sent.get("bytes", 0) >= nbytes, (sent, refused, list(reps.errors))
            out["replicate"].append({"seconds": sec, "bytes": sent["bytes"]})
            out["raw"].append({"seconds": _raw_loopback(src, dst), "bytes": nbytes})
        # what the wire's checksum alone costs (the manifest's Hasher, once per side)
        out["checksum"] = []
        for rep in range(repeats):
            t0 = time.perf_counter()
            Hasher().update(src)
            out["checksum"].append({"seconds": time.perf_counter() - t0, "bytes": nbytes})
        src.release()
        dst.release()
    finally:
        if reps is not None:
            reps.close()
        if server is not None:
            server.close()
        if slot is not None:
            slot.close()
        for m in raw:
            try:
                m.close()
            except BufferError:
                pass      # a failed run left a view on it: it goes with the process; the files go now
        shm.SHM_DIR = saved
        shutil.rmtree(shm_dir, ignore_errors=True)
    best = lambda xs: max(x["bytes"] / x["seconds"] for x in xs)
    out["replicate_Bps"], out["raw_Bps"] = best(out["replicate"]), best(out["raw"])
    out["checksum_Bps"] = best(out["checksum"])
    out["ratio"] = out["replicate_Bps"] / out["raw_Bps"]
    return out


# ---- simulated jobs --------------------------------------------------------------------------------

@contextmanager
def cluster(n: int, workdir: Path) -> Iterator[nodes.Cluster]:
    workdir.mkdir(parents=True, exist_ok=True)
    c = nodes.Cluster(n, workdir)
    try:
        yield c
    finally:
        c.close()


def job_args(loss: Path, log: Path, hidden: int, iters: int, mem: int, storage: int, factor: int,
             step_sleep: float) -> Tuple[str, ...]:
    return ("--iters", str(iters), "--hidden", str(hidden), "--mem-interval", str(mem), "--storage-interval",
            str(storage), "--max-ckpt", "2", "--loss-file", str(loss), "--log-file", str(log), "--step-sleep",
            str(step_sleep), "--idle-timeout", "60", "--replication-factor", str(factor))


def wait_until(what: str, cond, timeout: float, procs: List[subprocess.Popen], interval: float = 0.01) -> float:
    """Poll ``cond`` until true; the wall time it became so. Fails when a watched process exits first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead and not cond():
            raise AssertionError(f"{what}: a process exited ({dead}) first")
        time.sleep(interval)
    return time.time()


def newest_replica(log: Path, host: str) -> Optional[int]:
    sent = [e["step"] for e in events(log) if e["event"] == "replica_sent" and e["host"] == host]
    return max(sent) if sent else None


def new_iteration(loss: Path, rank: int) -> bool:
    """The last start of ``rank`` is followed by an iteration it trained."""
    path = Path(f"{loss}.rank{rank}")
    if not path.exists():
        return False
    lines = path.read_text().splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("# start")]
    return len(marks) >= 2 and any(line and not line.startswith("#") for line in lines[marks[-1] + 1:])


def lose_and_replace(c: nodes.Cluster, runs: List[nodes.NodeRun], ckpt: Path, args: Tuple[str, ...],
                     loss: Path, before_relaunch=None) -> Dict[str, Any]:
    """Node 1 killed, node 0's trainer failed, the job relaunched on node 0 and a replacement node 1; the
    timings of the relaunch. Both relaunched jobs run to their end."""
    killed_at = time.time()
    runs[1].kill()
    reached = last_iteration(loss, 1)
    rc0 = runs[0].wait_command(120)
    assert rc0 != 0, "node 0's trainer should fail when node 1 is lost"
    if before_relaunch:
        before_relaunch()
    node0, node1 = c.train_cmds(ckpt, 1, *args)
    t0 = time.time()
    again = [runs[0].enter(node0, c.log("replaced", 0)), c.nodes[1].launch(node1, c.log("replaced", 1)).proc]
    try:
        trained = wait_until("both ranks training again", lambda: all(new_iteration(loss, r) for r in (0, 1)),
                             TIMEOUT, again, interval=0.005)
        rcs = [p.wait(timeout=TIMEOUT) for p in again]
    finally:
        for p in again:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert rcs == [0, 0], "\n".join(c.log("replaced", i).read_text()[-2500:] for i in range(2))
    load_s = [float(l.split()[4]) for l in Path(f"{loss}.rank1").read_text().splitlines() if l.startswith("# start")]
    return {"killed_at": killed_at, "reached": reached, "resumed": starts(loss, 1)[-1], "relaunch_to_training": trained - t0,
            "trainer_load_s": load_s[-1]}


def resident_bytes(path: Path) -> Optional[int]:
    """Bytes of the files under ``path`` in the page cache (fincore, util-linux); None where it is missing."""
    files = [str(p) for p in path.rglob("*") if p.is_file()]
    if not files or shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                         capture_output=True, text=True, timeout=60)
    return sum(int(x) for x in out.stdout.split()) if out.returncode == 0 else None


# ---- 2. recovery -----------------------------------------------------------------------------------

def measure_recovery(factor: int, hidden: int, work: Path) -> Dict[str, Any]:
    d = work / f"recovery-f{factor}"
    ckpt, loss, log = d / "ckpt", d / "loss", d / "audit.jsonl"
    args = job_args(loss, log, hidden, iters=24, mem=2, storage=10, factor=factor, step_sleep=0.05)
    with cluster(2, d) as c:
        runs = c.launch(ckpt, 1, *args, tag="first")
        procs = [r.proc for r in runs]
        wait_until("iteration 14", lambda: last_iteration(loss, 1) >= 14, TIMEOUT, procs)
        if factor > 1:
            wait_until("a replica of step 12", lambda: (newest_replica(log, "node1") or 0) >= 12, TIMEOUT, procs)
        else:
            wait_until("step 10 committed", lambda: 10 in committed_steps(ckpt), TIMEOUT, procs)

        cached: Dict[str, Any] = {}

        def cold() -> None:
            # what a replacement node reads from storage comes from the disk: the save dir's pages are
            # dropped (not the whole page cache, which would also make torch's own imports cold on both
            # sides and measure the disk's speed at loading Python, not checkpoints)
            os.sync()
            evict(str(ckpt))
            cached["bytes"] = resident_bytes(ckpt)
        r = lose_and_replace(c, runs, ckpt, args, loss, before_relaunch=cold)
        c.wait([runs[0], c.nodes[1].current], 60)
    r["save_dir_cached_at_relaunch"] = cached.get("bytes")
    loads = [e for e in events(log) if e["event"] == "load" and e["step"] == r["resumed"]]
    r["loads"] = {e["rank"]: {k: e[k] for k in ("source", "bytes", "seconds")} for e in loads}
    r["restores"] = [{k: e[k] for k in ("rank", "node", "bytes", "seconds")}
                     for e in events(log) if e["event"] == "replica_restore"]
    return r


# ---- 3. step time -----------------------------------------------------------------------------------

def measure_steps(factor: int, hidden: int, iters: int, work: Path, tag: str) -> Dict[str, Any]:
    d = work / f"steps-{tag}"
    ckpt, loss, log = d / "ckpt", d / "loss", d / "audit.jsonl"
    args = job_args(loss, log, hidden, iters=iters, mem=1, storage=10**6, factor=factor, step_sleep=0)
    with cluster(2, d) as c:
        runs = c.launch(ckpt, 1, *args, tag="run")
        rcs = [r.wait_command(TIMEOUT) for r in runs]
        assert rcs == [0, 0], "\n".join(r.output()[-2500:] for r in runs)
    ev = events(log)
    diffs: List[float] = []
    later: List[float] = []       # the last two thirds: after the agents have measured what a send costs
    for rank in (0, 1):
        times = sorted((e["step"], e["time"]) for e in ev if e["event"] == "snapshot" and e["rank"] == rank)
        times = [t for s, t in times if s > 5]      # start-up and the first slots' allocation left out
        gaps = [b - a for a, b in zip(times, times[1:])]
        diffs += gaps
        later += gaps[len(gaps) // 3:]
    sent = [e for e in ev if e["event"] == "replica_sent"]
    return {"factor": factor, "step_diffs": diffs, "median_step": statistics.median(diffs),
            "median_later": statistics.median(later),
            "cadence": [e["every"] for e in ev if e["event"] == "replica_cadence"],
            "replicas_sent": len(sent), "replica_seconds": statistics.median([e["seconds"] for e in sent]) if sent else None}


# ---- 4. iterations lost at a random kill -----------------------------------------------------------------

def lost_trial(seed: int, work: Path) -> Dict[str, Any]:
    rng = random.Random(seed)
    delay = rng.uniform(0.0, 1.2)
    d = work / f"lost-{seed}"
    ckpt, loss, log = d / "ckpt", d / "loss", d / "audit.jsonl"
    args = job_args(loss, log, 64, iters=40, mem=2, storage=1000, factor=2, step_sleep=0.05)
    with cluster(2, d) as c:
        runs = c.launch(ckpt, 1, *args, tag="first")
        wait_until("iteration 3", lambda: last_iteration(loss, 1) >= 3, TIMEOUT, [r.proc for r in runs])
        time.sleep(delay)
        r = lose_and_replace(c, runs, ckpt, args, loss)
        c.wait([runs[0], c.nodes[1].current], 60)
    ev = events(log)
    # the newest replica node 1 had sent before it died (replica_sent is logged once the holder has it all)
    sent = [e["step"] for e in ev if e["event"] == "replica_sent" and e["host"] == "node1" and e["time"] <= r["killed_at"]]
    load = [e for e in ev if e["event"] == "load" and e["rank"] == 1 and e["time"] > r["killed_at"]]
    r.update(seed=seed, delay=delay, replica=max(sent) if sent else None, lost=r["reached"] - r["resumed"],
             source=load[-1]["source"] if load else None)
    return r


# ---- report ----------------------------------------------------------------------------------------------

def ratios(res: Dict[str, Any]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    if "throughput" in res:
        out["throughput"] = res["throughput"]["ratio"]
    rec = res.get("recovery")
    if rec:
        out["recovery_load"] = rec["peer"]["loads"][1]["seconds"] / rec["storage"]["loads"][1]["seconds"]
        out["recovery_total"] = rec["peer"]["relaunch_to_training"] / rec["storage"]["relaunch_to_training"]
    st = res.get("steps")
    if st:
        # the machine's speed drifts more between minutes than the overhead: each round's on / off ratio,
        # then the median over rounds (and, printed beside it, the ratio of the pooled medians)
        on = [x for x in st if x["factor"] > 1]
        off = [x for x in st if x["factor"] == 1]
        out["step_time"] = statistics.median([a["median_step"] / b["median_step"] for a, b in zip(on, off)])
        out["step_time_pooled"] = (statistics.median([v for x in on for v in x["step_diffs"]])
                                   / statistics.median([v for x in off for v in x["step_diffs"]]))
        out["step_time_later"] = statistics.median([a["median_later"] / b["median_later"] for a, b in zip(on, off)])
    trials = [t for t in res.get("lost", []) if t["replica"] is not None]
    if trials:
        out["lost_max"] = max(t["lost"] for t in trials)
    return out


def print_report(res: Dict[str, Any], args: argparse.Namespace) -> None:
    import torch
    print(f"\nbench_replicas{' --quick' if args.quick else ''}: torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"MB = 1e6 bytes; load average at the start {res['load_before']:.2f}, at the end {res['load_after']:.2f} "
          f"(other work on the machine shows in every figure)")
    tp = res.get("throughput")
    if tp:
        print(f"\n== throughput, best of {len(tp['raw'])}, one slot of {tp['bytes'] / MB:.0f} MB over 127.0.0.1")
        print(f"replication (Replicas._replicate -> PeerServer)  {tp['replicate_Bps'] / MB:9.0f} MB/s   "
              f"runs: " + ", ".join(f"{x['seconds']:.3f}s" for x in tp["replicate"]))
        print(f"raw sendall / recv_into                          {tp['raw_Bps'] / MB:9.0f} MB/s   "
              f"runs: " + ", ".join(f"{x['seconds']:.3f}s" for x in tp["raw"]))
        print(f"{ALGO} of the same bytes (one side's checksum)      {tp['checksum_Bps'] / MB:9.0f} MB/s   "
              f"runs: " + ", ".join(f"{x['seconds']:.3f}s" for x in tp["checksum"]))
    rec = res.get("recovery")
    if rec:
        print(f"\n== recovery of a lost node, 2 nodes x 1 rank, state {rec['state_bytes'] / MB:.1f} MB per rank "
              f"(--hidden {args.hidden}), save_mem_interval 2, storage interval 10")
        print(f"{'':10}{'resumed':>8}{'rank 1 source':>15}{'load s':>9}{'trainer load_s':>16}"
              f"{'relaunch->training s':>22}{'rank 0 source':>15}")
        for name in ("peer", "storage"):
            r = rec[name]
            l1, l0 = r["loads"].get(1, {}), r["loads"].get(0, {})
            print(f"{name:<10}{r['resumed']:>8}{l1.get('source', '-'):>15}{l1.get('seconds', float('nan')):>9.3f}"
                  f"{r['trainer_load_s']:>16.3f}{r['relaunch_to_training']:>22.3f}{l0.get('source', '-'):>15}")
        print(f"  save dir bytes in the page cache at the storage relaunch (fincore): "
              f"{rec['storage']['save_dir_cached_at_relaunch']}")
        for x in rec["peer"]["restores"]:
            print(f"  peer pull (replica_restore): rank {x['rank']} from node {x['node']}, {x['bytes'] / MB:.1f} MB "
                  f"in {x['seconds']:.3f} s")
    st = res.get("steps")
    if st:
        print(f"\n== step time, save_mem_interval 1, no step sleep, 2 nodes x 1 rank, state "
              f"{res['state_bytes'] / MB:.1f} MB per rank, runs in this order")
        for x in st:
            extra = (f", {x['replicas_sent']} replicas sent, median {x['replica_seconds']:.3f} s each"
                     if x["replicas_sent"] else "")
            print(f"factor {x['factor']}: median step {1000 * x['median_step']:.1f} ms over {len(x['step_diffs'])} "
                  f"step gaps{extra}")
    if st:
        print("on / off per round: " + ", ".join(f"{a['median_step'] / b['median_step']:.3f}" for a, b in
                                                   zip(st[0::2], st[1::2]))
              + f"; pooled medians: {res['ratios']['step_time_pooled']:.3f}")
        off = [x["median_step"] for x in st if x["factor"] == 1]
        if len(off) > 1:      # the same runs twice: how far apart the machine's noise alone puts them
            print(f"noise floor, off / off between rounds: {max(off) / min(off):.3f} (the overhead can only be "
                  f"read to this precision here)")
        every = [e for x in st for e in x.get("cadence", [])]
        if every:
            print(f"the agents' cadence (replica_cadence events): every {statistics.median(every):.0f} snapshots "
                  f"at the median, {min(every)}..{max(every)}; {sum(x['replicas_sent'] for x in st)} replicas sent in all")
    lost = res.get("lost")
    if lost:
        print(f"\n== iterations lost when node 1 is killed at a random moment ({len(lost)} trials, "
              f"save_mem_interval 2, storage interval 1000, seeds 0..{len(lost) - 1})")
        print(f"{'seed':>5}{'delay s':>9}{'reached':>9}{'replica':>9}{'resumed':>9}{'lost':>6}{'source':>9}")
        for t in lost:
            print(f"{t['seed']:>5}{t['delay']:>9.3f}{t['reached']:>9}{str(t['replica']):>9}{t['resumed']:>9}"
                  f"{t['lost']:>6}{str(t['source']):>9}")
        with_replica = [t["lost"] for t in lost if t["replica"] is not None]
        dist = {v: with_replica.count(v) for v in sorted(set(with_replica))}
        print(f"lost with a replica: {dist} (iterations: trials); max {max(with_replica) if with_replica else '-'}; "
              f"{len(lost) - len(with_replica)} trial(s) without a replica yet")
    print(f"\n{'goal':<52}{'value':>10}   target")
    ra = res["ratios"]
    for key, text, test, target in GOALS:
        if key in ra:
            v = ra[key]
            shown = f"{v:.0f}" if key == "lost_max" else f"{v:.3f}"
            print(f"{text:<52}{shown:>10} {'PASS' if test(v) else 'MISS'}   {target}")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (~3 minutes): small sizes, few runs")
    p.add_argument("--slot-mb", type=float, default=None, help="throughput: the slot's size in MB (default 512)")
    p.add_argument("--repeats", type=int, default=5, help="throughput: runs of each, the best counts (the first two fill fresh replica slots)")
    p.add_argument("--hidden", type=int, default=None,
                   help="recovery and step time: the model's width; state = 216 bytes x hidden (default 200000)")
    p.add_argument("--step-rounds", type=int, default=None, help="(on, off) pairs of step-time runs (default 2)")
    p.add_argument("--step-iters", type=int, default=None, help="iterations per step-time run (default 200: the agents measure and adapt over the first ones)")
    p.add_argument("--trials", type=int, default=None, help="random-kill trials (default 20)")
    p.add_argument("--skip", default="", help="comma-separated: throughput, recovery, steps, lost")
    p.add_argument("--dir", default=None, help="where temporary files go (default: the system's temp dir)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory for replicas.json")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("slot_mb", 512, 64), ("hidden", 200_000, 40_000), ("step_rounds", 2, 1),
                              ("step_iters", 200, 30), ("trials", 20, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    why = nodes.unavailable()
    if why and not args.skip >= {"recovery", "steps", "lost"}:
        sys.exit(f"bench_replicas: {why} (or --skip recovery,steps,lost)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the finally blocks on SIGTERM too
    work = Path(tempfile.mkdtemp(prefix="easyckpt-bench-replicas-", dir=args.dir))
    res: Dict[str, Any] = {"state_bytes": STATE_PER_HIDDEN * args.hidden}
    t_start = time.monotonic()
    res["load_before"] = os.getloadavg()[0]
    try:
        if "throughput" not in args.skip:
            say(f"throughput: {args.slot_mb:g} MB slot, {args.repeats} runs each")
            res["throughput"] = measure_throughput(int(args.slot_mb * MB), args.repeats, str(work))
        if "recovery" not in args.skip:
            res["recovery"] = {"state_bytes": res["state_bytes"]}
            for name, factor in (("peer", 2), ("storage", 1)):
                say(f"recovery from {name} (replication_factor {factor})")
                res["recovery"][name] = measure_recovery(factor, args.hidden, work)
        if "steps" not in args.skip:
            res["steps"] = []
            for rnd in range(args.step_rounds):
                for factor in (2, 1):
                    say(f"step time, round {rnd + 1}/{args.step_rounds}, replication_factor {factor}")
                    res["steps"].append(measure_steps(factor, args.hidden, args.step_iters, work, f"{rnd}-f{factor}"))
        if "lost" not in args.skip:
            res["lost"] = []
            for seed in range(args.trials):
                say(f"random kill, trial {seed + 1}/{args.trials}")
                res["lost"].append(lost_trial(seed, work))
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = os.getloadavg()[0]
    res["ratios"] = ratios(res)
    res["wall_seconds"] = time.monotonic() - t_start
    print_report(res, args)
    print(f"\nwall time {res['wall_seconds']:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "replicas.json")
    with open(path, "w") as f:
        json.dump({"args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
                   "results": res}, f, indent=1, default=str)
    print(f"figures: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
