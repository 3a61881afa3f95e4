"""easyckpt command line (more verbs come with the operator-tools issue).

    easyckpt run [--max-restarts N] [--backoff S] -- CMD   run CMD until it succeeds (launcher.py)
    easyckpt status DIR [--job-name NAME] [--json]          agent, snapshots in memory, newest checkpoint, /dev/shm
    easyckpt ls DIR [--framework pytorch|megatron|deepspeed|transformers] [--json]
    easyckpt verify DIR [STEP] [--framework ...] [--json]     exit status 1 on damage, naming the file
    easyckpt convert megatron-distopt DIR [STEP]              Megatron's own distrib_optim.pt per (tp, pp)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Tuple

from .config import Naming
from .engine import manifest as mf
from .engine import retention, shardfile


FRAMEWORKS = {"pytorch": "easyckpt.pytorch", "megatron": "easyckpt.megatron.state",
              "deepspeed": "easyckpt.deepspeed", "transformers": "easyckpt.transformers"}


def _naming(framework: str) -> Naming:
    import importlib
    return importlib.import_module(FRAMEWORKS[framework]).NAMING


def _verify_dir(step_dir: str) -> List[str]:
    man = mf.read(step_dir)
    if man is None:
        return [f"{mf.MANIFEST_NAME}: missing or unreadable (not a committed checkpoint)"]
    problems = mf.check_sizes(step_dir, man)
    for rel in man["files"]:
        if any(p.startswith(rel + ":") for p in problems):
            continue
        problem = mf.check_bytes(rel, shardfile.read_file(os.path.join(step_dir, rel)), man)
        if problem:
            problems.append(problem)
    return problems


def cmd_ls(args: argparse.Namespace) -> int:
    naming = _naming(args.framework)
    rows = []
    for step, path in retention.step_dirs(args.dir, naming):
        man = mf.read(path)
        size = sum(e["size"] for e in man["files"].values()) if man else None
        rows.append({"step": step, "path": path, "committed": man is not None, "bytes": size,
                     "world_size": man.get("world_size") if man else None})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            state = "committed" if r["committed"] else "incomplete (no manifest)"
            print(f"{r['step']:>10}  {state:<25} {r['bytes'] or 0:>14,d} B  {r['path']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        print(f"easyckpt verify: {args.dir} is not a directory", file=sys.stderr)
        return 2
    naming = _naming(args.framework)
    dirs = retention.step_dirs(args.dir, naming)
    if args.step is not None:
        dirs = [(s, p) for s, p in dirs if s == args.step]
    if not dirs:
        print(f"easyckpt verify: no checkpoint{'' if args.step is None else f' of step {args.step}'} in {args.dir}",
              file=sys.stderr)
        return 2
    report, bad = [], False
    for step, path in dirs:
        problems = _verify_dir(path)
        bad = bad or bool(problems)
        report.append({"step": step, "path": path, "ok": not problems, "problems": problems})
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report:
            print(f"step {r['step']}: {'OK' if r['ok'] else 'DAMAGED'}  {r['path']}")
            for p in r["problems"]:
                print(f"    {p}")
    return 1 if bad else 0


def _detect_naming(save_dir: str) -> Tuple[str, Naming]:
    """The framework whose step-directory naming matches the most entries of ``save_dir``."""
    best = ("pytorch", _naming("pytorch"), -1)
    for name in sorted(FRAMEWORKS):
        try:
            naming = _naming(name)
        except ImportError:
            continue
        n = len(retention.step_dirs(save_dir, naming))
        if n > best[2]:
            best = (name, naming, n)
    return best[0], best[1]


def cmd_status(args: argparse.Namespace) -> int:
    from .config import Config
    from .engine import shm
    from .engine.client import one_shot
    if not os.path.isdir(args.dir):
        print(f"easyckpt status: {args.dir} is not a directory", file=sys.stderr)
        return 2
    job_id = Config(save_dir=args.dir, job_name=args.job_name).job_id
    framework, naming = (args.framework, _naming(args.framework)) if args.framework else _detect_naming(args.dir)
    agent = one_shot(job_id, {"op": "status"})
    snapshots = []
    for path, _job, rank, index in shm.list_segments(job_id):
        entry = {"rank": rank, "slot": index, "path": path, "segment_bytes": os.path.getsize(path),
                 "step": None, "bytes": None, "complete": False}
        try:
            slot = shm.Slot(path, writable=False)
        except OSError:
            continue
        try:
            hdr = slot.read_header()
            if hdr is not None and slot.read_meta(hdr) is not None:
                entry.update(step=hdr.step, bytes=hdr.data_capacity, complete=True, world_size=hdr.world_size)
        finally:
            slot.close()
        snapshots.append(entry)
    committed = retention.committed(args.dir, naming)
    newest = None
    if committed:
        step, path = committed[0]
        man = mf.read(path) or {}
        newest = {"step": step, "path": path, "bytes": sum(e["size"] for e in man.get("files", {}).values()),
                  "committed_at": os.path.getmtime(os.path.join(path, mf.MANIFEST_NAME))}
    st = os.statvfs(shm.SHM_DIR)
    dev_shm = {"total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize,
               "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
               "this_job": sum(s["segment_bytes"] for s in snapshots)}
    report = {"save_dir": args.dir, "job_id": job_id, "framework": framework, "agent": agent,
              "snapshots": snapshots, "newest_committed": newest, "committed_count": len(committed),
              "dev_shm": dev_shm}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"save dir   {args.dir}  (job {job_id}, {framework} layout)")
    if agent is None:
        print("agent      not running on this node")
    else:
        print(f"agent      pid {agent['agent_pid']}, ranks attached {agent['connected']}, dead {agent['dead_ranks']}, "
              f"pending commits {agent['pending_commits']}, jobs queued {agent['outstanding']}")
        if agent.get("sigterm"):
            print(f"           SIGTERM {agent['sigterm']}")
        if agent.get("last_error"):
            print(f"           last error: {agent['last_error']}")
    if not snapshots:
        print("memory     no snapshot of this job on this node")
    for s in sorted(snapshots, key=lambda s: (s["rank"], s["slot"])):
        what = f"step {s['step']:>8}  {s['bytes']:>14,d} B" if s["complete"] else "(being written or torn)"
        print(f"memory     rank {s['rank']:>4} slot {s['slot']}  {what}")
    if newest is None:
        print("storage    no committed checkpoint")
    else:
        print(f"storage    newest committed step {newest['step']} ({newest['bytes']:,d} B, {len(committed)} kept)  "
              f"{newest['path']}")
    gib = 1 << 30
    print(f"/dev/shm   {dev_shm['used'] / gib:.2f} of {dev_shm['total'] / gib:.2f} GiB used, this job "
          f"{dev_shm['this_job'] / gib:.3f} GiB, {dev_shm['free'] / gib:.2f} GiB free")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .megatron.convert import to_megatron_distrib_optim
    committed = retention.committed(args.dir, _naming("megatron"))
    if args.step is not None:
        committed = [(s, p) for s, p in committed if s == args.step]
    if not committed:
        print(f"easyckpt convert: no committed Megatron checkpoint{'' if args.step is None else f' of step {args.step}'} "
              f"in {args.dir}", file=sys.stderr)
        return 2
    try:
        for path in to_megatron_distrib_optim(committed[0][1]):
            print(f"wrote {path}")
    except ValueError as exc:
        print(f"easyckpt convert: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="easyckpt", description="run and inspect easyckpt jobs and checkpoints")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn in (("ls", cmd_ls), ("verify", cmd_verify)):
        p = sub.add_parser(name)
        p.add_argument("dir")
        if name == "verify":
            p.add_argument("step", nargs="?", type=int)
        p.add_argument("--framework", default="pytorch", choices=sorted(FRAMEWORKS))
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=fn)
    st = sub.add_parser("status", help="the node agent, snapshots in memory, the newest checkpoint, /dev/shm")
    st.add_argument("dir")
    st.add_argument("--job-name", default=None, help="the job_name given to initialize_easyckpt, if any")
    st.add_argument("--framework", default=None, choices=sorted(FRAMEWORKS), help="default: detected")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)
    from .launcher import add_parser as add_run
    add_run(sub)
    conv = sub.add_parser("convert", help="megatron-distopt: per-DP optimizer shards -> Megatron's distrib_optim.pt")
    conv.add_argument("what", choices=["megatron-distopt"])
    conv.add_argument("dir")
    conv.add_argument("step", nargs="?", type=int)
    conv.set_defaults(fn=cmd_convert)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
