"""The operator tools (``easyckpt.cli.main(argv)``, in this process; the entry point itself as a process in
the version test) on the checkpoints of a real 2-rank DDP training run (tests/worker_pytorch.py under
torchrun): ls, inspect, verify and prune, on intact, interrupted and damaged checkpoints, text and --json
output, exit statuses.
The same commands on Megatron, DeepSpeed and Trainer checkpoints are checked in those frameworks' tests,
on the checkpoints their runs leave (test_megatron, test_deepspeed, test_transformers).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import s3server
from harness import (
    cli,
    cli_json,
    cli_process,
    committed_steps,
    events,
    run,
    train_cmd,
    wait_no_agent,
)
from inproc import run_worker

from easyckpt.formats.manifest import MANIFEST_NAME
from easyckpt.storage.joblock import JobLock

HIDDEN = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("cli")
    ckpt = work / "ckpt"
    run_worker(train_cmd(ckpt, 2, "--iters", "8", "--storage-interval", "2", "--max-ckpt", "3", "--hidden", str(HIDDEN),
                  "--idle-timeout", "2"), timeout=180)
    wait_no_agent(ckpt)
    return ckpt


@pytest.fixture
def ckpt(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run's checkpoints for each test to damage or prune."""
    return Path(shutil.copytree(trained, tmp_path / "ckpt"))


def step_dir(ckpt: Path, step: int) -> Path:
    return ckpt / f"step_{step:08d}"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_ls_lists_each_checkpoint_with_state_layout_size_and_the_loaders_pick(ckpt):
    steps = committed_steps(ckpt)
    assert len(steps) == 3, steps
    # an interrupted save: a step directory newer than the others, without its manifest
    interrupted = steps[-1] + 2
    shutil.copytree(step_dir(ckpt, steps[-1]), step_dir(ckpt, interrupted))
    (step_dir(ckpt, interrupted) / MANIFEST_NAME).unlink()

    out = cli_json("ls", ckpt)
    assert out["framework"] == "pytorch" and out["picked"] == steps[-1]
    rows = {r["step"]: r for r in out["checkpoints"]}
    assert sorted(rows) == steps + [interrupted]
    assert rows[interrupted]["state"] == "incomplete" and "no manifest" in rows[interrupted]["why"]
    assert not rows[interrupted]["picked"]
    for s in steps:
        r = rows[s]
        assert r["complete"] and r["state"] == "complete" and r["why"] is None and r["picked"] == (s == steps[-1])
        assert r["layout"] == {"tp": 1, "pp": 1, "dp": 2, "world": 2}
        on_disk = sum(p.stat().st_size for p in step_dir(ckpt, s).rglob("*") if p.name != MANIFEST_NAME)
        assert r["bytes"] == on_disk and r["files"] == 4     # model, optimizer, one RNG file per rank

    text = cli("ls", ckpt).stdout
    assert re.search(rf"^\*\s+{steps[-1]}\s", text, re.M), text
    assert re.search(rf"^\s+{interrupted}\s.*INCOMPLETE: no manifest", text, re.M), text
    assert f"the loader would pick step {steps[-1]}" in text and "tp1 pp1 dp2" in text


def test_verify_names_the_damaged_file_and_ls_verify_picks_what_the_loader_would(ckpt):
    steps = committed_steps(ckpt)
    ok = cli("verify", ckpt)
    assert ok.stdout.count(": OK") == len(steps), ok.stdout

    flip_byte(step_dir(ckpt, steps[-1]) / "optimizer.safetensors")
    with open(step_dir(ckpt, steps[0]) / "rank_00001.safetensors", "r+b") as f:
        f.truncate(100)
    bad = cli("verify", ckpt, expect=1)
    assert f"step {steps[-1]}: DAMAGED" in bad.stdout and "optimizer.safetensors: checksum" in bad.stdout, bad.stdout
    assert f"step {steps[0]}: DAMAGED" in bad.stdout and "rank_00001.safetensors: size 100" in bad.stdout
    assert f"step {steps[1]}: OK" in bad.stdout
    cli("verify", ckpt, steps[1])                       # one intact step: exit 0
    report = cli_json("verify", ckpt, steps[-1], expect=1)
    assert [r["step"] for r in report] == [steps[-1]] and not report[0]["ok"]
    assert report[0]["problems"][0].startswith("optimizer.safetensors: checksum")

    # sizes alone cannot see a flipped byte; with --verify the pick is the loader's: the newest intact step
    assert cli_json("ls", ckpt)["picked"] == steps[-1]
    checked = cli_json("ls", ckpt, "--verify", expect=1)     # damage found: a check's exit status says so
    assert checked["picked"] == steps[1]
    rows = {r["step"]: r for r in checked["checkpoints"]}
    assert rows[steps[-1]]["state"] == "damaged" and "optimizer.safetensors" in rows[steps[-1]]["why"]
    assert rows[steps[0]]["state"] == "damaged" and "size 100" in rows[steps[0]]["why"]

    bar = cli("verify", ckpt, steps[1], "--progress")
    assert "verify" in bar.stderr and "100%" in bar.stderr, bar.stderr
    assert "%" not in bar.stdout, "progress goes to stderr only"


