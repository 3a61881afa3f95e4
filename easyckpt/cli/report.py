"""``easyckpt report DIR [-o FILE]``: the audit log (auditread.py reads it, untrusted) as a timeline.

What is drawn, against the training step:
    stall      each snapshot's time in the training thread (the ``snapshot`` events' seconds; the slowest rank's
               where several ranks snapshot the step), one mark per step of each run, coloured by run
    skipped    the steps whose snapshot was skipped (``skip`` events: both slots still being persisted)
    persist    the agent's write of each step (``persist`` events; the slowest rank's) and its commit
               (``commit`` events)
    events     each start or resume (``load``), each SIGTERM save (``sigterm_save``), each trainer the agent lost
               (``trainer_lost``: a kill or crash), each error that names a step, as labelled lines

A run begins at each rank-0 ``load`` event (every start loads, or says it found nothing), so the steps a resume
does again are drawn again, in the new run's colour (timeline.py builds what is drawn). The HTML file is
self-contained: an inline SVG (timeline_svg.py draws it, no dependency); FILE ending in .png is drawn by
matplotlib, the ``report`` extra. The file is written through the storage layer (temp, fsync, rename).
"""
from __future__ import annotations

import argparse
import html
import json
import os
import sys
from dataclasses import asdict

from easyckpt.cli import auditread, timeline_svg
from easyckpt.cli.saying import say
from easyckpt.cli.timeline import Timeline, build
from easyckpt.config import DEFAULT_LOG_NAME
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.resolve import is_url

REPORT_NAME = "easyckpt-report.html"
PNG_EXTRA = "pip install 'easyckpt[report]' (matplotlib)"


def to_html(tl: Timeline, title: str) -> str:
    n_snap = len(tl.stalls)
    total = sum(ms for _, _, ms in tl.stalls)
    rows = "".join(f"<tr><td>{m.step}</td><td>{html.escape(m.kind)}</td><td>{html.escape(m.label)}</td></tr>"
                   for m in tl.marks)
    skipped = ""
    if tl.skipped_lines:
        why = "".join(f"<li>{html.escape(w)}</li>" for w in tl.why_skipped)
        skipped = f"<p class='bad'>{tl.skipped_lines} line(s) of the log were skipped:</p><ul>{why}</ul>"
    runs = "".join(f"<li style='color:{timeline_svg.run_colour(i)}'>run {i + 1}: {html.escape(r)}</li>"
                   for i, r in enumerate(tl.runs))
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:20px} td,th{padding:2px 10px;text-align:left}"
            ".bad{color:#b00}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>from {html.escape(tl.log)}</p>"
            f"<table><tr><th>snapshot steps</th><td>{n_snap}</td></tr>"
            f"<tr><th>stall in all</th><td>{total:.2f} ms</td></tr>"
            f"<tr><th>skipped snapshots</th><td>{len(tl.skips)}</td></tr>"
            f"<tr><th>persisted steps</th><td>{len(tl.persists)}</td></tr>"
            f"<tr><th>commits</th><td>{len(tl.commits)}</td></tr></table>"
            f"<ul>{runs}</ul>{skipped}\n{timeline_svg.svg(tl)}\n"
            f"<h2>events</h2><table><tr><th>step</th><th>kind</th><th>what</th></tr>{rows}</table>"
            "</body></html>\n")


def _write(path: str, data: bytes) -> None:
    # temp file, fsync, rename (storage/posix.py): never written through a symlink or into a FIFO planted under
    # the output's name, and a reader sees the previous report or the whole new one
    PosixStorage().write_atomic(path, data)


def cmd_report(args: argparse.Namespace) -> int:
    if is_url(args.dir) and not args.log_file:
        print(f"easyckpt report: {args.dir} is in an object store; give the audit log's local path with --log-file "
              f"(the job's log_file_path)", file=sys.stderr)
        return 2
    if is_url(args.dir) and not args.output:
        print(f"easyckpt report: {args.dir} is in an object store; name the report's local file with -o",
              file=sys.stderr)
        return 2
    log = args.log_file or os.path.join(args.dir, DEFAULT_LOG_NAME)
    output = args.output or os.path.join(args.dir, REPORT_NAME)
    png = output.lower().endswith(".png")
    if png and not timeline_svg.has_matplotlib():
        print(f"easyckpt report: {output}: a PNG is drawn by matplotlib, which is not installed: {PNG_EXTRA}; "
              f"or name an .html output", file=sys.stderr)
        return 2
    try:
        read = auditread.read(log)
    except OSError as exc:
        print(f"easyckpt report: cannot read the audit log {log}: {exc}", file=sys.stderr)
        return 2
    if not read.events:
        print(f"easyckpt report: {log} holds no event easyckpt wrote ({read.skipped} line(s) skipped"
              + (f"; {'; '.join(read.why)}" if read.why else "") + ")", file=sys.stderr)
        return 1
    tl = build(read)
    try:
        _write(output, timeline_svg.png(tl) if png else to_html(tl, f"easyckpt report: {args.dir}").encode())
    except OSError as exc:
        print(f"easyckpt report: cannot write {output}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        say(json.dumps({"output": output, **asdict(tl)}, indent=1))
    else:
        say(f"wrote {output}: {len(tl.stalls)} snapshot steps, {len(tl.skips)} skipped, {len(tl.persists)} "
            f"persisted, {len(tl.commits)} commits, {len(tl.marks)} events"
            + (f"; {read.skipped} line(s) of the log skipped ({read.why[0]})" if read.skipped else ""))
    return 0

