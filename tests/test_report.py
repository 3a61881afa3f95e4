"""``easyckpt report`` (cli/report.py): a real run's audit log, killed (-9), then SIGTERMed, then resumed to the end,
drawn as a timeline whose marks, labels and axes match that log; a hostile log (a FIFO, a symlink, a huge file,
garbage lines, fields of the wrong type) is refused or its bad lines skipped, never hanging."""
from __future__ import annotations

import json
import os
import re
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from harness import cli, cli_process, events, interrupted_runs, train_cmd, wait_no_agent

from easyckpt.cli import auditread, timeline_svg

ITERS, KILL_AT, TERM_AT = 20, 6, 12


def runs_of(log):
    """(run, step) -> the slowest rank's snapshot ms, runs split at rank 0's load events (as report.py does)."""
    stalls, run = defaultdict(float), -1
    for e in log:
        if e["event"] == "load" and e.get("rank", 0) == 0:
            run += 1
        elif e["event"] == "snapshot":
            stalls[(run, e["step"])] = max(stalls[(run, e["step"])], 1e3 * e["seconds"])
    return stalls


def test_a_killed_sigtermed_and_resumed_run_is_drawn_as_its_audit_log_says(tmp_path):
    save, loss = tmp_path / "save", tmp_path / "loss"
    cmd = train_cmd(save, 1, "--iters", str(ITERS), "--loss-file", str(loss), "--step-sleep", "0.05")
    interrupted_runs(cmd, loss, tmp_path, [(KILL_AT, signal.SIGKILL), (TERM_AT, signal.SIGTERM)])
    wait_no_agent(save)
    out = tmp_path / "report.html"
    said = cli("report", save, "-o", out).stdout
    page = out.read_text()
    log = events(save / "easyckpt.log")
    stalls = runs_of(log)
    # one mark per snapshot step of each run, with the figure the log holds
    marks = re.findall(r"<rect class='snapshot' data-step='(\d+)' data-run='(\d+)'[^>]*><title>snapshot of step "
                       r"\d+ \(run \d+\): ([\d.]+) ms</title>", page)
    assert len(marks) == len(stalls) and f"{len(stalls)} snapshot steps" in said
    assert {(int(r) - 1, int(s)): float(ms) for s, r, ms in marks} == pytest.approx(
        {k: round(v, 3) for k, v in stalls.items()}, abs=1e-3)
    assert len({r for r, _ in stalls}) == 3          # the first run, the one after kill -9, the one after SIGTERM
    # the resumes and the SIGTERM save, labelled with their steps as the log says
    term = next(e["step"] for e in log if e["event"] == "sigterm_save")
    assert TERM_AT <= term < ITERS
    assert re.search(rf"<g class='event' data-step='{term}' data-kind='sigterm'>.*SIGTERM save of step {term}<", page)
    resumed = [(e["step"], e["source"]) for e in log if e["event"] == "load" and e["source"] != "none"]
    assert len(resumed) == 2 and resumed[1] == (term, "storage")
    for step, source in resumed:
        assert re.search(rf"data-step='{step}' data-kind='resume'>.*resumed step {step} from {source}<", page)
    assert "start (no checkpoint)" in page
    assert "data-kind='lost'" in page                  # the agent lost the trainer killed -9
    # the axes: the stall axis tops the largest stall by less than a 1-2-5 step; the steps span the log's
    top = float(re.search(r"class='stall-axis' data-max='([\d.e+-]+)'", page).group(1))
    assert max(stalls.values()) <= top <= 2.5 * max(stalls.values())
    ticks = [int(t) for t in re.findall(r"<text class='xtick'[^>]*>(\d+)</text>", page.split("write-axis")[0])]
    steps = [e["step"] for e in log if e["event"] in ("snapshot", "persist", "commit") or
             (e["event"] == "load" and e.get("rank", 0) == 0)]
    assert ticks[0] == min(steps) and ticks[-1] == max(steps) == ITERS
    persisted = {e["step"] for e in log if e["event"] == "persist"}
    assert {int(s) for s in re.findall(r"<circle class='persist' data-step='(\d+)'", page)} == persisted
    assert len(re.findall(r"class='commit'", page)) == len([e for e in log if e["event"] == "commit"])


def _write_log(path: Path, lines) -> None:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines))


def _event(**fields):
    return {"time": 1.0, "event": "snapshot", "source": "rank0", "rank": 0, "seconds": 0.002, "bytes": 10, **fields}


