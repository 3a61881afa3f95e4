"""The history log (storage/auditlog.py): what was committed, deleted and moved aside, beside the audit log, so
that it outlives the audit log's rotations, which a snapshot line per step from every rank of a node brings
within hours."""
from __future__ import annotations

import json
import os
import stat

import pytest
from inproc import node, ranks, run_steps

from easyckpt.config import Config, validate
from easyckpt.errors import ConfigError
from easyckpt.storage import logcap
from easyckpt.storage.auditlog import AuditLog, history_path


def _events(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def test_what_was_committed_and_deleted_outlives_the_audit_logs_rotations(tmp_path, monkeypatch):
    monkeypatch.setattr(logcap, "MAX_LOG_BYTES", 4096)
    path = str(tmp_path / "easyckpt.log")
    log = AuditLog(path, "agent")
    try:
        log.record("commit", step=5, bytes=100, seconds=0.1)
        log.record("delete", path="/ckpt/step_00000001", reason="max_ckpt_num=1")
        for i in range(200):        # about 150 bytes a line: the audit log rotates several times
            log.record("snapshot", step=i, rank=0, slot=i % 2, bytes=411000, seconds=0.000123)
        rotated = _events(path + ".1") + _events(path)
        assert all(e["event"] == "snapshot" for e in rotated) and rotated[-1]["step"] == 199
        history = _events(history_path(path))
        assert [(e["event"], e.get("step"), e.get("reason")) for e in history] == [
            ("commit", 5, None), ("delete", None, "max_ckpt_num=1")]
        for i in range(100):        # the history log is capped the same way
            log.record("commit", step=i, bytes=100, seconds=0.1)
        hist = history_path(path)
        assert os.path.getsize(hist) <= 4096 + 200 and os.path.getsize(hist + ".1") <= 4096 + 200
        steps = [e["step"] for e in _events(hist + ".1") + _events(hist)]
        assert steps == list(range(steps[0], 100)), steps      # in order, none lost since the cut
    finally:
        log.close()
    assert history_path("/x/run.log") == "/x/run-history.log" and history_path("/x/audit") == "/x/audit-history.log"


def test_a_writer_silent_while_the_others_rotated_the_log_twice_writes_on_in_the_new_log(tmp_path, monkeypatch):
    """The agent writes a line a commit, the trainers a line a snapshot. When the trainers rotated the audit log twice
    between two commits, the agent's file was the one the second rotation replaced: its next line, and every one
    after, went into a file no one could read (the rotation saw neither name holding it and kept it). Now that line
    is written again in the new log, which the writer follows from then on."""
    monkeypatch.setattr(logcap, "MAX_LOG_BYTES", 4096)
    path = str(tmp_path / "easyckpt.log")
    trainer, agent = AuditLog(path, "rank0"), AuditLog(path, "agent")
    try:
        agent.record("commit", step=5, bytes=100, seconds=0.1)
        for i in range(100):        # about 150 bytes a line: two rotations and more
            trainer.record("snapshot", step=i, rank=0, slot=i % 2, bytes=411000, seconds=0.000123)
        agent.record("commit", step=105, bytes=100, seconds=0.1)
        agent.record("delete", path="/ckpt/step_00000005", reason="max_ckpt_num=1")
    finally:
        trainer.close()
        agent.close()
    kept = [(e["event"], e.get("step")) for e in _events(path + ".1") + _events(path) if e["event"] != "snapshot"]
    assert kept == [("commit", 105), ("delete", None)], kept


def test_a_fifo_planted_where_the_history_log_goes_is_refused_and_left_alone(tmp_path, capsys):
    """At start the job is refused, naming it (as for the audit log: docs/reliability.md promise 13); planted
    mid-run, it is never opened for writing (no wait for a reader), said once, and the audit log keeps the lines."""
    save = tmp_path / "ckpt"
    save.mkdir()
    path = str(save / "easyckpt.log")
    os.mkfifo(history_path(path))
    with pytest.raises(ConfigError, match=f"refusing {history_path(path)}: it is a FIFO"):
        validate(Config(save_dir=str(save)))
    log = AuditLog(path, "agent")
    try:
        log.record("commit", step=1, bytes=10, seconds=0.1)       # does not wait for a reader of the FIFO
        log.record("commit", step=2, bytes=10, seconds=0.1)
    finally:
        log.close()
    assert [e["step"] for e in _events(path)] == [1, 2]
    assert stat.S_ISFIFO(os.lstat(history_path(path)).st_mode)
    assert capsys.readouterr().err.count("cannot open the history log") == 1       # said once


def test_a_job_writes_its_commits_and_retentions_deletes_to_the_history_log(tmp_path):
    cfg = validate(Config(save_dir=str(tmp_path / "ckpt"), save_mem_interval=1, save_storage_interval=2,
                          max_ckpt_num=1, autocheckpoint_on_sigterm=False))

    with node(cfg) as local:
        assert ranks(cfg, local, 1, lambda ckpt, group: run_steps(ckpt, 6)) == [6]
    history = _events(history_path(str(cfg.audit_log)))
    assert [e["step"] for e in history if e["event"] == "commit"] == [2, 4, 6]
    deleted = [e["path"] for e in history if e["event"] == "delete"]
    # retention (max_ckpt_num=1) deleted steps 2 and 4, each logged by its directory's own name
    assert sorted(os.path.basename(p) for p in deleted) == [cfg.naming.dir_name(2), cfg.naming.dir_name(4)], deleted
    assert not any(e["event"] == "snapshot" for e in history)
