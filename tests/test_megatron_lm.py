"""The REAL Megatron-LM training loop (pretrain_gpt.py, tag core_v0.16.1) on CPU with easyckpt, through the
one-line hook and through the patch files: interrupted (kill -9, SIGTERM) and resumed, its losses equal an
uninterrupted run's.

Needs a Megatron-LM tree: set EASYCKPT_MEGATRON_LM to it (CI has none, so these tests skip there).
tests/megatron_lm_cpu/ holds the CPU switches and the launcher. Megatron prints losses with 7 significant
digits, and the value it prints for the 2nd iteration of any run averages the first two (its log
accumulator): those iterations are left out of the comparison.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness import ROOT, env, events, kill_tree, signal_every_process, wait_no_agent

TREE = os.environ.get("EASYCKPT_MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not TREE or not os.path.isfile(os.path.join(TREE or "", "pretrain_gpt.py")),
    reason="EASYCKPT_MEGATRON_LM is not set to a Megatron-LM tree (core_v0.16.1 or core_v0.19.0): real-loop "
           "tests not run")
LAUNCH = ROOT / "tests" / "megatron_lm_cpu" / "run_megatron_lm.sh"
ITERS = 16
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")
def _tree_release() -> str:
    """The Megatron-LM tree's megatron-core release, "0.16" or "0.19" (its package_info.py)."""
    info = Path(TREE or "", "megatron", "core", "package_info.py")
    found = dict(re.findall(r"^(MAJOR|MINOR) = (\d+)", info.read_text(), re.M)) if info.is_file() else {}
    return f"{found.get('MAJOR', '?')}.{found.get('MINOR', '?')}"


PATCHES = sorted((ROOT / "patches").glob(f"megatron-lm-core_v{_tree_release()}.*.patch"))


def hooked_script(tmp: Path) -> Path:
    """pretrain_gpt.py with the one line on top, the rest of the tree untouched."""
    script = tmp / "pretrain_gpt.py"
    script.write_text("import easyckpt.megatron.hook\n" + Path(TREE, "pretrain_gpt.py").read_text())
    return script


