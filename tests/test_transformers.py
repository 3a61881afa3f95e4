"""The Hugging Face Trainer under TrainerWrapper: real Trainers (tiny GPT-2, CPU), interrupted and resumed.

Each interrupted run is killed twice (kill -9 of every process, then SIGTERM) and relaunched with the same
command; the per-step losses must equal an uninterrupted run's bit for bit: single process, 2-process DDP,
and DeepSpeed ZeRO 1, 2 and 3 (2 processes). Also: a plain Trainer resumes from an easyckpt checkpoint and
the wrapper from a plain Trainer's, save_total_limit keeps what the Trainer itself keeps (the best
checkpoint included), and ZeRO-2 saved on 2 processes resumes on 1.
"""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import statistics
import time

import pytest
from harness import (
    ROOT,
    agent_alive,
    assert_console,
    assert_losses_close,
    assert_losses_equal,
    assert_prepared,
    cli,
    cli_json,
    events,
    interrupted_runs,
    job_id,
    kill_tree,
    killed_then_resumed,
    losses,
    run,
    script_cmd,
    shm_segments,
    start,
    starts,
    wait_for_iteration,
    wait_no_agent,
)

HF = ROOT / "examples" / "deepspeed" / "hf_train.py"
STEPS = 24
SEED = int(os.environ.get("EASYCKPT_TEST_SEED", "20261122"))


def hf(out, loss, *extra, nproc=1, log=None):
    args = ["--output-dir", str(out), "--loss-file", str(loss), "--max-steps", str(STEPS), "--idle-timeout", "20", *extra]
    if log is not None:
        args += ["--log-file", str(log)]
    return script_cmd(HF, nproc, *args, torchrun="--zero" in extra or "--fsdp" in extra)   # a process group


