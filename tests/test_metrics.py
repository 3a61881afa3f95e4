"""The run's checkpointing figures (engine/link/metrics.py): checkpoint_metrics() and rank 0's summary line at the end of
a real run agree with what that run's audit log records; the HF Trainer's log_history carries them."""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import harness
import pytest
from harness import events, run, script_cmd, train_cmd, wait_no_agent

LOOP = Path(__file__).resolve().parent / "budget_loop.py"
SUMMARY = re.compile(r"run summary: newest committed step (\d+); (\d+) snapshots? \((\d+) skipped\), stall "
                     r"([\d.]+) ms in all, median ([\d.]+) ms; (\d+) persists?, (.+) written")


def test_the_summary_line_and_checkpoint_metrics_agree_with_the_audit_log(tmp_path):
    save, out = tmp_path / "save", tmp_path / "metrics.json"
    proc = run([sys.executable, str(LOOP), "--dir", str(save), "--steps", "40", "--sleep", "0.05",
                "--storage-interval", "10", "--metrics", str(out), "--out", str(tmp_path / "began.json")])
    wait_no_agent(save)
    said = SUMMARY.findall(proc.stdout + proc.stderr)
    assert len(said) == 1, proc.stdout + proc.stderr      # once, on rank 0, at finalize
    committed, snaps, skipped, total_ms, median_ms, persists, written = said[0]
    log = events(save / "easyckpt.log")
    mine = [e for e in log if e.get("source") == "rank0"]
    snapshots = [e for e in mine if e["event"] == "snapshot"]
    commits = [e for e in log if e["event"] == "commit"]
    persisted = [e for e in log if e["event"] == "persist" and e.get("rank") == 0]
    assert int(snaps) == len(snapshots) == 40 and int(skipped) == len([e for e in mine if e["event"] == "skip"])
    assert int(committed) == max(e["step"] for e in commits) == 40
    assert int(persists) == len(persisted) == 4          # steps 10, 20, 30, 40; finalize's step 40 was one
    seconds = [e["seconds"] for e in snapshots]
    assert abs(float(total_ms) - 1e3 * sum(seconds)) < 0.01
    # the figures written to the audit log at the end are the ones the loop read last
    final = json.loads(out.read_text())[-1]
    recorded = next(e for e in mine if e["event"] == "metrics")
    assert {k[len("easyckpt/"):]: v for k, v in final.items()} == {
        k: v for k, v in recorded.items() if k not in ("time", "event", "source", "host", "pid", "rank")}
    assert final["easyckpt/snapshots"] == 40 and final["easyckpt/persists"] == 4
    assert final["easyckpt/commits"] == len(commits) == 4 and final["easyckpt/committed_step"] == 40
    assert final["easyckpt/stall_median_s"] == pytest.approx(statistics.median(seconds))
    assert final["easyckpt/stall_total_s"] == pytest.approx(sum(seconds))
    assert abs(1e3 * final["easyckpt/stall_median_s"] - float(median_ms)) < 0.01
    # the last commit may be seen in the save dir before its status reply brings its bytes: not counted then
    committed_bytes = sum(e["bytes"] for e in commits)
    assert final["easyckpt/bytes_written"] in (committed_bytes, committed_bytes - commits[-1]["bytes"])
    assert final["easyckpt/loss_bound_steps"] == 0          # every step snapshotted: a crash loses none
    assert 0 <= final["easyckpt/commit_latency_s"] < 30
    # read while training: counts only grow, the stall is never negative
    during = json.loads(out.read_text())[:-1]
    # (a snapshot whose copy overlaps the next step counts once that copy is done: up to one step later)
    assert all(n - 1 <= m["easyckpt/snapshots"] <= n for n, m in zip((10, 20, 30, 40), during))
    assert all(m["easyckpt/stall_total_s"] >= m.get("easyckpt/stall_s", 0) >= 0 for m in during)
    assert written.endswith("B")


HF = harness.ROOT / "examples" / "deepspeed" / "hf_train.py"


