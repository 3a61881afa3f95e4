"""The order of runs never depends on wall clocks (issue 49, item 2): a run that started later is later,
whatever its ranks' clocks said, and a commit whose step vanished fails at once, naming why.

A run's rank 0 clock a day ahead (an NTP step on one node is enough) is simulated by what that run leaves on
disk: its manifests' start stamp ("run", rank 0's wall clock at the start) a day ahead. The real trainer
(tests/worker_pytorch.py) and the real agent run in processes.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

import pytest
from harness import TIMEOUT, committed_steps, events, run, train_cmd, wait_no_agent
from test_storage_units import JOB, LOG, intact, stage

from easyckpt.config import Config
from easyckpt.engine.link.agentview import AgentView
from easyckpt.errors import AgentError
from easyckpt.formats.layout import NAMINGS
from easyckpt.formats.replies import StatusReply
from easyckpt.ipc import jobkey, shm
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


class _Link:
    """engine/seams.AgentLink of an agent whose status says it deleted ``step`` after committing it."""
    agent_pid = None

    def __init__(self, deleted):
        self.deleted = deleted

    def status(self, timeout):
        return StatusReply(commits=[(80, 1, 0.1)], deleted_steps=self.deleted)

    def alive(self):
        return True


class _Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_a_step_deleted_right_after_its_commit_fails_finalize_at_once_naming_why(tmp_path, monkeypatch):
    """The engine and the real agent in one interpreter (tests/inproc.py): the job's retention deletes the step
    finalize waits for right after committing it (as the clock-ordered retention did to every commit of a
    later run). finalize fails within seconds, saying the step was committed, then deleted by retention; the
    agent's status names each step it pruned (before: finalize waited commit_timeout, then said "its staging
    directory never appeared or is gone")."""
    from inproc import model_and_optimizer, node, ranks, state, train_step

    from easyckpt.agent import jobdir

    real_prune = jobdir.retention.prune

    def newest_deleted_too(sd, policy, log):     # what ordering runs by a clock a day ahead did
        deleted = real_prune(sd, policy, log)
        (step, path), *_ = sd.committed(own=True)
        if step == 6:
            sd.delete_dir(path, log, "retention", step=step)
            deleted.append(step)
        return deleted

    monkeypatch.setattr(jobdir.retention, "prune", newest_deleted_too)
    cfg = Config(save_dir=str(tmp_path / "ckpt"), save_mem_interval=1, save_storage_interval=2, max_ckpt_num=1,
                 autocheckpoint_on_sigterm=False, commit_timeout=20)

    def body(ckpt, group):
        model, opt = model_and_optimizer()
        for step in range(1, 7):
            train_step(model, opt, step)
            ckpt.save(step, state(ckpt, model, opt, step), optimizer=opt)
        t0 = time.monotonic()
        with pytest.raises(AgentError) as failed:
            ckpt.finalize()
        return time.monotonic() - t0, str(failed.value), ckpt.engine.client.status(2.0)

    try:
        with node(cfg) as local:
            (took, said, status), = ranks(cfg, local, 1, body, timeout=60)
    finally:     # a failed finalize keeps the snapshots (a restart resumes from them): this test has none to do
        for path in shm.segments_of(cfg.job_id):
            shm.unlink_quiet(path)
        jobkey.remove(cfg.job_id)
    assert "step 6 was committed, then deleted: retention deleted it after the commit of step 6" in said, said
    assert took < 5, f"finalize waited {took:.1f} s for a step that was deleted"
    assert sorted(status.deleted_steps) == [2, 4, 6], status.deleted_steps
    assert "after the commit of step 4" in status.deleted_steps[2]


def test_a_commit_deleted_before_the_trainer_saw_it_ends_the_wait_at_once_naming_why(tmp_path):
    """The agent committed step 80, then retention deleted it (as the clock-ordered retention did): a trainer
    waiting for that commit stops within one status question (0.25 s), saying it was committed, then deleted,
    and why; before, it waited commit_timeout and said "its staging directory never appeared or is gone"."""
    cfg = Config(save_dir=str(tmp_path / "ckpt"), commit_timeout=600)
    (tmp_path / "ckpt").mkdir()
    why = "retention deleted it after the commit of step 80 (max_ckpt_num=2 ...)"
    clock = _Clock()
    view = AgentView(cfg, 0, 1, _Link({80: why}), SaveDir.of(cfg), AuditLog(None, "rank0"), clock)
    with pytest.raises(AgentError, match="step 80 was committed, then deleted: retention deleted it"):
        view.wait_committed(80, 600.0, agent_died=lambda: None)
    assert clock.now < 1.0, f"the wait went on for {clock.now:.1f} s"


class _SlowLink:
    """An AgentLink whose agent answers each status question only once the test lets it (``answer``)."""
    agent_pid = None

    def __init__(self):
        self.asked, self.go = 0, threading.Event()

    def status(self, timeout):
        self.asked += 1
        reply = StatusReply(commits=[(5 * self.asked, 1, 0.1)])
        if not self.go.wait(timeout=30):
            return None
        return reply

    def alive(self):
        return True


def test_the_status_after_a_persist_request_is_asked_without_the_training_thread_waiting(tmp_path):
    """After a persist request the agent's status is asked on a thread of its own: the training thread goes on
    while the agent's loop is busy (it waited 3.6 ms a request at pt10), takes the answer in at a later poll, and
    asks again only once that answer is in; an answer older than a status() the training thread asked itself is
    dropped."""
    cfg = Config(save_dir=str(tmp_path / "ckpt"))
    (tmp_path / "ckpt").mkdir()
    link, clock = _SlowLink(), _Clock()
    view = AgentView(cfg, 0, 1, link, SaveDir.of(cfg), AuditLog(None, "rank0"), clock)
    seen = []
    view.on_status.append(lambda reply: seen.append([c[0] for c in reply.commits]))
    view.requested(5)
    view.after_request()                 # returns while the agent has not answered (it cannot before go is set)
    asking = view._asking
    assert asking is not None and asking[0].is_alive() and not link.go.is_set()
    clock.now += 1.0
    view.poll(5)                         # nothing in yet, and no second question while one is out
    assert seen == [] and view._asking is asking
    deadline = time.monotonic() + 10
    while link.asked < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.asked == 1
    link.go.set()
    while view._asking is not None and view._asking[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    view.poll(5)                         # the answer is taken in on this (the training) thread
    assert seen == [[5]]
    # a question out, then a status() of the training thread's own: the older answer is dropped when it lands
    link.go.clear()
    clock.now += 1.0
    view.after_request()
    link.go.set()
    assert view.status() is not None
    view._asking[0].join(timeout=10)
    view.poll(5)
    assert len(seen) == 2, seen