def test_inspect_lists_tensors_bytes_by_group_and_metadata(ckpt):
    steps = committed_steps(ckpt)
    info = cli_json("inspect", ckpt)
    assert info["step"] == steps[-1] and info["complete"] and info["layout"]["dp"] == 2
    tensors = {(t["file"], t["key"]): t for t in info["tensors"]}
    w = tensors[("model.safetensors", "0.weight")]
    assert w == {"file": "model.safetensors", "key": "0.weight", "dtype": "float32", "shape": [HIDDEN, 16],
                 "bytes": HIDDEN * 16 * 4, "group": "model"}
    model = [t for t in info["tensors"] if t["group"] == "model"]
    params = sum(t["bytes"] for t in model)
    assert params == 4 * (HIDDEN * 16 + HIDDEN + HIDDEN + 1)      # Linear(16, h), Linear(h, 1)
    assert info["groups"]["model"] == {"bytes": params, "tensors": len(model)}
    # AdamW keeps two moments per parameter (and a step count per parameter)
    opt = info["groups"]["optimizer"]
    assert 2 * params <= opt["bytes"] <= 2 * params + 8 * len(model), opt
    assert info["groups"]["other"]["tensors"] >= 2          # the RNG states of each rank
    assert info["metadata"]["manifest"]["step"] == steps[-1]
    assert info["metadata"]["manifest"]["world_size"] == 2
    assert {f["file"] for f in info["files"]} == {"model.safetensors", "optimizer.safetensors",
                                                  "rank_00000.safetensors", "rank_00001.safetensors"}

    text = cli("inspect", ckpt, steps[0], "--limit", "3").stdout
    assert text.startswith(f"step {steps[0]}  ") and "bytes by group" in text
    assert re.search(r"model\s+float32\s+\[24, 16\]", text), text
    assert "more (--limit 0 lists them all)" in text


def test_prune_keeps_the_newest_n_of_the_job_touches_nothing_else_and_logs_every_delete(ckpt, tmp_path):
    steps = committed_steps(ckpt)
    job = json.loads((step_dir(ckpt, steps[-1]) / MANIFEST_NAME).read_text())["job_id"]
    # foreign: a directory named like a step but not committed by easyckpt, and another job's checkpoint
    (step_dir(ckpt, 0)).mkdir()
    (step_dir(ckpt, 0) / "notes.txt").write_text("mine")
    other = step_dir(ckpt, 1)
    shutil.copytree(step_dir(ckpt, steps[0]), other)
    man = json.loads((other / MANIFEST_NAME).read_text())
    man.update(step=1, job_id="someotherjob", job="another-job")
    (other / MANIFEST_NAME).write_text(json.dumps(man))
    before = sorted(p.name for p in ckpt.iterdir())

    dry = cli("prune", ckpt, "--keep", "1", "--dry-run").stdout
    assert all(f"would delete step {s}" in dry for s in steps[:-1]), dry
    assert sorted(p.name for p in ckpt.iterdir()) == before, "a dry run deletes nothing"

    # a job still running on the directory prunes by itself: the tool refuses to race it
    lock = JobLock(str(ckpt), job, "running-job")
    assert lock.acquire() is None
    try:
        busy = cli("prune", ckpt, "--keep", "1", expect=1)
        assert "running" in busy.stderr, busy.stderr
    finally:
        lock.release()
    assert sorted(p.name for p in ckpt.iterdir()) == before

    log = tmp_path / "prune.jsonl"
    out = cli_json("prune", ckpt, "--keep", "1", "--log-file", log)
    assert out["job_id"] == job and sorted(out["deleted"]) == steps[:-1] and out["kept"] == [steps[-1]]
    assert out["other_jobs_untouched"] == ["someotherjob"]
    assert sorted(e["step"] for e in events(log) if e["event"] == "delete") == steps[:-1]
    assert committed_steps(ckpt) == [1, steps[-1]]
    assert (step_dir(ckpt, 0) / "notes.txt").read_text() == "mine" and (other / MANIFEST_NAME).exists()
    cli("verify", ckpt, steps[-1])

    bad = cli("prune", ckpt, "--keep", "0", expect=2)
    assert "--keep must be at least 1" in bad.stderr