@pytest.mark.parametrize("form", ["wrapper", "callback"])
def test_the_trainers_log_history_carries_the_figures_in_both_forms(tmp_path, form):
    out = tmp_path / "out"
    # 0.2 s a step: rank 0 hears of a commit through a status question asked every 0.25 s at most, in the
    # background; at this model's 13 ms steps the seven steps after the commit of 5 were over before one answer
    # came back on a loaded CI machine (stop 63)
    run(script_cmd(HF, 1, "--output-dir", str(out), "--loss-file", str(tmp_path / "loss"), "--max-steps", "12",
                   "--step-sleep", "0.2", "--idle-timeout", "20", *(["--callback"] if form == "callback" else [])),
        timeout=300)
    wait_no_agent(out)
    # logging_steps=1 (hf_train.py): the log_history the committed checkpoint-12 holds has one entry a step
    history = [h for h in json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
               if "loss" in h]
    assert [h["step"] for h in history] == list(range(1, 13))
    assert all(h["easyckpt/stall_total_s"] >= 0 and h["easyckpt/snapshots_skipped"] == 0 for h in history)
    counts = [h["easyckpt/snapshots"] for h in history]
    assert counts == sorted(counts) and counts[-1] > 0
    assert all(h["easyckpt/stall_s"] >= 0 and h["easyckpt/stall_median_s"] >= 0 for h in history[2:])
    # a step is logged before it is snapshotted: the snapshots then taken are at most the steps before it
    log = events(out / "easyckpt.log")
    assert counts[-1] <= len([e for e in log if e["event"] == "snapshot" and e.get("step", 99) < 12])
    # checkpoint-5 (save_steps=5) committed during the run: seen by the logs that follow, as the audit log says
    commit5 = next(e["time"] for e in log if e["event"] == "commit" and e["step"] == 5)
    later = [h for h in history if "easyckpt/committed_step" in h]
    # step 12 is logged after the snapshots of the steps before it: a second between the commit and the last of
    # them leaves rank 0 four status questions to hear of it, unless the agent stopped answering (then rank 0 asks
    # no more for 10 s: agentview.py)
    before12 = max(e["time"] for e in log if e["event"] == "snapshot" and e.get("step", 99) < 12)
    silent = any(e["event"] == "warning" and "did not answer" in e.get("message", "") for e in log)
    assert later or silent or before12 < commit5 + 1.0, (commit5, before12)
    assert all(h["easyckpt/committed_step"] in (5, 10) and h["easyckpt/committed_step"] < h["step"]
               for h in later)
    assert all(h["easyckpt/bytes_written"] > 0 for h in later)


class Recorded:
    """The two calls Megatron-LM's writers take from its training loop (SummaryWriter.add_scalar, wandb.log),
    recorded: neither torch's tensorboard nor wandb is installed here, nor the Megatron-LM checkout whose
    global_vars make them (tests/test_megatron_lm.py needs EASYCKPT_MEGATRON_LM)."""

    def __init__(self):
        self.scalars, self.logged = [], []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def log(self, values, step):
        self.logged.append((values, step))


def test_megatron_writers_get_the_figures_at_its_tensorboard_log_interval():
    import argparse

    from easyckpt.megatron import logs
    args = argparse.Namespace(tensorboard_log_interval=5, log_interval=2)
    assert [i for i in range(0, 21) if logs.due(i, args)] == [5, 10, 15, 20]
    assert [i for i in range(0, 7) if logs.due(i, argparse.Namespace(log_interval=3))] == [3, 6]
    figures = {"easyckpt/snapshots": 3.0, "easyckpt/stall_total_s": 0.01}
    tb, wb = Recorded(), Recorded()
    assert logs.write(figures, 10, tb, wb) == 2 and logs.write(figures, 10, None, None) == 0
    assert tb.scalars == [("easyckpt/snapshots", 3.0, 10), ("easyckpt/stall_total_s", 0.01, 10)]
    assert wb.logged == [(figures, 10)]


def test_two_ranks_say_one_summary_and_each_records_its_own_figures(tmp_path):
    save = tmp_path / "save"
    proc = run(train_cmd(save, 2, "--iters", "10", "--storage-interval", "5"))
    wait_no_agent(save)
    said = proc.stdout + proc.stderr
    assert len(SUMMARY.findall(said)) == 1 and "newest committed step 10;" in said, said[-3000:]
    log = events(save / "easyckpt.log")
    for rank in (0, 1):
        mine = [e for e in log if e.get("source") == f"rank{rank}"]
        recorded = [e for e in mine if e["event"] == "metrics"]
        assert len(recorded) == 1 and recorded[0]["rank"] == rank
        assert recorded[0]["snapshots"] == len([e for e in mine if e["event"] == "snapshot"]) == 10
        assert recorded[0]["persists"] == 2 and recorded[0]["committed_step"] == 10


def test_the_budgets_figures_are_those_of_the_cadence_the_audit_log_records(tmp_path):
    save, out = tmp_path / "save", tmp_path / "metrics.json"
    run([sys.executable, str(LOOP), "--dir", str(save), "--steps", "400", "--sleep", "0.01", "--max-overhead", "0.05",
         "--metrics", str(out), "--out", str(tmp_path / "began.json")])
    wait_no_agent(save)
    agreed = [e for e in events(save / "easyckpt.log") if e["event"] == "budget" and not e.get("last")]
    assert agreed, "the budget decided no cadence in 400 steps"
    final = json.loads(out.read_text())[-1]
    assert final["easyckpt/snapshot_every"] == agreed[-1]["every"]
    assert final["easyckpt/loss_bound_steps"] == agreed[-1]["bound"]
    # measured by the budget (medians of the steps after a snapshot and after none), not by a stopwatch of ours
    cost, per_step = final["easyckpt/snapshot_cost_s"], final["easyckpt/stall_per_step_s"]
    assert 0 <= per_step <= cost < 0.1 and final["easyckpt/overhead"] >= 0
