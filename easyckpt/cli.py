"""easyckpt command line (more verbs come with the operator-tools issue).

    easyckpt ls DIR [--framework pytorch|megatron|deepspeed|transformers] [--json]
    easyckpt verify DIR [STEP] [--framework ...] [--json]     exit status 1 on damage, naming the file
    easyckpt convert megatron-distopt DIR [STEP]              Megatron's own distrib_optim.pt per (tp, pp)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

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
    parser = argparse.ArgumentParser(prog="easyckpt", description="inspect easyckpt checkpoints")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn in (("ls", cmd_ls), ("verify", cmd_verify)):
        p = sub.add_parser(name)
        p.add_argument("dir")
        if name == "verify":
            p.add_argument("step", nargs="?", type=int)
        p.add_argument("--framework", default="pytorch", choices=sorted(FRAMEWORKS))
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=fn)
    conv = sub.add_parser("convert", help="megatron-distopt: per-DP optimizer shards -> Megatron's distrib_optim.pt")
    conv.add_argument("what", choices=["megatron-distopt"])
    conv.add_argument("dir")
    conv.add_argument("step", nargs="?", type=int)
    conv.set_defaults(fn=cmd_convert)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