def launch(ckpt: Path, out: Path, tree: str, script: Path = None, extra=(), log: Path = None, more_env=None):
    e = env({"EASYCKPT_MEGATRON_LM": tree, "CKPT_DIR": str(ckpt), "PYTHONPATH": str(ROOT), **(more_env or {})})
    if script is not None:
        e["MLM_SCRIPT"] = str(script)
    if log is not None:
        e["EASYCKPT_LOG_FILE"] = str(log)
    return subprocess.Popen(["bash", str(LAUNCH), "--train-iters", str(ITERS), *extra], env=e,
                            stdout=open(out, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def losses(out: Path):
    return {int(i): v for i, v in LOSS.findall(out.read_text())}


def finish(proc, out, timeout=300):
    rc = proc.wait(timeout=timeout)
    assert rc == 0, out.read_text()[-4000:]


def interrupted_run_matches(tmp: Path, tree: str, script, extra, sig, kill_after: int = 6, log_name=None,
                            more_env=None, every_env=None):
    """``more_env``: for the interrupted launch; ``every_env``: for every launch (e.g. the checkpoint format)."""
    ref_out = tmp / "ref.out"
    finish(launch(tmp / "ref", ref_out, tree, script, extra, more_env=every_env), ref_out)
    reference = losses(ref_out)
    assert sorted(reference) == list(range(1, ITERS + 1)), ref_out.read_text()[-3000:]

    ckpt, first = tmp / "ckpt", tmp / "first.out"
    log = ckpt / log_name if log_name else tmp / "audit.jsonl"   # the patches log into --save
    proc = launch(ckpt, first, tree, script, extra, log, {**(every_env or {}), **(more_env or {})})
    deadline = time.monotonic() + 300
    while max(losses(first), default=0) < kill_after:
        assert proc.poll() is None, first.read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    if sig == signal.SIGKILL:
        kill_tree(proc)
    elif sig == "every process":          # a scheduler's cancel: torchrun, trainers, DataLoader workers, agent
        signal_every_process(proc, signal.SIGTERM)
        proc.wait(timeout=120)
        saves = [e for e in events(log) if e["event"] == "sigterm_save"]
        assert sorted(e["rank"] for e in saves) == [0, 1], f"{saves}\n{first.read_text()[-3000:]}"
    else:
        proc.send_signal(sig)
        proc.wait(timeout=120)
    reached = max(losses(first))
    second = tmp / "second.out"
    finish(launch(ckpt, second, tree, script, extra, log, every_env), second)
    loads = [e for e in events(log) if e["event"] == "load" and e.get("step")]
    assert loads, "the second run did not load a checkpoint"
    resumed = loads[-1]["step"]
    assert resumed < ITERS and reached - resumed <= 1, f"stopped after {reached}, resumed from {resumed}"
    got = losses(second)
    assert sorted(got) == list(range(resumed + 1, ITERS + 1))
    skip = {2, resumed + 2}
    diff = [i for i in got if i not in skip and got[i] != reference[i]]
    assert not diff, f"losses differ at iterations {diff}: {[(got[i], reference[i]) for i in diff]}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
    wait_no_agent(ckpt)
    wait_no_agent(tmp / "ref")


@pytest.mark.parametrize("extra", [(), ("--tensor-model-parallel-size", "2"), ("--use-distributed-optimizer",)],
                         ids=["dp2", "tp2", "distopt"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill9", "sigterm"])
def test_hooked_pretrain_gpt_resumes_with_equal_losses(tmp_path, extra, sig):
    # a preempted job exits after its SIGTERM checkpoint; without --exit-signal-handler the hook trains on, and
    # the launch then ran to the end before torchrun gave up waiting (the test failed on main, not in CI:
    # CI has no Megatron-LM tree)
    exit_env = {"EASYCKPT_EXIT_AFTER_ONDEMAND_CHECKPOINT": "1"} if sig == signal.SIGTERM else None
    interrupted_run_matches(tmp_path, TREE, hooked_script(tmp_path), extra, sig, more_env=exit_env)


def test_sigterm_to_every_process_with_two_dataloader_workers_saves_and_resumes_with_equal_losses(tmp_path):
    """RELIABILITY row 27 in Megatron (its default --num-workers 2) with easyckpt's SIGTERM handling alone: the
    workers leave SIGTERM to the trainers, which save the agreed step and exit. (With --exit-signal-handler,
    Megatron's worker_init_fn gives its workers a handler of its own.)"""
    interrupted_run_matches(tmp_path, TREE, hooked_script(tmp_path), ("--num-workers", "2"), "every process",
                            more_env={"EASYCKPT_EXIT_AFTER_ONDEMAND_CHECKPOINT": "1"})


def test_patches_apply_and_the_patched_loop_resumes_with_equal_losses(tmp_path):
    assert len(PATCHES) == 2, f"patches/ has no pair of patches for Megatron-LM {_tree_release()}: {PATCHES}"
    tree = tmp_path / "megatron-lm"
    shutil.copytree(TREE, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", "docs", "images", "tests"))
    for patch in PATCHES:
        check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=tree, capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0, check.stderr
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True, timeout=60)
    interrupted_run_matches(tmp_path, str(tree), None, (), signal.SIGKILL, log_name="easyckpt.log")


def test_the_patched_loop_without_load_starts_from_scratch_and_still_saves(tmp_path):
    """Megatron calls its loader only with --load: the patched loop given --save alone used to stop at its first
    save with "call initialize_easyckpt before saving or loading". It trains from the beginning (a checkpoint
    already in --save is not loaded, as in Megatron) and commits its saves."""
    tree = tmp_path / "megatron-lm"
    shutil.copytree(TREE, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", "docs", "images", "tests"))
    for patch in PATCHES:
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True, timeout=60)
    ckpt = tmp_path / "ckpt"
    for run in ("first", "second"):
        out = tmp_path / f"{run}.out"
        finish(launch(ckpt, out, str(tree), None, more_env={"NO_LOAD": "1"}), out)
        assert sorted(losses(out)) == list(range(1, ITERS + 1)), out.read_text()[-3000:]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
        commits = [e["step"] for e in events(ckpt / "easyckpt.log") if e["event"] == "commit"]
        assert commits and commits[-1] == ITERS and all(e["event"] != "load" or not e.get("step")
                                                         for e in events(ckpt / "easyckpt.log"))
        wait_no_agent(ckpt)


def test_the_hook_follows_ckpt_format_and_says_which_layout_it_writes(tmp_path):
    """--ckpt-format torch_dist (Megatron's default) gets the torch_dist layout and torch the torch layout,
    each said once (rank 0). (The other formats, torch_dcp and fsdp_dtensor, need FSDP: not on this CPU.)"""
    for fmt in ("torch_dist", "torch"):
        ckpt, out = tmp_path / fmt / "ckpt", tmp_path / f"{fmt}.out"
        finish(launch(ckpt, out, TREE, hooked_script(tmp_path), ("--train-iters", "5", "--ckpt-format", fmt),
                      log=tmp_path / f"{fmt}.jsonl"), out)
        text = out.read_text()
        assert text.count(f"use Megatron's {fmt} layout (--ckpt-format {fmt})") == 1, text[-3000:]
        step = ckpt / "iter_0000005"
        if fmt == "torch_dist":
            assert json.loads((step / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
            assert not (step / "mp_rank_00").exists()
        else:
            assert (step / "mp_rank_00" / "model_optim_rng.pt").is_file() and not (step / "metadata.json").exists()
        wait_no_agent(ckpt)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill9", "sigterm"])
def test_hooked_loop_with_megatrons_default_format_resumes_with_equal_losses(tmp_path, sig):
    """No --ckpt-format at all: Megatron's default, torch_dist, is what easyckpt writes and resumes from."""
    exit_env = {"EASYCKPT_EXIT_AFTER_ONDEMAND_CHECKPOINT": "1"} if sig == signal.SIGTERM else None
    interrupted_run_matches(tmp_path, TREE, hooked_script(tmp_path), (), sig, more_env=exit_env,
                            every_env={"CKPT_FORMAT": "default"})
    newest = tmp_path / "ckpt" / f"iter_{ITERS:07d}"
    assert sorted(p.name for p in newest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (newest / "common.pt").is_file() and (newest / ".metadata").is_file()


@pytest.mark.parametrize("fmt", ["default", "torch"], ids=["torch_dist", "torch"])
def test_hooked_loop_resumes_its_checkpoint_on_another_tp_size(tmp_path, fmt):
    """Saved at TP=2 (DP=1), resumed at TP=1 (DP=2) by the hooked loop, in Megatron's default torch_dist
    format and in the torch one: the losses after the resume are those of a TP=1 run that never stopped, to
    Megatron's printed precision and the rounding of another layout (relative 1e-5)."""
    default = {"CKPT_FORMAT": fmt}
    ref_out = tmp_path / "ref.out"
    finish(launch(tmp_path / "ref", ref_out, TREE, hooked_script(tmp_path), more_env=default), ref_out)
    reference = losses(ref_out)
    ckpt, first, second, log = tmp_path / "ckpt", tmp_path / "first.out", tmp_path / "second.out", tmp_path / "a.jsonl"
    finish(launch(ckpt, first, TREE, hooked_script(tmp_path), ("--train-iters", "8", "--save-interval", "4",
                                                                "--tensor-model-parallel-size", "2"),
                  log=log, more_env=default), first)
    wait_no_agent(ckpt)
    finish(launch(ckpt, second, TREE, hooked_script(tmp_path), log=log, more_env=default), second)
    loads = [e for e in events(log) if e["event"] == "load" and e.get("step")]
    assert [(e["step"], e["source"]) for e in loads] == [(8, "storage"), (8, "storage")], loads
    got = losses(second)
    assert sorted(got) == list(range(9, ITERS + 1))
    close(got, reference, [i for i in got if i != 10])      # 10: Megatron's log accumulator (docstring)
    wait_no_agent(ckpt)
    wait_no_agent(tmp_path / "ref")


def test_megatrons_own_loader_resumes_an_easyckpt_torch_dist_checkpoint_on_another_tp_size(tmp_path):
    """The checkpoint is Megatron's own format: plain Megatron-LM (no easyckpt) at TP=1 resumes from what the
    hooked loop saved at TP=2, with the losses of a TP=1 run that never stopped (relative 1e-5)."""
    default = {"CKPT_FORMAT": "default"}
    ref_out = tmp_path / "ref.out"
    finish(launch(tmp_path / "ref", ref_out, TREE, None, more_env=default), ref_out)
    reference = losses(ref_out)
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.out", tmp_path / "second.out"
    finish(launch(ckpt, first, TREE, hooked_script(tmp_path), ("--train-iters", "8", "--save-interval", "4",
                                                                "--tensor-model-parallel-size", "2"),
                  log=tmp_path / "a.jsonl", more_env=default), first)
    wait_no_agent(ckpt)
    finish(launch(ckpt, second, TREE, None, more_env=default), second)
    text = second.read_text()
    assert "successfully loaded checkpoint from" in text and "at iteration 8" in text, text[-3000:]
    got = losses(second)
    assert sorted(got) == list(range(9, ITERS + 1)), text[-3000:]
    close(got, reference, [i for i in got if i != 10])
    wait_no_agent(tmp_path / "ref")


def close(got, reference, iterations, rel=1e-5):
    for i in iterations:
        x, y = float(got[i]), float(reference[i])
        assert abs(x - y) <= rel * abs(y), f"iteration {i}: {got[i]} vs {reference[i]} (uninterrupted run)"


def test_hooked_loop_adopts_megatrons_own_checkpoint_in_its_save_dir(tmp_path):
    """easyckpt added to a running job (row 26): plain Megatron-LM (no hook) saved iteration 3 itself into
    --save = --load; the hooked loop resumes from it (said on the console), with the losses of a run that
    never stopped, and its own later saves commit while iter_0000003 stays as Megatron wrote it."""
    ref_out = tmp_path / "ref.out"
    finish(launch(tmp_path / "ref", ref_out, TREE, hooked_script(tmp_path)), ref_out)
    reference = losses(ref_out)

    ckpt, first, second, log = tmp_path / "ckpt", tmp_path / "first.out", tmp_path / "second.out", tmp_path / "audit.jsonl"
    finish(launch(ckpt, first, TREE, None, ("--train-iters", "3", "--save-interval", "3")), first)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    native = {p: p.read_bytes() for p in (ckpt / "iter_0000003").rglob("*") if p.is_file()}
    assert native and not (ckpt / "iter_0000003" / "easyckpt_manifest.json").exists()

    finish(launch(ckpt, second, TREE, hooked_script(tmp_path), log=log), second)
    text = second.read_text()
    assert "easyckpt: resuming from Megatron's own checkpoint iter_0000003 (no easyckpt manifest)" in text, text[-4000:]
    got = losses(second)
    assert sorted(got) == list(range(4, ITERS + 1)), f"resumed at {min(got)}, not after Megatron's iteration 3"
    diff = [i for i in got if i != 5 and got[i] != reference[i]]    # 5: Megatron's log accumulator (docstring)
    assert not diff, f"losses differ at iterations {diff}"
    assert [e["step"] for e in events(log) if e["event"] == "load" and e.get("source") == "adopted"] == [3, 3]
    assert {p: p.read_bytes() for p in (ckpt / "iter_0000003").rglob("*") if p.is_file()} == native
    commits = [e["step"] for e in events(log) if e["event"] == "commit"]
    assert commits and commits[-1] == ITERS
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
    wait_no_agent(ckpt)
    wait_no_agent(tmp_path / "ref")


def test_hooked_loop_adopts_megatrons_own_torch_dist_checkpoint(tmp_path):
    """Megatron-LM's default format, saved by Megatron itself into --save = --load (no easyckpt manifest):
    the hooked loop resumes from it through Megatron's own reader (said on the console) instead of the job
    restarting from iteration 1, with the losses of a run that never stopped, and its later saves commit."""
    fmt = ("--ckpt-format", "torch_dist")
    ref_out = tmp_path / "ref.out"
    finish(launch(tmp_path / "ref", ref_out, TREE, hooked_script(tmp_path)), ref_out)
    reference = losses(ref_out)

    ckpt, first, second, log = tmp_path / "ckpt", tmp_path / "first.out", tmp_path / "second.out", tmp_path / "audit.jsonl"
    finish(launch(ckpt, first, TREE, None, ("--train-iters", "3", "--save-interval", "3", *fmt)), first)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert any((ckpt / "iter_0000003").glob("*.distcp"))

    finish(launch(ckpt, second, TREE, hooked_script(tmp_path), fmt, log=log), second)
    text = second.read_text()
    assert "easyckpt: resuming from Megatron's own checkpoint iter_0000003 (no easyckpt manifest)" in text, \
        text[-4000:]
    assert [e["step"] for e in events(log) if e["event"] == "load" and e.get("source") == "adopted"] == [3, 3]
    resumed_after_three(second, reference, log, ckpt, tmp_path)


def test_hooked_loop_with_load_in_another_directory_says_that_megatron_loads_it(tmp_path):
    """--load names another directory than --save (a fine-tune from a base run's checkpoint): the job has
    nothing in --save, so Megatron's own loader resumes from --load; the console says that, not "training
    starts from the beginning" (issue 34), and the losses are those of a run that never stopped."""
    ref_out = tmp_path / "ref.out"
    finish(launch(tmp_path / "ref", ref_out, TREE, hooked_script(tmp_path)), ref_out)
    reference = losses(ref_out)

    base, first = tmp_path / "base", tmp_path / "first.out"
    finish(launch(base, first, TREE, None, ("--train-iters", "3", "--save-interval", "3")), first)
    assert (base / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    ckpt, second, log = tmp_path / "ckpt", tmp_path / "second.out", tmp_path / "audit.jsonl"
    finish(launch(ckpt, second, TREE, hooked_script(tmp_path), ("--load", str(base)), log=log), second)
    text = second.read_text()
    assert f"easyckpt: no checkpoint of this job in {ckpt}: Megatron's own loader resumes from --load {base}" \
        in text, text[-4000:]
    assert "training starts from the beginning" not in text, text[-4000:]
    resumed_after_three(second, reference, log, ckpt, tmp_path)


def resumed_after_three(second, reference, log, ckpt, tmp_path):
    """The hooked run ``second`` went on from Megatron's iteration 3 with the losses of a run that never stopped
    (but iteration 5: Megatron's log accumulator, see test_hooked_loop_adopts_megatrons_own_checkpoint...), and
    its own saves committed to the last iteration."""
    got = losses(second)
    assert sorted(got) == list(range(4, ITERS + 1)), f"resumed at {min(got)}, not after iteration 3"
    diff = [i for i in got if i != 5 and got[i] != reference[i]]
    assert not diff, f"losses differ at iterations {diff}"
    commits = [e["step"] for e in events(log) if e["event"] == "commit"]
    assert commits and commits[-1] == ITERS
    wait_no_agent(ckpt)
    wait_no_agent(tmp_path / "ref")