def reference(tmp, *extra, nproc=1):
    run(hf(tmp / "ref", tmp / "ref-loss", *extra, nproc=nproc), timeout=300)
    wait_no_agent(tmp / "ref")
    return losses(tmp / "ref-loss")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, one per configuration, made when first needed. ZeRO-1 and ZeRO-2 do the same
    arithmetic here (their losses are bit-identical), so they share one: a test of either fails if not."""
    cache = {}

    def get(name):
        key = "zero1" if name == "zero2" else name
        if key not in cache:
            nproc, extra = CONFIGS[key]
            cache[key] = reference(tmp_path_factory.mktemp(f"hf-{key}"), *extra, nproc=nproc)
        return cache[key]
    return get


@pytest.fixture(scope="module")
def single_reference(references):
    return references("single")


CONFIGS = {"single": (1, []), "ddp": (2, []), "zero1": (2, ["--zero", "1"]), "zero2": (2, ["--zero", "2"]),
           "zero3": (2, ["--zero", "3"])}


# single (one process), DDP, ZeRO-1 and ZeRO-2 repeat the paths of ZeRO-3 (the wrapper's capture, kill -9,
# SIGTERM, resume), of the plain Trainer's cross-resume and of ZeRO-2's 2->1 resume below: -m slow, to
# keep CI under 15 minutes
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "zero3" else n
                                  for n in CONFIGS])
def test_kill9_and_sigterm_resume_with_equal_losses(tmp_path, name, references):
    nproc, extra = CONFIGS[name]
    ref = references(name)
    rnd = random.Random(SEED + len(name))
    kill_at, term_at = rnd.randint(3, 9), rnd.randint(13, 19)
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmd = hf(out, loss, *extra, "--step-sleep", "0.05", nproc=nproc, log=log)
    last = interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    assert_losses_equal(losses(loss), ref, STEPS, name)
    resumed = starts(loss)[1:]
    assert len(resumed) == 2 and resumed[0] >= kill_at - 1 and resumed[1] >= term_at - 1, \
        f"resumed from {resumed} after interrupts at {kill_at}, {term_at}: progress was lost"
    assert_console(tmp_path, last, resumed, out, "checkpoint-{}".format, nproc)
    assert any(e["event"] == "load" and e.get("source") == "memory" for e in events(log))
    # the Trainer creates its DeepSpeed engine after the resume point is chosen: nothing to estimate from
    assert_prepared(log, nproc, estimated=extra[:1] != ["--zero"])
    wait_no_agent(out)
    # the Trainer's native layout, checkpoint by checkpoint
    newest = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    names = set(os.listdir(newest))
    assert {"trainer_state.json", "training_args.bin", "config.json", "easyckpt_manifest.json"} <= names
    if name in ("single",):
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= names
    elif name == "ddp":
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= names
    else:
        step = json.loads((newest / "trainer_state.json").read_text())["global_step"]
        assert (newest / "latest").read_text() == f"global_step{step}"
        assert {"zero_to_fp32.py", f"global_step{step}"} <= names
        assert (name == "zero3") != ("model.safetensors" in names)


def test_callback_form_resumes_after_kill9_and_sigterm_with_equal_losses(tmp_path, single_reference):
    """Trainer(callbacks=[EasyCkptCallback(...)]) and trainer.train(resume_from_checkpoint=True) at every
    launch: memory snapshots, the SIGTERM save, Trainer-decided checkpoint-N, an exact resume."""
    rnd = random.Random(SEED + 7)
    kill_at, term_at = rnd.randint(3, 9), rnd.randint(13, 19)
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmd = hf(out, loss, "--callback", "--step-sleep", "0.05", log=log)
    last = interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    assert_losses_equal(losses(loss), single_reference, STEPS, "callback")
    resumed = starts(loss)[1:]
    assert len(resumed) == 2 and resumed[0] >= kill_at - 1 and resumed[1] >= term_at, \
        f"resumed from {resumed} after kill -9 at {kill_at} and SIGTERM at {term_at}: progress was lost"
    assert_console(tmp_path, last, resumed, out, "checkpoint-{}".format, nproc=1)
    log_events = events(log)
    assert [e["step"] for e in log_events if e["event"] == "sigterm_save"] == [resumed[1]]
    loads = [(e["source"], e["step"]) for e in log_events if e["event"] == "load"]
    assert loads[:2] == [("none", 0), ("memory", resumed[0])] and loads[2][1] == resumed[1], loads
    wait_no_agent(out)
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert {5, 10, 15, 20, STEPS, resumed[1]} <= set(saved), saved
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "easyckpt_manifest.json"} <= \
        set(os.listdir(out / f"checkpoint-{STEPS}"))


def test_plain_trainer_and_wrapper_resume_from_each_others_checkpoints(tmp_path, single_reference):
    # wrapper writes, wrapper killed; the plain Trainer resumes from the wrapper's checkpoint-10
    a = tmp_path / "a"
    proc = start(hf(a / "out", a / "loss", "--step-sleep", "0.1", "--idle-timeout", "2"), log=tmp_path / "a.out")
    wait_for_iteration(a / "loss", 12, proc, 300)
    kill_tree(proc)
    wait_no_agent(a / "out", timeout=90)
    run(hf(a / "out", a / "loss", "--plain", "--resume", str(a / "out" / "checkpoint-10")), timeout=300)
    assert starts(a / "loss")[-1] == 10
    assert_losses_equal(losses(a / "loss"), single_reference, STEPS, "plain Trainer from easyckpt's checkpoint")

    # the plain Trainer writes, and is killed; the wrapper resumes from its newest complete checkpoint-N
    b = tmp_path / "b"
    log = tmp_path / "b-audit.jsonl"
    proc = start(hf(b / "out", b / "loss", "--plain", "--resume", "none", "--step-sleep", "0.1"),
                 log=tmp_path / "b.out")
    wait_for_iteration(b / "loss", 13, proc, 300)
    kill_tree(proc)
    (b / "out" / "checkpoint-15").mkdir()      # as a crash in the middle of the Trainer's save leaves it
    run(hf(b / "out", b / "loss", log=log), timeout=300)
    assert starts(b / "loss")[-1] == 10
    assert [e["source"] for e in events(log) if e["event"] == "load"] == ["adopted"]
    assert_losses_equal(losses(b / "loss"), single_reference, STEPS, "wrapper from a plain Trainer's checkpoint")
    wait_no_agent(b / "out")


def test_save_total_limit_keeps_what_the_trainer_keeps_including_the_best(tmp_path):
    extra = ["--eval-best", "--save-steps", "3", "--save-total-limit", "2"]
    run(hf(tmp_path / "plain", tmp_path / "plain-loss", "--plain", "--resume", "none", *extra), timeout=300)
    log = tmp_path / "audit.jsonl"
    out = run(hf(tmp_path / "wrapped", tmp_path / "wrapped-loss", *extra, log=log), timeout=300)
    wait_no_agent(tmp_path / "wrapped")
    # no advice the user cannot act on: the Trainer reloading its best model is not a loop that changes
    # parameters in place, and a skip that risks nothing is no warning
    said = out.stdout + out.stderr
    assert "changed in place" not in said and "would lose 0 iterations" not in said, said[-3000:]
    plain = sorted(p.name for p in (tmp_path / "plain").glob("checkpoint-*"))
    wrapped = sorted(p.name for p in (tmp_path / "wrapped").glob("checkpoint-*"))
    state = json.loads((tmp_path / "wrapped" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    best = os.path.basename(state["best_model_checkpoint"])
    evals = {e["step"]: e["eval_loss"] for e in state["log_history"] if "eval_loss" in e}
    assert best == f"checkpoint-{min(evals, key=evals.get)}"
    assert wrapped == plain, f"the wrapper kept {wrapped}, the Trainer keeps {plain}"
    assert best in wrapped and f"checkpoint-{STEPS}" in wrapped and len(wrapped) == 2
    if best != f"checkpoint-{STEPS - STEPS % 3}":
        assert best != sorted(wrapped, key=lambda n: int(n.split("-")[1]))[-1]
    deletes = [e for e in events(log) if e["event"] == "delete"]
    assert len(deletes) == STEPS // 3 - 2 and all(e["reason"] == "retention" for e in deletes)

    # a damaged newest checkpoint is never resumed from: the other kept one is, loudly
    wait_no_agent(tmp_path / "wrapped")
    damaged = tmp_path / "wrapped" / f"checkpoint-{STEPS}" / "optimizer.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    other = min(int(n.split("-")[1]) for n in wrapped)
    # the operator tools: ls --verify picks what the loader will; prune keeps the Trainer's best
    listing = cli_json("ls", tmp_path / "wrapped", "--verify", expect=1)   # damage found: exit 1
    rows = {r["step"]: r for r in listing["checkpoints"]}
    assert listing["framework"] == "transformers" and listing["picked"] == other
    assert rows[STEPS]["state"] == "damaged" and "optimizer.pt: checksum" in rows[STEPS]["why"]
    assert rows[other]["layout"] == {"tp": 1, "pp": 1, "dp": 1, "world": 1}
    assert "optimizer.pt: checksum" in cli("verify", tmp_path / "wrapped", expect=1).stdout
    info = cli_json("inspect", tmp_path / "wrapped", other)
    assert info["args"]["trainer_state"]["global_step"] == other
    own = json.loads((tmp_path / "wrapped" / f"checkpoint-{other}" / "trainer_state.json").read_text())
    assert info["args"]["trainer_state"]["best_model_checkpoint"] == own["best_model_checkpoint"]
    assert any(f["file"] == "training_args.bin" and "never unpickles" in f.get("not_loaded", "") for f in info["files"])
    assert info["groups"]["model"]["bytes"] > 0 and info["groups"]["optimizer"]["bytes"] > info["groups"]["model"]["bytes"]
    dry = cli_json("prune", tmp_path / "wrapped", "--keep", "1", "--dry-run")
    # the newest and the best stay (when the newest is the best, the other one goes)
    assert dry["would_delete"] == ([other] if best == f"checkpoint-{STEPS}" else [])
    plain = cli_json("ls", tmp_path / "plain")
    assert {r["state"] for r in plain["checkpoints"]} == {"plain"} and plain["picked"] == STEPS
    assert "NOT CHECKED" in cli("verify", tmp_path / "plain").stdout
    run(hf(tmp_path / "wrapped", tmp_path / "wrapped-loss", *extra, log=log), timeout=300)
    assert any(e["event"] == "error" and e.get("step") == STEPS and "optimizer.pt" in e["message"]
               for e in events(log))
    loads = [e for e in events(log) if e["event"] == "load"]
    assert loads[-1]["source"] == "storage" and loads[-1]["step"] == other
    wait_no_agent(tmp_path / "wrapped")


def test_ls_marks_the_trainers_best_checkpoint_that_save_total_limit_keeps(tmp_path):
    """save_total_limit=2 with load_best_model_at_end keeps the newest checkpoint and the best one: ls says which
    is the best (trainer_state.json's best_model_checkpoint), so an old survivor is explained. A
    best_model_checkpoint that names no step directory of ours marks nothing."""
    out = tmp_path / "out"
    run(hf(out, tmp_path / "loss", "--eval-best", "--best-greater", "--save-steps", "3", "--save-total-limit", "2",
           "--max-steps", "12"), timeout=300)
    wait_no_agent(out)
    state = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    evals = {e["step"]: e["eval_loss"] for e in state["log_history"] if "eval_loss" in e}
    best = max(evals, key=evals.get)           # --best-greater: the highest eval loss is the best
    assert os.path.basename(state["best_model_checkpoint"]) == f"checkpoint-{best}"
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == sorted({best, 12})
    listing = cli_json("ls", out)
    assert listing["best"] == best and {r["step"]: r["best"] for r in listing["checkpoints"]} == \
        {s: s == best for s in {best, 12}}, listing
    text = cli("ls", out).stdout
    row = next(line for line in text.splitlines() if f"checkpoint-{best} " in line)
    assert row.rstrip().endswith(", best"), text
    assert (f"best: step {best} is the Trainer's best_model_checkpoint (metric_for_best_model, in trainer_state.json): "
            f"save_total_limit and `easyckpt prune` keep it whatever its age") in text, text
    for planted in ("/etc/passwd", ["checkpoint-3"], "../checkpoint-x"):      # untrusted input: no best, no crash
        planted_state = json.dumps(dict(state, best_model_checkpoint=planted))
        (out / "checkpoint-12" / "trainer_state.json").write_text(planted_state)
        listing = cli_json("ls", out)
        assert listing["best"] is None and not any(r["best"] for r in listing["checkpoints"]), planted


@pytest.mark.parametrize("form", ["wrapper", "callback"])
def test_a_resume_path_that_does_not_exist_fails_as_the_trainer_does_and_leaves_nothing_behind(tmp_path, form):
    """train(resume_from_checkpoint=<missing path>) raises the plain Trainer's error; nothing was snapshotted, so
    the job's agent leaves at once (not after agent_idle_timeout=60 s) and the lock, the audit log and the
    agent's log this run made are gone: the output_dir is as the plain Trainer leaves it, empty."""
    out, missing = tmp_path / "out", tmp_path / "no-such-checkpoint"
    cmd = script_cmd(HF, 1, "--output-dir", str(out), "--max-steps", "4", "--idle-timeout", "60", "--resume",
                     str(missing), *(["--callback"] if form == "callback" else []))
    failed = run(cmd, timeout=120, check=False)
    assert failed.returncode != 0 and f"Can't find a valid checkpoint at {missing}" in failed.stderr, failed.stderr
    jid = job_id(out)
    deadline = time.monotonic() + 5
    while agent_alive(jid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not agent_alive(jid), "the agent of a run that failed before its first snapshot lingers"
    wait_no_agent(out, timeout=5)
    assert sorted(os.listdir(out)) == [], sorted(os.listdir(out))
    assert not [n for n in shm_segments() if jid in n], shm_segments()


def test_a_resume_path_that_does_not_exist_takes_back_only_what_this_run_made(tmp_path):
    """The same failure in an output_dir an earlier run wrote to: its audit log is kept (only files this run made
    go), with its earlier lines first."""
    out, missing = tmp_path / "out", tmp_path / "no-such-checkpoint"
    out.mkdir()
    earlier = json.dumps({"time": 1.0, "event": "agent_exit", "source": "agent"}) + "\n"
    (out / "easyckpt.log").write_text(earlier)
    cmd = script_cmd(HF, 1, "--output-dir", str(out), "--max-steps", "4", "--idle-timeout", "60", "--resume",
                     str(missing))
    failed = run(cmd, timeout=120, check=False)
    assert failed.returncode != 0 and f"Can't find a valid checkpoint at {missing}" in failed.stderr, failed.stderr
    wait_no_agent(out, timeout=10)
    assert sorted(os.listdir(out)) == ["easyckpt.log"], sorted(os.listdir(out))
    assert (out / "easyckpt.log").read_text().startswith(earlier)


def test_zero2_saved_on_two_processes_resumes_on_one(tmp_path):
    """DeepSpeed refuses a ZeRO checkpoint of another data-parallel size; easyckpt converts it through
    DeepSpeed's universal checkpoint. Without dropout, 1- and 2-process runs differ only by rounding."""
    ref = reference(tmp_path, "--zero", "2", "--dropout", "0", nproc=1)
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    said = []
    resumed = killed_then_resumed(
        hf(out, loss, "--zero", "2", "--dropout", "0", "--step-sleep", "0.1", "--idle-timeout", "2", nproc=2, log=log),
        hf(out, loss, "--zero", "2", "--dropout", "0", nproc=1, log=log), out, loss, tmp_path, kill_at=12, said=said)
    assert resumed >= 10
    assert any(e["event"] == "convert" for e in events(log))
    # issue 51: said as a conversion, timed with it; the missing RNG state of a process the run did not have: expected
    timed = [e for e in events(log) if e["event"] == "resumed"]
    assert len(timed) == 1 and timed[0]["seconds"] > [e for e in events(log) if e["event"] == "load"][-1]["seconds"]
    assert (f"easyckpt: resumed step {resumed} from storage ({out / f'checkpoint-{resumed}'}, verified): " in said[0]
            and f" in {timed[0]['seconds']:.2f} s, converted from 2 rank(s) to 1 through DeepSpeed's universal "
                "checkpoint (the conversion included)\n" in said[0]), said[0][-3000:]
    assert ("no RNG state saved for this process: expected on a new world size (the step was written by 2 rank(s), "
            "this run has 1); it starts a fresh RNG stream") in said[0], said[0][-3000:]
    assert_losses_close(losses(loss), ref, range(resumed + 1, STEPS + 1), rel=1e-4)
    assert not list(out.glob(".easyckpt-universal-*")), "the converted copy was not removed"
    wait_no_agent(out)


@pytest.mark.slow     # (two Trainer runs beside the other workers, timed to be killed)
def test_ddp_restarted_on_fewer_processes_resumes_resharded_from_memory(tmp_path):
    """DDP on 2 processes, killed while the agent keeps their snapshots (120 s), restarted on 1: the newest step comes
    from memory (source "resharded": the whole model and optimizer, decoded as from storage), nothing is read from
    storage; without dropout the losses after it agree with an uninterrupted 1-process run's to rounding, as a
    resume from storage on another world size does (test_zero2_saved_on_two_processes_resumes_on_one)."""
    from harness import killed_then_restarted, why_not_memory

    ref = reference(tmp_path, "--dropout", "0", nproc=1)
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    step, said = killed_then_restarted(
        hf(out, loss, "--dropout", "0", "--step-sleep", "0.2", "--idle-timeout", "120", nproc=2, log=log),
        hf(out, loss, "--dropout", "0", nproc=1, log=log), loss, tmp_path, 12, log, 2)
    wait_no_agent(out)
    loads = {(e["rank"], e["source"], e.get("saved_world_size")) for e in events(log)
             if e["event"] == "load" and e["step"] == step}
    assert loads == {(0, "resharded", 2)}, (loads, why_not_memory(said, log))
    assert f"resumed step {step} from memory, resharded 2 → 1 ranks: the slots of 1 node; 0 B moved between nodes, " \
           f"0 bytes read from storage" in said, said[-3000:]
    assert_losses_close(losses(loss), ref, range(step + 1, STEPS + 1), rel=1e-4)


def test_save_strategy_epoch_and_no_write_what_the_trainer_writes(tmp_path, single_reference):
    """64 samples in batches of 8: the Trainer saves at the end of each epoch (steps 8, 16, 24) with
    save_strategy='epoch', and never with 'no'."""
    run(hf(tmp_path / "wrapped", tmp_path / "wrapped-loss", "--save-strategy", "epoch"), timeout=300)
    run(hf(tmp_path / "none", tmp_path / "none-loss", "--save-strategy", "no"), timeout=300)
    wait_no_agent(tmp_path / "wrapped")
    wait_no_agent(tmp_path / "none")
    assert sorted(p.name for p in (tmp_path / "wrapped").glob("checkpoint-*")) == \
        ["checkpoint-16", "checkpoint-24", "checkpoint-8"]
    assert not list((tmp_path / "none").glob("checkpoint-*")), "save_strategy='no' must write no checkpoint"
    assert losses(tmp_path / "wrapped-loss") == losses(tmp_path / "none-loss") == single_reference


def test_the_wrapper_behaves_as_the_trainer_it_wraps(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from easyckpt.transformers import TrainerWrapper
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)), args=args)
    wrapped = TrainerWrapper(trainer, save_mem_interval=2)
    assert wrapped.args is trainer.args and wrapped.model is trainer.model
    assert wrapped.create_optimizer.__self__ is trainer
    wrapped.custom_flag = 7                      # attributes set on the wrapper land on the Trainer
    assert trainer.custom_flag == 7
    assert "train" in dir(wrapped) and "evaluate" in dir(wrapped) and wrapped.engine is None
    assert isinstance(wrapped.model, torch.nn.Module)
    assert isinstance(wrapped, Trainer) and type(wrapped) is TrainerWrapper and isinstance(wrapped, TrainerWrapper)
    copied = copy.copy(wrapped)          # copies stay wrappers, around the same Trainer
    assert type(copied) is TrainerWrapper and copied._trainer is trainer


