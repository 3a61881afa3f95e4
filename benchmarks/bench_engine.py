"""Benchmark of easyckpt's engine against the floors it is measured by.

This is a benchmark, not a test: it prints figures and never fails on them. For a CPU training
state of ``--gb`` GB (float32 tensors: a "model" dict plus an Adam-like "optimizer" dict with
exp_avg / exp_avg_sq of the same shapes) it measures, in one run:

1. the training stall of an easyckpt snapshot, in steady state (the first snapshot allocates and
   faults in both /dev/shm slots; it is reported apart and kept out of the median);
2. a raw copy of the same bytes into a warm preallocated buffer (``dst.copy_(src)`` per tensor):
   the floor a snapshot cannot beat, since a snapshot *is* that copy plus bookkeeping;
3. ``torch.save`` of the same state to disk plus fsync: what a classic blocking save stalls for;
4. the bandwidth of easyckpt's persist (slot -> shard files, fsynced) next to a raw sequential
   ``os.write`` + ``os.fsync`` of the same bytes: the floor set by the disk.

Goals printed as PASS/MISS: stall / raw copy <= 1.25 and persist / raw write bandwidth >= 0.8.

Measurements are interleaved per repeat and each disk measurement starts from the same state
(dirty pages flushed, hot free memory available: see settle_disk and warm_free_memory), so that
noise and VM memory artefacts hit the easyckpt figure and its floor alike.

Usage::

    .venv/bin/python benchmarks/bench_engine.py [--gb 1.0] [--repeats 3] [--dir DIR] [--json PATH]

GB here means 10**9 bytes. Every file the run creates (under a fresh temporary directory, and the
two /dev/shm slots of a random job id) is removed at the end, also on error, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from easyckpt.engine import protocol, shm
from easyckpt.engine.persist import persist_slot
from easyckpt.engine.snapshot import ShardSpec, Snapshotter

GB = 10**9
STALL_GOAL = 1.25     # stall / raw copy must be at most this
PERSIST_GOAL = 0.8    # persist bandwidth / raw write bandwidth must be at least this
COPY_PAIRS = 3        # (snapshot, raw copy) pairs per repeat
WRITE_CHUNK = 8 << 20 # bytes per os.write of the raw write
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"

# Relative sizes of the model's parameters: a few big matrices of different shapes and one small
# vector, like a real network, so that the snapshot handles mixed sizes rather than one blob.
_PARAM_SHARES: List[Tuple[str, float, int]] = [
    # (name, share of the parameter bytes, row length)
    ("embed.weight", 0.30, 1024),
    ("block0.attn.weight", 0.25, 3072),
    ("block0.mlp.weight", 0.25, 4096),
    ("head.weight", 0.199, 1024),
    ("head.bias", 0.001, 0),          # 0: a 1-D tensor
]


# ---- the state -------------------------------------------------------------------------------

def build_state(gb: float) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """A model dict and an optimizer-state dict (Adam layout) whose tensors sum to ``gb`` GB.

    The optimizer holds exp_avg and exp_avg_sq for every parameter, so the parameters themselves
    are a third of the bytes. Tensors are filled with random values so every page is really
    backed (torch.empty / zeros could leave untouched pages, which copy far faster than real data).
    """
    param_elems = gb * GB / 4 / 3
    gen = torch.Generator().manual_seed(0)
    model: Dict[str, torch.Tensor] = {}
    for name, share, row in _PARAM_SHARES:
        n = max(1, int(param_elems * share))
        shape = (n,) if row == 0 else (max(1, n // row), row)
        model[name] = torch.empty(shape, dtype=torch.float32).uniform_(generator=gen)
    state = {
        name: {"step": 1000,
               "exp_avg": torch.empty_like(p).uniform_(generator=gen),
               "exp_avg_sq": torch.empty_like(p).uniform_(generator=gen)}
        for name, p in model.items()
    }
    optimizer = {"state": state,
                 "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                   "params": list(model)}]}
    return model, optimizer


def all_tensors(model: Dict[str, torch.Tensor], optimizer: Dict[str, Any]) -> List[torch.Tensor]:
    tensors = list(model.values())
    for entry in optimizer["state"].values():
        tensors += [entry["exp_avg"], entry["exp_avg_sq"]]
    return tensors


def nbytes_of(tensors: List[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- preflight -------------------------------------------------------------------------------

def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_space(gb: float, work_dir: str) -> None:
    """Exit with a clear message before allocating anything if /dev/shm or the disk is too small.

    /dev/shm holds the two snapshot slots (each the state plus a header page and >= 1 MiB of
    metadata room); the disk needs room for the largest file set alive at once, with margin.
    """
    need_shm = int(2 * gb * GB) + 2 * (shm.HEADER_BYTES + (4 << 20)) + (64 << 20)
    need_disk = int(3 * gb * GB)
    problems = []
    have_shm = free_bytes(shm.SHM_DIR)
    if have_shm < need_shm:
        problems.append(f"{shm.SHM_DIR} has {have_shm / GB:.2f} GB free, the two snapshot slots need "
                        f"{need_shm / GB:.2f} GB ({shm.shm_advice()})")
    have_disk = free_bytes(work_dir)
    if have_disk < need_disk:
        problems.append(f"{work_dir} has {have_disk / GB:.2f} GB free, the benchmark needs "
                        f"{need_disk / GB:.2f} GB (pass --dir on a larger file system)")
    if problems:
        sys.exit("bench_engine: not enough space:\n  " + "\n  ".join(problems) +
                 "\n  or lower --gb.")


# ---- keeping our slots ours -------------------------------------------------------------------

class AgentStandIn:
    """Listen on this job's agent address for the duration of the benchmark.

    Why: the benchmark starts no agent. When another easyckpt job on this node starts its agent,
    that agent removes /dev/shm segments it takes for leftovers of dead jobs: those whose job has
    no live agent and whose header names no live process. A slot that is allocated but not yet
    published (slot 1 until the second snapshot, any slot while the first one fills it) carries
    no pid, so it would be unlinked under us. Answering on the agent's (abstract, fileless) socket
    marks the job alive. Connections are accepted and closed at once so a probe never blocks.
    """

    def __init__(self, job_id: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(protocol.address(job_id))
        self.sock.listen(16)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:      # the socket was closed: we are done
                return
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept()
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5)


# ---- the measurements ------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def raw_copy(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    # the same per-tensor copy_ the snapshot does, minus slots, layout and header
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def raw_write(path: str, tensors: List[torch.Tensor]) -> int:
    """Sequential os.write of the tensor bytes into one file, then fsync: the disk's floor.

    Written in WRITE_CHUNK pieces: on the test VM one write() of a whole 100 MB tensor was
    erratically 3-10x slower than the same bytes in 8 MiB calls, and the floor should be the
    best a plain writer gets, not an artefact of call size.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    total = 0
    try:
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")   # no copy: the tensor's own memory
            while view:
                n = os.write(fd, view[:WRITE_CHUNK])
                view = view[n:]
                total += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def torch_save(path: str, state: Dict[str, Any]) -> None:
    # a classic checkpoint is only safe once it is on disk, so the fsync belongs to its cost
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def settle_disk() -> None:
    """Flush every dirty page before a disk measurement so it does not pay for the previous one.

    This also commits the unlink of the previous measurement's files, and with it the discards an
    ext4 mounted with ``-o discard`` issues for the freed blocks, outside the timed region.
    """
    os.sync()