def test_wrong_paths_and_directories_without_checkpoints_exit_2_with_a_clear_message(trained, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for verb in ("ls", "inspect", "verify", "prune"):
        extra = ["--keep", "1"] if verb == "prune" else []
        missing = cli(verb, tmp_path / "nope", *extra, expect=2)
        assert "no such directory" in missing.stderr, missing.stderr
        nothing = cli(verb, empty, *extra, expect=2)
        assert "holds no checkpoint" in nothing.stderr, nothing.stderr
    assert "is not a directory" in cli("ls", trained / "latest", expect=2).stderr
    step = cli("inspect", trained, "999", expect=2)
    assert "no checkpoint of step 999" in step.stderr and "steps:" in step.stderr


def test_a_load_from_storage_draws_a_progress_bar_when_asked(ckpt, tmp_path):
    """Long operations show progress: a training process resuming from storage with EASYCKPT_PROGRESS=1
    draws one on stderr for the files it reads (rank 0)."""
    steps = committed_steps(ckpt)
    out = run_worker(train_cmd(ckpt, 1, "--iters", str(steps[-1]), "--idle-timeout", "1", "--hidden", str(HIDDEN),
                        ), extra_env={"EASYCKPT_PROGRESS": "1"}, timeout=120)
    assert f"load step_{steps[-1]:08d}" in out.stderr and "100%" in out.stderr, out.stderr[-2000:]
    wait_no_agent(ckpt)


def test_version_prints_the_packages_version_and_exits_0():
    import easyckpt
    assert cli_process("--version").stdout.strip() == f"easyckpt {easyckpt.__version__}"
    assert cli_process(expect=2).stderr, "no command is still a usage error"


# ---- an object store, reached by --endpoint-url --------------------------------------------------------------

server, bucket = s3server.fixtures()     # the session's S3 server (tests/s3server.py), a bucket per test


def test_every_verb_reaches_an_object_store_by_endpoint_url_with_no_aws_endpoint_url(server, request, tmp_path,
                                                                                     monkeypatch):
    """The training API takes endpoint_url; the verbs take --endpoint-url, passed the same way: with
    AWS_ENDPOINT_URL unset, ls (as a user's process), inspect and verify read a job's steps in the store."""
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e .[s3])")
    _, top = request.getfixturevalue("bucket")
    url, local = f"{top}/job", tmp_path / "local"
    run(train_cmd(url, 1, "--local-dir", str(local), "--idle-timeout", "1", "--iters", "4",  # type: ignore[arg-type]
                  "--storage-interval", "2"), timeout=180)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    from easyckpt.storage import resolve
    monkeypatch.setattr(resolve, "_endpoint", resolve._endpoint)    # the in-process verbs set it: put back after
    endpoint = ["--endpoint-url", server["ENDPOINT"]]
    listing = cli_process("ls", url, *endpoint, "--json")
    assert json.loads(listing.stdout)["picked"] == 4, listing.stdout
    assert [r["step"] for r in json.loads(listing.stdout)["checkpoints"]] == [4, 2]
    assert cli_json("inspect", url, "2", *endpoint)["step"] == 2
    assert "step 4: OK" in cli("verify", url, *endpoint).stdout