# ---- PEFT (LoRA) ------------------------------------------------------------------------------------------

def test_lora_with_tied_embeddings_resumes_exactly_and_writes_checkpoints_peft_and_the_plain_trainer_read(tmp_path):
    """A LoRA adapter on GPT-2 (whose lm_head is tied to its embeddings) under TrainerWrapper: kill -9, then
    SIGTERM, each resumed with the losses of an uninterrupted run. checkpoint-N holds what a plain Trainer
    writes for a PeftModel (adapter_model.safetensors + adapter_config.json, no model weights): PEFT's own
    PeftModel.from_pretrained loads the trained adapter from it, and a plain Trainer resumes from it with
    the same losses. A snapshot holds the adapter, not the model."""
    pytest.importorskip("peft", reason="peft is not installed (pip install -e .[peft])")
    ref, full = reference(tmp_path / "ref", "--lora"), tmp_path / "full.jsonl"
    run(hf(tmp_path / "full", tmp_path / "full-loss", "--max-steps", "2", log=full), timeout=300)
    rnd = random.Random(SEED + 11)
    kill_at, term_at = rnd.randint(3, 9), rnd.randint(13, 19)
    out, loss, log, weights = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl", tmp_path / "end.pt"
    cmd = hf(out, loss, "--lora", "--step-sleep", "0.05", "--dump-weights", str(weights), log=log)
    interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    assert_losses_equal(losses(loss), ref, STEPS, "lora")
    resumed = starts(loss)[1:]
    assert len(resumed) == 2 and resumed[0] >= kill_at - 1 and resumed[1] >= term_at - 1, resumed
    assert {e["source"] for e in events(log) if e["event"] == "load"} == {"none", "memory", "storage"}
    wait_no_agent(out)

    last = out / f"checkpoint-{STEPS}"
    names = set(os.listdir(last))
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json"} <= names and not names & {"model.safetensors", "config.json"}, names
    import torch
    from peft import PeftModel
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(42)        # the base model hf_train.py builds (its --seed)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    loaded = PeftModel.from_pretrained(base, str(last)).state_dict()
    trained = torch.load(weights, weights_only=True)
    lora = [k for k in trained if ".lora_" in k]
    assert lora and all(torch.equal(loaded[k], trained[k]) for k in lora), "PEFT loads another adapter"
    # easyckpt convert: the folder PeftModel.from_pretrained reads (the model itself is not in the checkpoint)
    summary = cli_json("convert", "safetensors", str(out), str(STEPS))
    assert summary["kind"] == "peft-adapter" and sorted(os.listdir(summary["output"])) == \
        ["adapter_config.json", "adapter_model.safetensors"], summary
    torch.manual_seed(42)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    converted = PeftModel.from_pretrained(base, summary["output"]).state_dict()
    assert all(torch.equal(converted[k], trained[k]) for k in lora), "the converted adapter differs"
    # ... or, given the base model, the merged model (checked against the frozen weights' checksum first)
    from transformers import AutoModelForCausalLM
    torch.manual_seed(42)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)).save_pretrained(
        tmp_path / "base")
    torch.manual_seed(43)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)).save_pretrained(
        tmp_path / "other")
    wrong = cli("convert", "safetensors", str(out), str(STEPS), "--output", str(tmp_path / "wrong"),
                "--base-model", str(tmp_path / "other"), expect=1)
    assert "not the model this adapter was trained on" in wrong.stderr and not (tmp_path / "wrong").exists()
    summary = cli_json("convert", "safetensors", str(out), str(STEPS), "--output", str(tmp_path / "merged"),
                       "--base-model", str(tmp_path / "base"))
    assert summary["kind"] == "peft-merged", summary
    merged = AutoModelForCausalLM.from_pretrained(summary["output"]).state_dict()
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                         str(last)).merge_and_unload().state_dict()
    assert set(merged) == set(expected) and all(torch.equal(merged[k], expected[k]) for k in expected)
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    assert not any(torch.equal(merged[k], original[k]) for k in merged if k.endswith("c_attn.weight")), \
        "the merged weights are the base model's: the adapter was not merged"
    # snapshot bytes: the adapter and its optimizer, against the whole model's (both runs' first snapshot)
    snap = lambda path: next(e["bytes"] for e in events(path) if e["event"] == "snapshot")  # noqa: E731
    stall = lambda path: statistics.median(e["seconds"] for e in events(path) if e["event"] == "snapshot")  # noqa: E731
    print(f"LoRA snapshot {snap(log)} bytes, median stall {stall(log) * 1e3:.2f} ms; full-model snapshot "
          f"{snap(full)} bytes, median stall {stall(full) * 1e3:.2f} ms")
    assert snap(log) * 10 < snap(full), (snap(log), snap(full))

    plain = tmp_path / "plain-loss"
    run(hf(tmp_path / "plain", plain, "--lora", "--plain", "--resume", str(out / "checkpoint-20")), timeout=300)
    got = losses(plain)
    assert starts(plain) == [20] and sorted(got) == list(range(21, STEPS + 1))
    assert got == {i: ref[i] for i in got}, "plain Trainer from easyckpt's LoRA checkpoint: other losses"