def test_a_hostile_audit_log_is_refused_or_its_bad_lines_skipped_without_hanging(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    log = save / "easyckpt.log"
    # a FIFO: refused at once (a reader would wait for a writer forever), by a real process with a timeout
    os.mkfifo(log)
    said = cli_process("report", save, expect=2, timeout=60).stderr
    assert "not a regular file" in said and "FIFO" in said
    log.unlink()
    # a symlink to a file elsewhere: not followed
    elsewhere = tmp_path / "elsewhere.log"
    _write_log(elsewhere, [_event(step=1)])
    log.symlink_to(elsewhere)
    assert "not a regular file" in cli("report", save, expect=2).stderr
    log.unlink()
    # larger than any log easyckpt writes (it rotates near logcap's cap): refused before it is read
    with open(log, "wb") as f:
        f.truncate(auditread.MAX_BYTES + 1)
    assert "more than" in cli("report", save, expect=2).stderr
    log.unlink()
    # garbage: each bad line skipped and counted; what is drawn comes from the good lines only
    _write_log(log, [
        {"time": 0.5, "event": "load", "source": "none", "rank": 0, "step": 0},
        _event(step=1), _event(step=2, seconds=0.004),
        b"not json at all", b"\xff\xfe\x00binary", b"[1, 2, 3]", b"x" * (auditread.MAX_LINE + 1),
        _event(step="3"), _event(step=-4), _event(step=True), _event(step=5, seconds="fast"),
        b'{"time": 1.0, "event": "snapshot", "source": "rank0", "step": 6, "seconds": Infinity}',
        _event(step=7, time=None), _event(step=8, event=42), _event(step=2 ** 70),
        {"time": 2.0, "event": "error", "source": "rank0", "step": 2, "message": "<script>alert(1)</script>"},
    ])
    out = tmp_path / "r.html"
    said = cli("report", save, "-o", out).stdout
    assert "12 line(s) of the log skipped" in said
    page = out.read_text()
    assert re.findall(r"<rect class='snapshot' data-step='(\d+)'", page) == ["1", "2"]
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "12 line(s) of the log were skipped" in page
    # nothing easyckpt wrote: an error, naming why the lines were skipped
    _write_log(log, [b"garbage", _event(step="x")])
    said = cli("report", save, expect=1).stderr
    assert "holds no event easyckpt wrote (2 line(s) skipped" in said and "not JSON" in said


def test_the_commits_the_audit_logs_rotations_took_away_are_drawn_from_the_history_log(tmp_path, monkeypatch):
    """The audit log rotates near its cap, and a snapshot line a step takes the commits of a long job away with it;
    the history log beside it keeps them (storage/auditlog.py), and the report draws those older than the audit
    log's first line, once each. A history log planted as a FIFO is not read, said, and the audit log drawn."""
    from easyckpt.storage import logcap
    from easyckpt.storage.auditlog import AuditLog, history_path
    monkeypatch.setattr(logcap, "MAX_LOG_BYTES", 4096)
    save = tmp_path / "save"
    save.mkdir()
    trainer, agent = AuditLog(str(save / "easyckpt.log"), "rank0"), AuditLog(str(save / "easyckpt.log"), "agent")
    try:
        trainer.record("load", step=0, rank=0, source="none")
        agent.record("commit", step=5, bytes=10, seconds=0.25)
        for step in range(6, 206):      # the load and the commit rotated away from the log and its .1
            trainer.record("snapshot", step=step, rank=0, slot=step % 2, bytes=10, seconds=0.002)
        agent.record("commit", step=205, bytes=10, seconds=0.5)
    finally:
        trainer.close()
        agent.close()
    assert '"commit"' not in (save / "easyckpt.log.1").read_text()
    drawn = json.loads(cli("report", save, "--json").stdout)
    assert drawn["commits"] == [[5, 250.0], [205, 500.0]], drawn["commits"]
    assert drawn["runs"] == ["the log holds no start"]     # (the load went with the rotations: only commits, deletes,
                                                            # quarantines and SIGTERM saves are kept beside)
    history = Path(history_path(str(save / "easyckpt.log")))
    history.unlink()
    os.mkfifo(history)
    said = cli_process("report", save, "--json", timeout=60).stdout     # a real process: a FIFO must not hang it
    drawn = json.loads(said[said.index("{"):])
    assert drawn["commits"] == [[205, 500.0]] and "not read" in " ".join(drawn["why_skipped"]), drawn


def test_a_png_needs_the_report_extra_or_is_a_png(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    _write_log(save / "easyckpt.log", [_event(step=1), _event(step=2)])
    out = tmp_path / "r.png"
    if not timeline_svg.has_matplotlib():
        said = cli("report", save, "-o", out, expect=2).stderr
        assert "easyckpt[report]" in said and "matplotlib" in said and not out.exists()
        return
    cli("report", save, "-o", out)
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
