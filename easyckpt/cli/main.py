"""The easyckpt command line: see what checkpoints a directory holds, check them, look inside, prune,
convert, and run a job that restarts itself.

    easyckpt ls DIR                                 one row per checkpoint; which one the loader picks
    easyckpt inspect DIR [STEP]                     tensors, bytes by group, saved arguments, metadata
    easyckpt verify DIR [STEP]                      sizes and checksums; exit 1 on damage, naming the file
    easyckpt prune DIR --keep N [--dry-run]         automatic pruning's rules, every delete logged
    easyckpt convert megatron-distopt DIR [STEP]    Megatron's own distrib_optim.pt per (tp, pp)
    easyckpt convert safetensors DIR [STEP]         full weights of an HF / DeepSpeed ZeRO checkpoint (HF: a
                                                    folder from_pretrained reads)
    easyckpt status DIR                             agent, snapshots in memory, newest checkpoint, /dev/shm
    easyckpt report DIR [-o FILE]                   the audit log as a timeline (HTML; PNG with matplotlib)
    easyckpt run [--max-restarts N] -- CMD          run CMD until it succeeds (launcher.py)

DIR is the save directory (Megatron --save, the Trainer's output_dir, DeepSpeed's save_dir); the framework
is detected from its step directories' names (--framework to say it); an s3:// DIR is reached at --endpoint-url
(else AWS_ENDPOINT_URL, else boto3's own lookup), as a job's endpoint_url. --json prints one JSON document on
stdout for scripts; progress bars go to stderr (on a terminal, or with --progress). Exit status: 0 fine,
1 damage found or a command failed, 2 a wrong path, a directory with no checkpoint, or bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import functools
import os
import sys
from typing import Any, Callable, Dict, List, Optional

from easyckpt.cli import catalog, jobfiles, saying
from easyckpt.cli.catalog import FRAMEWORKS, CatalogError
from easyckpt.cli.saying import say
from easyckpt.cli.status import cmd_status
from easyckpt.errors import EasyCkptError
from easyckpt.storage import resolve, retention, stepfiles
from easyckpt.storage.resolve import is_url, storage_for
from easyckpt.storage.savedir import SaveDir
from easyckpt.units import human


def _progress(args: argparse.Namespace) -> Callable[[int, str], Any]:
    from easyckpt.progress import Progress
    return lambda total, desc: Progress(total, desc, args.progress)


def _size(n: Optional[int]) -> str:
    return "-" if n is None else human(n)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _layout(layout: Dict[str, int]) -> str:
    return f"tp{layout['tp']} pp{layout['pp']} dp{layout['dp']}" if layout else "-"


def cmd_ls(args: argparse.Namespace) -> int:
    if args.verify:
        total = catalog.stored_bytes(catalog.require(args.dir, args.framework).entries)
        with _progress(args)(total, "verify") as bar:
            cat = catalog.require(args.dir, args.framework, checksums=True, on_bytes=bar.update)
    else:
        cat = catalog.require(args.dir, args.framework)
    # --verify is a check: damage found is exit 1, as for `verify` (a script must not read "fine")
    status = 1 if args.verify and any(e.state == "damaged" for e in cat.entries) else 0
    best = next((e for e in cat.entries if e.best), None)
    if args.json:
        say(json.dumps({"save_dir": cat.save_dir, "framework": cat.framework,
                          "picked": cat.picked.step if cat.picked else None, "best": best.step if best else None,
                          "checkpoints": [e.to_json() for e in cat.entries]}, indent=1))
        return status
    say(f"{cat.save_dir}  ({cat.framework} layout)")
    say(f"  {'step':>10}  {'time':<19}  {'size':>10}  {'layout':<13}  {'directory':<20}  state")
    for e in cat.entries:
        state = (e.state if e.complete else f"{e.state.upper()}: {e.why}") + (", best" if e.best else "")
        mark = "*" if e.picked else " "
        say(f"{mark} {e.step:>10}  {_when(e.time):<19}  {_size(e.bytes):>10}  {_layout(e.layout):<13}  "
              f"{os.path.basename(e.path):<20}  {state}")
    pick = cat.picked
    checked = "sizes and checksums checked" if args.verify else "sizes checked; --verify reads every byte"
    say(f"* the loader would pick step {pick.step} ({checked}; a newer snapshot in this node's memory comes "
          f"first: easyckpt status)" if pick else "no complete checkpoint: the loader would start from scratch")
    if best is not None:
        say(f"best: step {best.step} is the Trainer's best_model_checkpoint (metric_for_best_model, in "
            f"trainer_state.json): save_total_limit and `easyckpt prune` keep it whatever its age")
    return status


def cmd_verify(args: argparse.Namespace) -> int:
    cat = catalog.require(args.dir, args.framework)
    entries = [cat.step(args.step)] if args.step is not None else [e for e in cat.entries if not e.staging]
    report: List[Dict[str, Any]] = []
    with _progress(args)(catalog.stored_bytes(entries), "verify") as bar:
        for e in entries:
            problems = catalog.verify(e, bar.update)
            report.append({"step": e.step, "path": e.path, "ok": not problems, "problems": problems,
                           "files": e.files, "checked": e.state != "plain"})
    if args.json:
        say(json.dumps(report, indent=1))
    else:
        for r in report:
            verdict = ("OK" if r["checked"] else "NOT CHECKED (the Trainer's own save: no manifest)") if r["ok"] \
                else "DAMAGED"
            say(f"step {r['step']}: {verdict}  ({r['files']} files)  {r['path']}")
            for p in r["problems"]:
                say(f"    {p}")
    return 1 if any(not r["ok"] for r in report) else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from easyckpt.cli.contents import describe
    cat = catalog.require(args.dir, args.framework)
    entry = cat.step(args.step)
    info = describe(entry, _progress(args))
    # a damaged manifest lists nothing that can be trusted: the step is shown (why), and the exit says so
    status = 1 if entry.state == "damaged" and (entry.why or "").startswith(catalog.DAMAGED_MANIFEST) else 0
    if args.json:
        say(json.dumps(info, indent=1, default=str))
        return status
    man = info["metadata"]["manifest"]
    say(f"step {info['step']}  {info['path']}")
    say(f"  {info['framework']}, {_layout(info['layout'])} (world {info['layout'].get('world', '-')}), "
          + ("complete" if info["complete"] else f"NOT COMPLETE: {info['why']}"))
    if man:
        say(f"  committed {_when(man.get('created', 0))} by job {man.get('job_id')}, checksums {man.get('checksum')}")
    total = sum(g["bytes"] for g in info["groups"].values()) or 1
    say("bytes by group")
    for name, g in info["groups"].items():
        say(f"  {name:<10} {_size(g['bytes']):>10}  {100 * g['bytes'] / total:5.1f} %  {g['tensors']} tensors")
    say(f"files ({len(info['files'])})")
    for f in info["files"]:
        extra = f"  NOT LOADED: {f['not_loaded']}" if "not_loaded" in f else f"  {f['tensors']} tensors"
        say(f"  {f['file']:<60} {f['format']:<12} {_size(f['bytes']):>10}{extra}")
    shown = info["tensors"] if args.limit == 0 else info["tensors"][:args.limit]
    say(f"tensors ({len(info['tensors'])})")
    for t in shown:
        say(f"  {t['group']:<9} {t['dtype']:<9} {str(t['shape']):<18} {_size(t['bytes']):>10}  {t['file']}: {t['key']}")
    if len(shown) < len(info["tensors"]):
        say(f"  ... {len(info['tensors']) - len(shown)} more (--limit 0 lists them all)")
    for name, value in info["args"].items():
        say(f"saved arguments: {name}")
        items = value.items() if isinstance(value, dict) else [("", value)]
        for k, v in sorted(items, key=lambda kv: str(kv[0])):
            say(f"  {k} = {json.dumps(v, default=str)}")
    meta = {k: v for k, v in info["metadata"].items() if k != "manifest"}
    if man or meta:
        say("metadata")
        for k, v in sorted(man.items()):
            say(f"  manifest.{k} = {json.dumps(v, default=str)}")
        for rel, fields in sorted(meta.items()):
            say(f"  {rel}: {json.dumps(fields, default=str)}")
    return status


def cmd_prune(args: argparse.Namespace) -> int:
    """The agent's rules (retention.py): only step directories committed by one job, never the newest,
    the Trainer's best checkpoint kept; the job's lock is taken so that a running job is never pruned
    under its feet."""
    from easyckpt.storage.auditlog import AuditLog
    if args.keep < 1:
        print("easyckpt prune: --keep must be at least 1 (the newest checkpoint is never deleted)", file=sys.stderr)
        return 2
    cat = catalog.require(args.dir, args.framework)
    jobs = sorted({e.job_id for e in cat.entries if e.complete and not e.staging and e.job_id})
    sd = _prune_target(args, cat, jobs)
    if sd is None:
        return 2
    job = sd._job()
    manifests = sd.committed_manifests(own=True)
    committed = [(step, path) for step, path, _ in manifests]
    policy = retention.KeepLast(args.keep, retention.protected(manifests[0][2]))
    doomed = policy.to_delete(committed)
    # the newest step stays whatever --keep says: it must verify (every byte) before anything older goes, or a
    # silently damaged newest step would be all that is left (docs/reliability.md promise 12)
    if doomed and not args.dry_run:
        problems = catalog.verify(catalog.step_entry(committed[0][0], committed[0][1], cat.framework))
        if problems:
            print(f"easyckpt prune: the newest step kept, {committed[0][1]}, fails verification: "
                  f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}. Nothing was deleted: the older "
                  f"steps may be the only intact ones (`easyckpt verify {args.dir}` checks them all)", file=sys.stderr)
            return 1
    others = [j for j in jobs if j != job]
    report: Dict[str, Any] = {"job_id": job, "keep": args.keep, "dry_run": args.dry_run,
                              "kept": [s for s, _ in committed if s not in {d for d, _ in doomed}],
                              "deleted": [], "would_delete": [s for s, _ in doomed] if args.dry_run else [],
                              "other_jobs_untouched": others}
    if not args.dry_run and doomed:
        lock = jobfiles.prune_lock(args.dir, job)
        holder = lock.acquire()
        if holder is not None:
            print(f"easyckpt prune: {holder} is running on {args.dir} and prunes after each commit itself; "
                  f"stop it first, or set max_ckpt_num", file=sys.stderr)
            return 1
        log = AuditLog(args.log_file or os.path.join(jobfiles.node_dir(args.dir, job), "easyckpt-prune.log"), "cli",
                       history=False)       # (its own deletes, a few lines a run: nothing to rotate them away)
        try:
            report["deleted"] = retention.prune(sd, policy, log)
        finally:
            log.close()
            lock.release()
        report["log_file"] = log.path
    if args.json:
        say(json.dumps(report, indent=1))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    steps = report["would_delete"] if args.dry_run else report["deleted"]
    for s in steps:
        say(f"{verb} step {s}")
    say(f"kept steps {', '.join(map(str, report['kept'])) or 'none'} of job {job}"
          + (f"; every delete logged to {report['log_file']}" if report.get("log_file") else "")
          + (f"; other jobs' checkpoints untouched ({', '.join(others)})" if others else ""))
    return 0


def _prune_target(args: argparse.Namespace, cat: catalog.Catalog, jobs: List[str]) -> Optional[SaveDir]:
    """The save directory as the job to prune sees it (--job-id, else the newest commit's job); None, said
    on stderr, when there is none."""
    job = args.job_id or (next((e.job_id for e in cat.entries if e.complete and e.job_id), None))
    if job is None:
        print(f"easyckpt prune: {args.dir} holds no complete checkpoint committed by easyckpt: nothing it may prune",
              file=sys.stderr)
        return None
    if args.job_id and args.job_id not in jobs:
        print(f"easyckpt prune: no checkpoint of job {args.job_id} in {args.dir} (jobs: {', '.join(jobs) or 'none'})",
              file=sys.stderr)
        return None
    newest = next(e for e in cat.entries if e.complete and e.job_id == job)
    # the job's name, where its manifests carry one: the steps of a copied or moved directory are the job's too
    return SaveDir(args.dir, catalog.naming(cat.framework), job,
                   job_name=man.job if (man := stepfiles.read(newest.path)) is not None else None)


def cmd_convert(args: argparse.Namespace) -> int:
    framework = "megatron" if args.what == "megatron-distopt" else args.framework
    cat = catalog.require(args.dir, framework)
    entry = cat.step(args.step)
    if not entry.complete:
        print(f"easyckpt convert: step {entry.step} is not a complete checkpoint ({entry.why}); "
              f"`easyckpt ls {args.dir}` lists the complete ones", file=sys.stderr)
        return 1
    in_store = not storage_for(entry.path).local
    if in_store and (args.what == "megatron-distopt" or not args.output or is_url(args.output)):
        print(f"easyckpt convert: {args.dir} is in an object store, where a committed step is never changed: give "
              f"--output a local path" + (" (megatron-distopt writes into the step itself: copy the step to a disk "
                                          "first)" if args.what == "megatron-distopt" else ""), file=sys.stderr)
        return 1
    if args.base_model is not None and (args.what != "safetensors" or cat.framework != "transformers"
                                        or (args.output or "").endswith(".safetensors")):
        print("easyckpt convert: --base-model merges a PEFT adapter of a Trainer checkpoint into its base model, "
              "written as a from_pretrained folder (not a .safetensors --output)", file=sys.stderr)
        return 1
    try:
        if args.what == "megatron-distopt":
            from easyckpt.cli.convert import to_megatron_distrib_optim
            summary: Dict[str, Any] = {"written": to_megatron_distrib_optim(entry.path)}
        elif (args.output or "").endswith(".safetensors") or (args.output is None and cat.framework != "transformers"):
            from easyckpt.cli.consolidate import to_safetensors
            output = args.output or os.path.join(entry.path, "consolidated.safetensors")
            summary = to_safetensors(entry.path, output, progress=_progress(args))
        else:
            from easyckpt.cli.pretrained import to_pretrained
            summary = to_pretrained(entry.path, args.output, progress=_progress(args), base_model=args.base_model)
    except ValueError as exc:
        print(f"easyckpt convert: {exc}", file=sys.stderr)
        return 1
    summary = {"step": entry.step, "source": entry.path, **summary}
    if args.json:
        say(json.dumps(summary, indent=1))
    else:
        for path in summary.get("written") or [summary["output"]]:
            say(f"wrote {path}")
        if summary.get("load"):       # an adapter loads only onto its base model (pretrained.py says how)
            say(f"load it with: {summary['load']}")
        elif args.what == "safetensors" and summary.get("written"):
            say(f"from_pretrained-ready: AutoModelForCausalLM.from_pretrained({summary['output']!r}) (or the "
                f"AutoModel class of its task)")
    return 0


def _convert_options(conv: argparse.ArgumentParser) -> None:
    conv.add_argument("--output", default=None,
                      help="safetensors: a Trainer checkpoint becomes a from_pretrained-ready folder (default: "
                           "consolidated/ in the step directory), a DeepSpeed one a file (default: "
                           "consolidated.safetensors in the step directory); a name ending in .safetensors: "
                           "that one file of weights, for either")
    conv.add_argument("--base-model", default=None, metavar="PATH",
                      help="safetensors, a PEFT adapter's checkpoint: merge the adapter into this base model (what "
                           "from_pretrained reads; checked against the checksum recorded in training) and write the "
                           "merged model's folder (default: the adapter's folder, for PeftModel.from_pretrained)")


def _verb(sub: Any, name: str, fn: Callable[[argparse.Namespace], int], help: str, step: bool = False,
          what: Optional[List[str]] = None) -> argparse.ArgumentParser:
    """A verb over a save directory, with the options every such verb takes."""
    p = sub.add_parser(name, help=help, description=help)
    if what:
        p.add_argument("what", choices=what)
    p.add_argument("dir", help="the save directory")
    if step:
        p.add_argument("step", nargs="?", type=int, help="default: the one the loader would pick")
    p.add_argument("--framework", default=None, choices=sorted(FRAMEWORKS), help="default: detected")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--progress", action="store_true", default=None, help="progress bar even off a terminal")
    p.add_argument("--endpoint-url", default=None, metavar="URL",
                   help="the S3-compatible endpoint of an s3:// DIR, as endpoint_url= in training (default: "
                        "AWS_ENDPOINT_URL, else boto3's own lookup)")
    p.set_defaults(fn=fn)
    return p


def _report_verb(sub: Any) -> None:
    from easyckpt.cli.report import cmd_report
    rep = _verb(sub, "report", cmd_report, "the audit log as a timeline: stall per snapshot step, persists, commits, "
                                           "skipped snapshots, starts, resumes, SIGTERM saves (HTML, or PNG with "
                                           "matplotlib)")
    rep.add_argument("-o", "--output", default=None, help="an .html file (default: DIR/easyckpt-report.html) or a "
                                                          ".png one (needs the report extra: matplotlib)")
    rep.add_argument("--log-file", default=None, help="the audit log (default: DIR/easyckpt.log)")


def main(argv: Optional[List[str]] = None) -> int:
    from easyckpt import __version__
    parser = argparse.ArgumentParser(prog="easyckpt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"easyckpt {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    verb = functools.partial(_verb, sub)

    ls = verb("ls", cmd_ls, "one row per checkpoint: step, time, size, layout, complete or why not; the loader's pick")
    ls.add_argument("--verify", action="store_true", help="check checksums too (reads every byte)")
    ins = verb("inspect", cmd_inspect, "tensors with shapes and dtypes, bytes by group, saved arguments, metadata",
               step=True)
    ins.add_argument("--limit", type=int, default=40, help="tensors listed (0: all; --json lists all)")
    verb("verify", cmd_verify, "sizes and checksums of every file; exit 1 on damage, naming the file", step=True)
    pr = verb("prune", cmd_prune, "keep the newest N committed checkpoints of a job, with the agent's rules")
    pr.add_argument("--keep", type=int, required=True, help="committed checkpoints to keep (at least 1)")
    pr.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    pr.add_argument("--job-id", default=None, help="the job whose checkpoints to prune (default: the newest's)")
    pr.add_argument("--log-file", default=None, help="audit log of the deletes (default: DIR/easyckpt-prune.log)")
    st = verb("status", cmd_status, "the node agent, snapshots in memory, the newest checkpoint, /dev/shm")
    st.add_argument("--job-name", default=None, help="the job_name given to initialize_easyckpt, if any")
    st.add_argument("--local-dir", default=None, help="the job's local_dir, where it has one of its own (its local "
                                                       "tier is there; default: the job's default local_dir)")
    conv = verb("convert", cmd_convert, "megatron-distopt: per-DP optimizer shards -> Megatron's distrib_optim.pt; "
                                       "safetensors: an HF or DeepSpeed ZeRO checkpoint -> consolidated weights",
                step=True, what=["megatron-distopt", "safetensors"])
    _convert_options(conv)
    _report_verb(sub)
    from easyckpt.cli.launcher import add_parser as add_run
    add_run(sub)
    args = parser.parse_args(argv)
    if getattr(args, "endpoint_url", None):
        resolve.set_endpoint(args.endpoint_url)     # as a job's Config(endpoint_url=...) sets it (config.py)
    saying.to(sys.stdout)
    try:
        # `run` passes its command's output through as it is
        with contextlib.redirect_stdout(sys.stderr) if args.cmd != "run" else contextlib.nullcontext():
            return args.fn(args)
    except CatalogError as exc:
        print(f"easyckpt {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except EasyCkptError as exc:      # a damaged checkpoint met on a path not reported above: one line
        print(f"easyckpt {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
