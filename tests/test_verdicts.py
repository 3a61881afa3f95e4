"""Decisions that must never throw good state away (docs/reliability.md rows 29 and 31-34): what the loader
concludes about a step, which steps are this job's, in what order retention sees them, and what the
operator's prune may delete. Each test drives the real example trainer (tests/worker_pytorch.py under
torchrun) and the real agent, or the real `easyckpt` command, in processes; nothing is mocked.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict

from harness import (
    cli,
    cli_json,
    committed_steps,
    events,
    losses,
    starts,
    train_cmd,
    wait_no_agent,
)
from inproc import run_worker

RUN_TIMEOUT = 240


def _flip(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _tree(root: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_step_rejected_stops_the_job_and_a_fresh_start_sets_them_aside_whole(tmp_path):
    """Row 29: every committed step fails its checksum: the relaunch stops before training, listing each step
    with its verdict and the setting that allows a fresh start, and nothing in the steps changes; with
    on_no_valid_checkpoint="start_fresh" they are quarantined, kept byte for byte, listed by `easyckpt ls`, and
    the new run's commits never take their names."""
    save, loss = tmp_path / "ckpt", tmp_path / "loss"
    run_worker(train_cmd(save, 2, "--iters", "15", "--storage-interval", "5", "--max-ckpt", "3"), timeout=RUN_TIMEOUT)
    wait_no_agent(save)
    assert committed_steps(save) == [5, 10, 15]
    for step in (5, 10, 15):
        _flip(save / f"step_{step:08d}" / "model.safetensors")
    damaged = {s: _tree(save / f"step_{s:08d}") for s in (5, 10, 15)}

    out = run_worker(train_cmd(save, 2, "--iters", "20", "--storage-interval", "5", "--idle-timeout", "2",
                        "--loss-file", str(loss)), timeout=RUN_TIMEOUT, check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    for step in (5, 10, 15):
        assert f"step {step} {save / f'step_{step:08d}'}: corrupt" in text, text[-4000:]
    assert "on_no_valid_checkpoint" in text and "Nothing was deleted" in text
    assert "nothing to resume" not in text and "starts from the beginning" not in text
    assert not losses(loss), "training ran over three committed steps"
    wait_no_agent(save)
    assert {s: _tree(save / f"step_{s:08d}") for s in (5, 10, 15)} == damaged, "a rejected step was changed"

    run_worker(train_cmd(save, 2, "--iters", "10", "--storage-interval", "5", "--start-fresh", "--loss-file", str(loss)),
        timeout=RUN_TIMEOUT)
    wait_no_agent(save)
    assert starts(loss) == [0]
    aside = sorted(save.glob("quarantined-step_*"))
    assert len(aside) == 3, sorted(p.name for p in save.iterdir())
    kept = {json.loads((p / "easyckpt_manifest.json").read_text())["step"]: _tree(p) for p in aside}
    assert kept == damaged, "a quarantined step is not the rejected step, byte for byte"
    assert committed_steps(save) == [5, 10]
    listing = cli_json("ls", save)["checkpoints"]
    assert sorted(e["step"] for e in listing if e["state"] == "quarantined") == [5, 10, 15]
    assert [(e["step"], e["state"]) for e in listing if e["picked"]] == [(10, "complete")]


def test_a_job_never_resumes_another_jobs_steps_and_says_whose_they_are(tmp_path):
    """Row 31: job b in job a's save dir starts from the beginning, naming a's steps as another job's; job a
    relaunched resumes its own step, not b's newer one."""
    save, loss_a, loss_b = tmp_path / "ckpt", tmp_path / "a", tmp_path / "b"
    run_worker(train_cmd(save, 1, "--iters", "10", "--storage-interval", "5", "--job-name", "a", "--loss-file", str(loss_a)),
        timeout=RUN_TIMEOUT)
    wait_no_agent(save, job_name="a")
    out = run_worker(train_cmd(save, 1, "--iters", "12", "--storage-interval", "4", "--job-name", "b",
                        "--loss-file", str(loss_b)), timeout=RUN_TIMEOUT)
    wait_no_agent(save, job_name="b")
    assert starts(loss_b) == [0], "job b resumed job a's checkpoint"
    assert "belong to another job (job_name='a'" in out.stdout + out.stderr
    out = run_worker(train_cmd(save, 1, "--iters", "15", "--storage-interval", "5", "--job-name", "a",
                        "--loss-file", str(loss_a)), timeout=RUN_TIMEOUT)
    wait_no_agent(save, job_name="a")
    assert starts(loss_a) == [0, 10], "job a did not resume its own newest step"
    assert "belong to another job (job_name='b'" in out.stdout + out.stderr
    jobs = {json.loads((p / "easyckpt_manifest.json").read_text())["job"]
            for p in save.glob("step_*") if (p / "easyckpt_manifest.json").exists()}
    assert jobs == {"a", "b"}


def test_a_step_name_another_job_committed_is_refused_naming_that_job_and_never_advising_a_delete(tmp_path):
    """issue 51 item 4: job b after job a in one save dir, on the same cadence: b's steps 5 and 10 take the names of
    a's commits. Each is refused naming job 'a' (from its manifest), advising a save_dir of b's own, or job_name='a'
    to continue a; never a delete. a's steps stay byte for byte, b's training goes on and its last step commits."""
    save, loss_b = tmp_path / "ckpt", tmp_path / "b"
    run_worker(train_cmd(save, 1, "--iters", "10", "--storage-interval", "5", "--job-name", "a"), timeout=RUN_TIMEOUT)
    wait_no_agent(save, job_name="a")
    before = {s: _tree(save / f"step_{s:08d}") for s in (5, 10)}
    out = run_worker(train_cmd(save, 1, "--iters", "12", "--storage-interval", "5", "--job-name", "b",
                               "--loss-file", str(loss_b)), timeout=RUN_TIMEOUT)
    wait_no_agent(save, job_name="b")
    text = out.stdout + out.stderr
    assert sorted(losses(loss_b)) == list(range(1, 13)) and committed_steps(save) == [5, 10, 12], text[-3000:]
    said = f"{save / 'step_00000005'} holds step 5 of another job, job 'a' (job id "
    assert said in text, text[-3000:]
    assert ("it is never replaced. That checkpoint is not this job's to delete: give this job a save_dir of its "
            "own; or, if this run continues job 'a', set job_name='a' to resume it") in text, text[-3000:]
    assert "prune or delete" not in text and "move it away" not in text
    assert {s: _tree(save / f"step_{s:08d}") for s in (5, 10)} == before


def test_a_new_runs_commits_are_never_pruned_for_an_older_runs_higher_steps(tmp_path):
    """Row 32: a --no-resume run in a directory holding an older run's steps 10-20: its commits 4 and 8 are
    the newest (retention orders by run, then step) and stay; the older run's go beyond max_ckpt_num; the
    run's finalize returns as soon as its last step is committed."""
    save = tmp_path / "ckpt"
    run_worker(train_cmd(save, 1, "--iters", "20", "--storage-interval", "5", "--max-ckpt", "3"), timeout=RUN_TIMEOUT)
    wait_no_agent(save)
    assert committed_steps(save) == [10, 15, 20]
    run_worker(train_cmd(save, 1, "--iters", "8", "--storage-interval", "4", "--max-ckpt", "3", "--no-resume",
                  "--commit-timeout", "60"), timeout=RUN_TIMEOUT)
    wait_no_agent(save)
    log = events(save / "easyckpt.log")
    deleted = [e["path"] for e in log if e["event"] == "delete"]
    assert not [p for p in deleted if p.endswith(("step_00000004", "step_00000008"))], deleted
    assert committed_steps(save) == [4, 8, 20]


def test_prune_deletes_nothing_when_the_newest_step_it_would_keep_is_damaged(tmp_path):
    """Row 33: `easyckpt prune --keep 1` verifies the step it keeps: silently damaged, nothing is deleted and
    the exit status is 1; once it verifies, the older ones go."""
    save = tmp_path / "ckpt"
    run_worker(train_cmd(save, 1, "--iters", "15", "--storage-interval", "5", "--max-ckpt", "3"), timeout=RUN_TIMEOUT)
    wait_no_agent(save)
    shard = save / "step_00000015" / "model.safetensors"
    intact = shard.read_bytes()
    _flip(shard)
    out = cli("prune", save, "--keep", "1", expect=1)
    assert "step_00000015" in out.stderr and "Nothing was deleted" in out.stderr, out.stderr
    assert committed_steps(save) == [5, 10, 15]
    shard.write_bytes(intact)
    cli("prune", save, "--keep", "1")
    assert committed_steps(save) == [15]


def test_a_copied_save_dir_resumes_commits_and_prunes(tmp_path):
    """Row 34: a copy of the save dir whose newest step is damaged: the relaunch from the copy falls back to
    the step before (losses equal to the original run's), commits over the damaged one and prunes as usual."""
    save, loss = tmp_path / "ckpt", tmp_path / "loss"
    run_worker(train_cmd(save, 1, "--iters", "20", "--storage-interval", "5", "--max-ckpt", "3", "--loss-file", str(loss)),
        timeout=RUN_TIMEOUT)
    wait_no_agent(save)
    copy, loss2 = tmp_path / "copy", tmp_path / "loss2"
    shutil.copytree(save, copy, symlinks=True)
    _flip(copy / "step_00000020" / "model.safetensors")
    out = run_worker(train_cmd(copy, 1, "--iters", "25", "--storage-interval", "5", "--max-ckpt", "3",
                        "--loss-file", str(loss2)), timeout=RUN_TIMEOUT)
    wait_no_agent(copy)
    assert starts(loss2) == [15], out.stdout[-3000:]
    reference, resumed = losses(loss), losses(loss2)
    assert [resumed[i] for i in range(16, 21)] == [reference[i] for i in range(16, 21)]
    assert committed_steps(copy) == [15, 20, 25]
    assert committed_steps(save) == [10, 15, 20], "the original directory was touched"