def warm_free_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of anonymous memory and free it again, just before a disk measurement.

    Why: a file write first copies into page cache, so its speed depends on how fast the kernel
    gets free pages. On a VM with free page reporting (virtio-balloon, common in the cloud),
    pages that stayed free for ~2 s are handed back to the host, and touching them again costs a
    host fault each: a write then runs 3-5x slower depending only on how long the machine was idle
    before it, which would make the comparison a lottery. Faulting a pool in and unmapping it puts
    that many hot pages on the free lists, which the measured write reuses at once; every disk
    measurement (persist, raw write, torch.save) gets the same treatment, so the ratio stays fair,
    and on bare metal this is a no-op in effect.
    """
    pool = mmap.mmap(-1, nbytes)
    try:
        arr = np.frombuffer(pool, dtype=np.uint8)
        arr[::mmap.PAGESIZE] = 1   # one store per page faults it in
        del arr                    # drop the buffer export, or close() would refuse
    finally:
        pool.close()               # munmap: the pages go back to the kernel's free lists, hot


def timed_disk_op(fn: Callable[[], Any], pool_bytes: int) -> Tuple[float, Any]:
    """Time ``fn`` after putting the machine in the same state as for every other disk op."""
    settle_disk()
    warm_free_memory(pool_bytes)
    return timed(fn)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


# ---- reporting -------------------------------------------------------------------------------

def median(xs: List[float]) -> float:
    return statistics.median(xs)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_table(r: Dict[str, Any]) -> None:
    nb = r["state_bytes"]
    m = r["median_seconds"]
    rows = [
        ("easyckpt snapshot stall (steady)", m["snapshot_stall"], nb),
        ("  same, as timed by snapshot()", m["snapshot_internal"], nb),
        ("raw copy into warm buffer", m["raw_copy"], nb),
        ("torch.save + fsync", m["torch_save"], r["torch_save_bytes"]),
        ("easyckpt persist (shards + fsync)", m["persist"], r["persist_bytes"]),
        ("raw os.write + fsync", m["raw_write"], nb),
    ]
    print()
    print(f"state: {nb / GB:.3f} GB in {r['tensors']} float32 tensors; medians of {r['repeats']} "
          f"repeats ({r['repeats'] * COPY_PAIRS} samples for the copies); GB = 1e9 bytes")
    print(f"first snapshot (allocates both /dev/shm slots): {r['first_snapshot_seconds']:.4f} s")
    print()
    print(f"{'measurement':<36} {'seconds':>10} {'GB/s':>9}")
    print("-" * 57)
    for name, sec, nbytes in rows:
        print(f"{name:<36} {sec:>10.4f} {nbytes / sec / GB:>9.2f}")
    print()
    ra = r["ratios"]
    print(f"{'ratio':<36} {'value':>10} {'goal':>9}")
    print("-" * 62)
    print(f"{'stall / raw copy':<36} {ra['stall_over_raw_copy']:>10.3f} {'<= ' + str(STALL_GOAL):>9}"
          f"  {verdict(ra['stall_pass'])}")
    print(f"{'persist BW / raw write BW':<36} {ra['persist_bw_over_raw_write_bw']:>10.3f} "
          f"{'>= ' + str(PERSIST_GOAL):>9}  {verdict(ra['persist_pass'])}")
    print(f"{'stall / torch.save':<36} {ra['stall_over_torch_save']:>10.3f} {'-':>9}"
          f"  ({1 / ra['stall_over_torch_save']:.1f}x shorter stall)")


# ---- main ------------------------------------------------------------------------------------

def run(gb: float, repeats: int, work_dir: str, job_id: str) -> Dict[str, Any]:
    model, optimizer = build_state(gb)
    srcs = all_tensors(model, optimizer)
    nbytes = nbytes_of(srcs)
    shards = [ShardSpec(MODEL_FILE, model, True), ShardSpec(OPTIM_FILE, optimizer, True)]

    # warm destination for the raw copy: allocate, then copy once so every page is faulted in
    # (the steady-state snapshot writes into slots that are warm too, so this is the fair floor)
    dsts = [torch.empty_like(t) for t in srcs]
    raw_copy(dsts, srcs)

    samples: Dict[str, List[float]] = {k: [] for k in (
        "snapshot_stall", "snapshot_internal", "raw_copy", "torch_save", "persist", "raw_write")}
    persist_bytes = 0
    torch_save_bytes = 0
    # room for the largest file a disk measurement writes (torch.save adds pickle framing)
    pool_bytes = int(nbytes * 1.1) + (64 << 20)

    snap = Snapshotter(job_id, rank=0, world_size=1)
    try:
        # the first snapshot computes the layout and allocates + touches both slots: a one-off cost
        first, res = timed(lambda: snap.snapshot(0, shards, persist=False))
        assert res is not None
        print(f"first snapshot: {first:.4f} s (allocates {2 * nbytes / GB:.2f} GB of /dev/shm)",
              flush=True)

        # Measurements are interleaved per repeat, so slow drift on a noisy machine hits each
        # of them alike instead of favouring whichever ran first.
        step = 0
        for rep in range(repeats):
            # Memory copies are cheap, so each repeat takes COPY_PAIRS back-to-back pairs of
            # (snapshot, raw copy), alternating which goes first: a pair sees one machine state,
            # so the ratio is not at the mercy of a neighbour's burst between the two.
            for pair in range(COPY_PAIRS):
                step += 1
                snap_first = pair % 2 == 0
                if not snap_first:
                    samples["raw_copy"].append(timed(lambda: raw_copy(dsts, srcs))[0])
                sec, res = timed(lambda: snap.snapshot(step, shards, persist=False))
                if res is None:
                    raise RuntimeError("no free snapshot slot (nothing should reserve one here)")
                samples["snapshot_stall"].append(sec)
                samples["snapshot_internal"].append(res.seconds)
                if snap_first:
                    samples["raw_copy"].append(timed(lambda: raw_copy(dsts, srcs))[0])

            # persist the last snapshot into a fresh staging dir (persist refuses existing files)
            staging = os.path.join(work_dir, f"staging-{rep}")
            slot_path = shm.slot_path(job_id, 0, res.slot)
            sec, (_, _, persist_bytes, _) = timed_disk_op(
                lambda: persist_slot(slot_path, res.generation, staging, 0), pool_bytes)
            samples["persist"].append(sec)
            remove(staging)   # keep disk use and page cache bounded to one file set at a time

            raw_path = os.path.join(work_dir, f"raw-{rep}.bin")
            sec, written = timed_disk_op(lambda: raw_write(raw_path, srcs), pool_bytes)
            assert written == nbytes
            samples["raw_write"].append(sec)
            remove(raw_path)

            save_path = os.path.join(work_dir, f"torch-{rep}.pt")
            sec, _ = timed_disk_op(
                lambda: torch_save(save_path, {"model": model, "optimizer": optimizer}), pool_bytes)
            samples["torch_save"].append(sec)
            torch_save_bytes = os.path.getsize(save_path)
            remove(save_path)

            last = {k: v[-1] for k, v in samples.items()}
            print(f"repeat {rep + 1}/{repeats}: "
                  f"stall {median(samples['snapshot_stall'][-COPY_PAIRS:]):.4f} s, "
                  f"raw copy {median(samples['raw_copy'][-COPY_PAIRS:]):.4f} s, "
                  f"persist {last['persist']:.3f} s, raw write {last['raw_write']:.3f} s, "
                  f"torch.save {last['torch_save']:.3f} s", flush=True)
    finally:
        snap.close(unlink=True)   # removes /dev/shm/easyckpt-<job_id>-r00000-s0/1

    med = {k: median(v) for k, v in samples.items()}
    persist_bw = persist_bytes / med["persist"]
    raw_write_bw = nbytes / med["raw_write"]
    ratios = {
        "stall_over_raw_copy": med["snapshot_stall"] / med["raw_copy"],
        "persist_bw_over_raw_write_bw": persist_bw / raw_write_bw,
        "stall_over_torch_save": med["snapshot_stall"] / med["torch_save"],
    }
    ratios["stall_pass"] = ratios["stall_over_raw_copy"] <= STALL_GOAL
    ratios["persist_pass"] = ratios["persist_bw_over_raw_write_bw"] >= PERSIST_GOAL
    return {
        "gb": gb, "repeats": repeats, "state_bytes": nbytes, "tensors": len(srcs),
        "persist_bytes": persist_bytes, "torch_save_bytes": torch_save_bytes,
        "first_snapshot_seconds": first,
        "samples_seconds": samples, "median_seconds": med,
        "bandwidth_gb_per_s": {
            "snapshot": nbytes / med["snapshot_stall"] / GB,
            "raw_copy": nbytes / med["raw_copy"] / GB,
            "torch_save": torch_save_bytes / med["torch_save"] / GB,
            "persist": persist_bw / GB,
            "raw_write": raw_write_bw / GB,
        },
        "ratios": ratios,
        "goals": {"stall_over_raw_copy_max": STALL_GOAL, "persist_bw_over_raw_write_bw_min": PERSIST_GOAL},
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                "shm_dir": shm.SHM_DIR},
    }


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="size of the training state in GB (1e9 bytes)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported")
    p.add_argument("--dir", default=None,
                   help="where temporary files go (a fresh subdirectory is made and removed); "
                        "default: a new temporary directory under /tmp")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.gb <= 0 or args.repeats < 1:
        p.error("--gb must be > 0 and --repeats >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    base = args.dir if args.dir is not None else tempfile.gettempdir()
    if not os.path.isdir(base):
        sys.exit(f"bench_engine: --dir {base} is not a directory")
    check_space(args.gb, base)

    # SIGTERM would skip the finally blocks; turn it into SystemExit so cleanup still runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # a random job id: never touches the slots of a real job (or of another benchmark) on this node
    job_id = secrets.token_hex(6)
    # always our own subdirectory, so cleanup removes only what this run created
    work_dir = tempfile.mkdtemp(prefix="easyckpt-bench-", dir=base)
    stand_in = AgentStandIn(job_id)
    try:
        print(f"bench_engine: {args.gb} GB state, {args.repeats} repeats, files in {work_dir}, "
              f"job id {job_id}", flush=True)
        result = run(args.gb, args.repeats, work_dir, job_id)
    finally:
        stand_in.close()
        shutil.rmtree(work_dir, ignore_errors=True)
        for path in shm.segments_of(job_id):   # belt and braces: close(unlink=True) already did it
            shm.unlink_quiet(path)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