@pytest.mark.slow
def test_lora_in_the_callback_form_resumes_exactly_after_kill9_and_sigterm(tmp_path):
    """The same LoRA adapter with Trainer(callbacks=[EasyCkptCallback()]): kill -9 then SIGTERM, each resumed
    with the losses of an uninterrupted run; checkpoint-N holds the adapter, not the model."""
    pytest.importorskip("peft", reason="peft is not installed (pip install -e .[peft])")
    ref = reference(tmp_path / "ref", "--lora")
    rnd = random.Random(SEED + 13)
    kill_at, term_at = rnd.randint(3, 9), rnd.randint(13, 19)
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmd = hf(out, loss, "--lora", "--callback", "--step-sleep", "0.05", log=log)
    interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    assert_losses_equal(losses(loss), ref, STEPS, "lora, callback form")
    assert [e["source"] for e in events(log) if e["event"] == "load"] == ["none", "memory", "storage"]
    wait_no_agent(out)
    names = set(os.listdir(out / f"checkpoint-{STEPS}"))
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names, names


def test_the_frozen_weights_checksum_tells_another_base_model_and_refuses_its_adapter():
    """What a LoRA checkpoint does not hold (the frozen weights) is checked at the resume: training the
    adapter leaves the checksum as it is; another base model changes it, and its step is refused."""
    pytest.importorskip("peft", reason="peft is not installed (pip install -e .[peft])")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from easyckpt.errors import CheckpointError
    from easyckpt.transformers import peftmodel
    torch.manual_seed(0)
    model = get_peft_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)),
                           LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"))
    assert peftmodel.peft_model(model) is model and peftmodel.peft_model(model.base_model.model) is None
    before = peftmodel.base_checksum(model)
    state = peftmodel.adapter_state(model)
    assert state and all(".lora_" in k for k in state)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if ".lora_B" in n).add_(1.0)
    assert peftmodel.base_checksum(model) == before
    peftmodel.check_base(before, before, 5)
    with torch.no_grad():
        model.base_model.model.transformer.wte.weight[0, 0] += 1.0
    after = peftmodel.base_checksum(model)
    assert after != before
    with pytest.raises(CheckpointError, match="another base model"):
        peftmodel.check_base(before, after, 5)
    with pytest.raises(CheckpointError, match="adapter does not match"):
        peftmodel.restore_adapter(model, {k: v for k, v in list(state.items())[1:]})
    config = json.loads(peftmodel.config_json(model))
    assert config["peft_type"] == "LORA" and config["target_modules"] == ["c_attn"] and config["inference_mode"]
    # a whole PeftModel saved without its tied lm_head (as checkpoints before adapter files were): the missing
    # key is found tied by storage, whatever its prefix ("base_model.model.")
    from easyckpt.transformers.session import _tied
    whole = {k: v for k, v in model.state_dict().items() if not k.endswith("lm_head.weight")}
    missing = model.load_state_dict(whole, strict=False).missing_keys
    assert missing == ["base_model.model.lm_head.weight"] and _tied(model, missing, whole) == set(missing)


