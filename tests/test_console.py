"""The console lines (easyckpt/console.py, engine/link/reports.py, the audit log's warnings), in process.
What a real run prints is checked in test_resume.py, test_preemption.py and the framework tests."""
from __future__ import annotations

import logging

import pytest

from easyckpt import console
from easyckpt.engine.link.reports import StatusReports
from easyckpt.formats.layout import NAMINGS
from easyckpt.formats.replies import status_from_wire
from easyckpt.storage.auditlog import AuditLog


def test_rank_0_says_events_and_every_rank_its_warnings(capsys):
    console.install(0)
    console.info("resumed step 12 from memory")
    console.warning("easyckpt: a warning")
    assert capsys.readouterr().err == "easyckpt: resumed step 12 from memory\neasyckpt: a warning\n"
    console.install(3)          # a second engine in the process adds no second handler
    assert len(console.logger.handlers) == 1
    console.logger.handlers.clear()
    console.install(3)
    console.info("resumed step 12 from memory")
    console.error("step 5 was not committed")
    assert capsys.readouterr().err == "easyckpt [rank 3]: step 5 was not committed\n"


def test_megatron_lines_go_to_stdout_as_print_rank_0(capsys):
    console.install(0, to_stdout=True)
    console.info("iter_0000005 committed")
    out = capsys.readouterr()
    assert out.out == "easyckpt: iter_0000005 committed\n" and out.err == ""


def test_the_user_sets_the_level_and_routes_the_lines(capsys):
    console.logger.setLevel(logging.WARNING)
    console.install(0)
    console.info("not shown")
    console.warning("shown")
    assert capsys.readouterr().err == "easyckpt: shown\n"

    console.logger.handlers.clear()
    console.logger.setLevel(logging.NOTSET)
    seen = []

    class Mine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.levelname, record.getMessage()))

    console.logger.addHandler(Mine())
    console.install(0)       # the application's handler is kept, and none added
    console.info("resumed step 3 from storage")
    assert seen == [("INFO", "resumed step 3 from storage")] and len(console.logger.handlers) == 1
    assert capsys.readouterr().err == ""


def test_a_line_said_while_a_progress_bar_is_drawn_does_not_tear_it(capsys):
    tqdm = pytest.importorskip("tqdm", reason="tqdm is not installed (it comes with transformers)")
    console.install(0)
    bar = tqdm.tqdm(total=10, desc="train", file=None, ascii=True)     # file=None: sys.stderr
    try:
        bar.update(3)
        console.info("checkpoint-3 committed")
        bar.update(1)
    finally:
        bar.close()
    err = capsys.readouterr().err
    # tqdm.write clears the bar's line first, so the message starts a line of its own
    assert "\neasyckpt: checkpoint-3 committed\n" in "\n" + err.replace("\r", "\n"), repr(err)
    assert "3/10" in err and "4/10" in err


def test_audit_warnings_and_errors_are_readable_lines_and_the_rest_is_debug(tmp_path, capsys):
    console.install(0)
    log = AuditLog(str(tmp_path / "audit.jsonl"), "rank0")
    log.emit("snapshot", step=4, bytes=100)
    log.emit("skip", step=5, message="rank 0: snapshot of step 5 skipped: both slots are busy")
    log.emit("error", step=6, rank=0, message="easyckpt: step 6 was not committed: disk full")
    log.emit("error", step=7)
    log.record("error", step=8, message="said by the caller in its own words")
    assert capsys.readouterr().err == ("easyckpt: rank 0: snapshot of step 5 skipped: both slots are busy\n"
                                       "easyckpt: step 6 was not committed: disk full\n"
                                       "easyckpt: error: step=7\n")
    console.logger.setLevel(logging.DEBUG)      # DEBUG: every event, as its JSON line
    log.emit("snapshot", step=9, bytes=100)
    log.close()
    assert capsys.readouterr().err.count('"event": "snapshot", "source": "rank0"') == 1
    assert len((tmp_path / "audit.jsonl").read_text().splitlines()) == 6


