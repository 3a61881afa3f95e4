"""The order of runs never depends on wall clocks (issue 49, item 2): a run that started later is later,
whatever its ranks' clocks said, and a commit whose step vanished fails at once, naming why.

A run's rank 0 clock a day ahead (an NTP step on one node is enough) is simulated by what that run leaves on
disk: its manifests' start stamp ("run", rank 0's wall clock at the start) a day ahead. The real trainer
(tests/worker_pytorch.py) and the real agent run in processes.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from harness import TIMEOUT, committed_steps, events, run, train_cmd, wait_no_agent
from test_storage_units import JOB, LOG, intact, stage

from easyckpt.formats.layout import NAMINGS
from easyckpt.storage import stepfiles
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.commit import commit
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.retention import KeepLast, prune
from easyckpt.storage.savedir import SaveDir

DAY = 86400.0


def test_a_run_whose_clock_was_a_day_ahead_never_costs_the_next_run_its_commits(tmp_path):
    """Run 1, its rank 0's clock a day ahead, keeps steps 35 and 40 (max_ckpt_num 2). Run 2, clock right,
    resumes step 40 and commits 45 ... 80: its newest two stay, each of its other commits is deleted only once
    two newer ones are committed, and finalize returns at once (before: retention ordered steps by (rank 0's
    start clock, step), deleted each of run 2's commits right after it, and finalize waited commit_timeout
    for step 80, then failed: "its staging directory never appeared or is gone")."""
    save, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    common = ["--storage-interval", "5", "--max-ckpt", "2", "--idle-timeout", "2", "--commit-timeout", "30",
              "--step-sleep", "0.02", "--log-file", str(log)]
    run(train_cmd(save, 1, "--iters", "40", *common), timeout=TIMEOUT)
    wait_no_agent(save)
    first = committed_steps(save)
    assert len(first) == 2 and first[-1] == 40, first
    for path in save.glob("step_*/easyckpt_manifest.json"):   # what run 1 leaves with its clock a day ahead
        man = json.loads(path.read_text())
        man["info"]["run"] += DAY
        path.write_text(json.dumps(man, indent=1))

    before = len(events(log))
    t0 = time.monotonic()
    second = run(train_cmd(save, 1, "--iters", "80", *common), timeout=TIMEOUT, check=False)
    took = time.monotonic() - t0
    wait_no_agent(save)
    said = second.stdout + second.stderr
    assert second.returncode == 0 and "was not committed" not in said, said[-3000:]
    assert [e["step"] for e in events(log)[before:] if e["event"] == "load"] == [40]
    second_log = [(e["event"], e["step"]) for e in events(log)[before:] if e["event"] in ("commit", "delete")]
    commits = [s for event, s in second_log if event == "commit"]     # which, depends on the persists' pace
    assert commits and commits == sorted(commits) and commits[-1] == 80, second_log
    assert committed_steps(save) == commits[-2:], second_log
    deleted = [s for event, s in second_log if event == "delete"]
    assert sorted(deleted) == first + commits[:-2], second_log
    for step in commits[:-2]:        # each of run 2's steps deleted only once two newer ones were committed
        newer = [s for s in commits if s > step][:2]
        assert second_log.index(("commit", newer[1])) < second_log.index(("delete", step)), second_log
    assert took < 25, f"run 2 took {took:.1f} s: finalize waited for a commit that was deleted"


def _commit_in_run(sd: SaveDir, step: int, stamp: float, run_id: Optional[str]) -> None:
    stage(sd, step)
    marker = sd.read_markers(step)[0]
    info = {"run": stamp} if run_id is None else {"run": stamp, "run_id": run_id}
    sd.write_marker(step, 0, marker.files, info)        # what rank 0's engine records
    commit(sd, step, 1, LOG)


def _seq(sd: SaveDir, step: int) -> int:
    return stepfiles.read(sd.step_path(step)).run_seq


def test_runs_are_numbered_at_commit_and_ordered_by_number_whatever_their_clocks(tmp_path):
    """Steps an older easyckpt committed (no run number, ordered by their start stamps as before) are older than
    every numbered run; each run's first commit takes the job's newest run number + 1, its later commits the
    same; a run whose clock is a day behind the previous one's is still the newer; a newer run reaching an
    older run's step name sets it aside, and a fresh commit of a step in the same run replaces it."""
    sd = SaveDir(str(tmp_path), NAMINGS["deepspeed"], JOB, PosixStorage(), job_name="")
    for step, stamp in ((30, 2000.0 + DAY), (20, 1000.0)):     # an older version's two runs, the first's clock ahead
        _commit_in_run(sd, step, stamp, None)
        path = os.path.join(sd.step_path(step), "easyckpt_manifest.json")
        man = json.loads(open(path).read())
        man.pop("run_seq", None)                               # as an older easyckpt wrote it
        open(path, "w").write(json.dumps(man))
    assert [s for s, _ in sd.committed(own=True)] == [30, 20]   # as before: by stamp, then step
    _commit_in_run(sd, 5, 3000.0 + DAY, "run-a")              # the first numbered run: newer than every stamp
    _commit_in_run(sd, 10, 3000.0 + DAY, "run-a")
    _commit_in_run(sd, 15, 500.0, "run-b")                     # the next run, its clock two days behind
    assert [s for s, _ in sd.committed(own=True)] == [15, 10, 5, 30, 20]
    assert [(s, _seq(sd, s)) for s in (5, 10, 15)] == [(5, 1), (10, 1), (15, 2)]
    assert prune(sd, KeepLast(2), LOG) == [5, 30, 20]
    _commit_in_run(sd, 10, 500.0, "run-b")                     # run b reaches run a's name: set aside, kept
    assert [name for name, _ in sd.quarantined()] == ["global_step10"]
    _commit_in_run(sd, 10, 500.0, "run-b")                     # again in run b (a fresh snapshot): replaced
    assert len(sd.quarantined()) == 1 and intact(sd, 10) and _seq(sd, 10) == 2
    assert [s for s, _ in sd.committed(own=True)] == [15, 10]