def test_the_trainers_fsdp2_on_cpu_resumes_exactly_after_kill9_and_sigterm_in_the_trainers_own_layout(tmp_path):
    """The Trainer with FSDP2 (fsdp=True, fsdp_config={"fsdp_version": 2}) on 2 CPU ranks, which accelerate allows
    after easyckpt.transformers.cpu.fsdp_on_cpu(): kill -9, then SIGTERM, each resumed with the losses of an
    uninterrupted run on both ranks (from memory, then from storage through DCP's reader). checkpoint-N holds
    what accelerate's FSDP save writes (SHARDED_STATE_DICT): pytorch_model_fsdp_0/ and optimizer_0/, each a
    DCP checkpoint with one data file per rank; a plain Trainer with FSDP resumes from it with the same losses."""
    ref = tmp_path / "ref"
    run(hf(ref / "out", ref / "loss", "--fsdp", nproc=2), timeout=300)
    wait_no_agent(ref / "out")
    rnd = random.Random(SEED + 17)
    kill_at, term_at = rnd.randint(3, 9), rnd.randint(13, 19)
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    # the agent keeps the killed run's snapshot for 60 s: the Trainer's restart on a loaded machine can take more
    # than hf()'s 20, and the resume must come from memory
    cmd = hf(out, loss, "--fsdp", "--step-sleep", "0.05", "--idle-timeout", "60", nproc=2, log=log)
    interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref / "loss", rank), STEPS, f"Trainer FSDP2, rank {rank}")
    assert [e["source"] for e in events(log) if e["event"] == "load" and e.get("rank") == 0] == \
        ["none", "memory", "storage"]
    wait_no_agent(out)
    last = out / "checkpoint-20"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {p.name for p in (last / part).iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}, part
    assert not (last / "model.safetensors").exists() and not (last / "optimizer.pt").exists()

    plain = tmp_path / "plain-loss"
    res = run(hf(tmp_path / "plain", plain, "--fsdp", "--plain", "--resume", str(last), nproc=2), timeout=300,
              check=False)
    # the plain Trainer's FSDP run on CPU (no easyckpt in it) trains to the end, then often aborts while the
    # process exits (std::terminate in torch's teardown, 3 runs in 4 here): its losses are what is compared
    said = res.stdout + res.stderr
    assert res.returncode == 0 or said.count("terminate called without an active exception") >= 1, said[-4000:]
    got = losses(plain)
    assert starts(plain) == [20] and sorted(got) == list(range(21, STEPS + 1)), got
    assert got == {i: losses(ref / "loss")[i] for i in got}, "a plain Trainer from easyckpt's FSDP checkpoint: other losses"