def test_status_reports_say_each_commit_once_and_ignore_what_is_malformed(tmp_path, capsys):
    console.install(0)
    log = AuditLog(None, "rank0")
    reports = StatusReports(0, NAMINGS["transformers"], log)
    reports.take(status_from_wire({"commits": [[5, 1024, 0.5]]}))
    assert capsys.readouterr().err == ""              # no request of this run yet: an earlier run's commit
    reports.requested(10)
    assert reports.waiting(10)
    bad = [[10, "x", 0.1], [11, -1, 0.1], ["12", 1, 0.1], [13, 1], "14", [15, 2048, None]]
    reports.take(status_from_wire({"commits": [[5, 1024, 0.5], [10, 1536, 0.25]] + bad, "failed_steps": {"9": "disk full", "x": 1}}))
    reports.take(status_from_wire({"commits": [[10, 1536, 0.25]], "failed_steps": {"9": "disk full"}}))
    assert capsys.readouterr().err == ("easyckpt: checkpoint-10 committed (1.5 KiB, written in 0.25 s)\n"
                                       "easyckpt: step 9 was not committed: disk full; training goes on and "
                                       "later steps are still saved\n")
    assert not reports.waiting(10)
    reports.requested(15)
    assert reports.waiting(15)
    reports.take(status_from_wire({"failed_steps": {"15": "disk full"}}))      # a failed step is not polled for
    assert not reports.waiting(15)
    capsys.readouterr()
    reports.requested(20)       # later steps in flight while 16 commits: the normal asynchronous case, said bare
    reports.take(status_from_wire({"commits": [[16, 1024, 0.5]]}))
    assert capsys.readouterr().err == "easyckpt: checkpoint-16 committed (1.0 KiB, written in 0.50 s)\n"
    reports.announce(25)        # "SIGTERM: saving step 25" said before 17's commit is learned
    reports.requested(25)
    reports.take(status_from_wire({"commits": [[17, 1024, 0.5]]}))
    assert capsys.readouterr().err == ("easyckpt: checkpoint-17 committed (1.0 KiB, written in 0.50 s; an earlier "
                                       "step, not the step 25 being saved)\n")
    reports.take(status_from_wire({"commits": "garbage", "failed_steps": ["9"], "refused": 2, "last_refused": [3, "rank 2 was refused"]}))
    assert capsys.readouterr().err == "easyckpt: agent: rank 2 was refused\n"
    other = StatusReports(1, NAMINGS["transformers"], log)
    other.requested(10)
    other.take(status_from_wire({"commits": [[10, 1536, 0.25]], "failed_steps": {"9": "disk full"}}))
    assert capsys.readouterr().err == "" and not other.waiting(10)


def test_a_burst_of_commit_lines_is_cut_to_five_in_ten_seconds_and_the_rest_counted(capsys):
    """A fast loop's persists, before they are paced, commit several times a second: five lines are said, the rest
    of the burst is counted in the next line said, after ten seconds or when a wait for a commit ends (flush)."""
    console.install(0)
    clock = [100.0]
    reports = StatusReports(0, NAMINGS["pytorch"], AuditLog(None, "rank0"), now=lambda: clock[0])
    reports.requested(1)

    def commit(*steps: int) -> str:
        for step in steps:
            reports.take(status_from_wire({"commits": [[step, 1024, 0.01]]}))
            clock[0] += 0.05
        return capsys.readouterr().err

    said = commit(*range(1, 10))
    assert [line.split()[1] for line in said.splitlines()] == [f"step_{s:08d}" for s in range(1, 6)], said
    reports.flush()                     # finalize's wait for the last commit: the newest is said, with the count
    assert capsys.readouterr().err == ("easyckpt: step_00000009 committed (1.0 KiB, written in 0.01 s; 3 more "
                                       "committed since the last line, listed in the audit log)\n")
    reports.flush()
    assert commit(10) == "" and capsys.readouterr().err == ""      # still in the burst, and nothing held to flush
    clock[0] += 10.0
    assert commit(11) == ("easyckpt: step_00000011 committed (1.0 KiB, written in 0.01 s; 1 more committed since "
                          "the last line, listed in the audit log)\n")
    clock[0] += 10.0
    assert commit(12) == "easyckpt: step_00000012 committed (1.0 KiB, written in 0.01 s)\n"


def test_skip_episodes_are_said_at_most_once_a_minute_and_the_quiet_ones_counted(tmp_path, capsys):
    """A store slower than the persists (the default save_storage_interval before the budget spaces them out)
    skips in episode after episode: the first is said (two lines), those that begin within QUIET_SECONDS of its
    end go to the audit log alone, and the next one said counts them. Every skip is in the audit log."""
    import json

    from easyckpt.engine.save.skips import QUIET_SECONDS, SkipEpisodes
    console.install(0)
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), "rank0")
    episodes = SkipEpisodes(0, 1, 5, log)
    now = 100.0

    def episode(first: int, skips: int) -> None:
        nonlocal now
        for k in range(skips):
            episodes.skipped(first + k, 2 + k, "both snapshot slots are still being persisted", now)
            now += 0.01
        episodes.resumed(first + skips, now, lambda: {})
        now += 0.05

    episode(10, 3)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and "snapshot of step 10 skipped" in said[0] and "resumed at step 13: 3 skipped" in said[1]
    episode(20, 2)
    episode(30, 4)
    assert capsys.readouterr().err == ""          # within a minute of the last one said
    now += QUIET_SECONDS
    episode(40, 1)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and "snapshot of step 40 skipped" in said[0], said
    assert "(2 more episode(s), 6 skip(s) in all, since the last one said are in the audit log alone)" in said[0]
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "skip"] == [10, 11, 12, 20, 21, 30, 31, 32, 33, 40]
    assert [r["skipped"] for r in records if r["event"] == "skips_ended"] == [3, 2, 4, 1]