def test_the_trainers_fsdp2_step_of_two_processes_resumed_on_one_says_it_resharded_timing_the_load(tmp_path):
    """issue 51 item 1: FSDP2 under the Trainer, 2 processes -> 1: the resume line said "in 0.00 s" (the engine's
    read alone) while the Trainer's load hooks resharded for 0.9 s. It is said after those hooks, timed with them,
    naming the resharding; the one process's RNG file (rng_state.pth) was never written: said to be expected."""
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    run(hf(out, loss, "--fsdp", nproc=2, log=log), timeout=300)
    wait_no_agent(out)
    one = run(hf(out, loss, "--fsdp", "--max-steps", str(STEPS + 2), nproc=1, log=log), timeout=300)
    wait_no_agent(out)
    said = one.stdout + one.stderr
    assert starts(loss) == [0, STEPS], said[-3000:]
    timed = [e for e in events(log) if e["event"] == "resumed"]
    read = [e for e in events(log) if e["event"] == "load" and e["source"] == "storage"]
    assert len(timed) == 1 and len(read) == 1 and timed[0]["seconds"] > read[0]["seconds"], (timed, read)
    assert (f"easyckpt: resumed step {STEPS} from storage ({out / f'checkpoint-{STEPS}'}, verified): " in said
            and f" in {timed[0]['seconds']:.2f} s, converted from 2 rank(s) to 1 by DCP's resharding (the conversion "
                "included)\n" in said), said[-3000:]
    assert said.index("easyckpt: resumed step") < said.index("easyckpt: no RNG state saved for this process: expected "
                                                             "on a new world size (the step was written by 2 rank(s), "
                                                             "this run has 1); it starts a fresh RNG stream"), \
        said[-3000:]


def test_the_trainers_fsdp1_is_refused_before_anything_starts():
    """FSDP1 (fsdp_version 1, FullyShardedDataParallel) is not supported: refused when the session starts."""
    import types

    from easyckpt.errors import ConfigError
    from easyckpt.transformers.session import _Session
    plugin = types.SimpleNamespace(fsdp_version=1)
    fake = types.SimpleNamespace(is_fsdp_enabled=True, accelerator=types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin)))
    with pytest.raises(ConfigError, match="supports the Trainer's FSDP2.*FSDP1"):
        _Session(fake, None)