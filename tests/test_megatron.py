"""Megatron (megatron-core GPTModel, Megatron DDP and optimizer, on CPU with gloo): kill -9 and SIGTERM
mid-run, each followed by a resume, with losses equal to an uninterrupted run, for TP=2, PP=2 and DP=2 with the DistributedOptimizer;
the native layout loads through torch.load the way Megatron's own loader reads it."""
from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

import pytest
import torch
from harness import (
    ROOT,
    assert_console,
    assert_losses_close,
    cli,
    cli_json,
    events,
    interrupted_runs,
    run,
    script_cmd,
    wait_no_agent,
)

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

NATIVE_CHECK = ROOT / "tests" / "megatron_native_check.py"
SCRIPT = ROOT / "examples" / "megatron" / "pretrain_gpt.py"
ITERS = 12
CONFIGS = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "dp2_distopt": ["--use-distributed-optimizer"],
           "tp2_torch_dist": ["--tp", "2", "--ckpt-format", "torch_dist"],
           "dp2_distopt_torch_dist": ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"],
           # MoE: 2 experts over 2 ranks, a ChainedOptimizer of two DistributedOptimizers (dense, experts)
           "moe_ep2_distopt_torch_dist": ["--num-experts", "2", "--ep", "2", "--use-distributed-optimizer",
                                          "--ckpt-format", "torch_dist"],
           # virtual pipeline: 2 stages x 2 chunks (the interleaved schedule), in both layouts
           "pp2_vp2": ["--pp", "2", "--vp", "2", "--num-layers", "4"],
           "pp2_vp2_distopt_torch_dist": ["--pp", "2", "--vp", "2", "--num-layers", "4", "--use-distributed-optimizer",
                                          "--ckpt-format", "torch_dist"]}
SLOW_CONFIGS = ("pp2", "dp2_distopt_torch_dist", "moe_ep2_distopt_torch_dist", "pp2_vp2", "pp2_vp2_distopt_torch_dist")
SEED = int(os.environ.get("EASYCKPT_TEST_SEED", "20261122"))


def cmd(save: Path, loss: Path, *extra: str, nproc: int = 2):
    return script_cmd(SCRIPT, nproc, "--cpu", "--quiet", "--iters", str(ITERS), "--save", str(save), "--loss-file",
                      str(loss), "--save-storage-interval", "4", "--agent-idle-timeout", "20", *extra, torchrun=True)


def loss_files(prefix: Path):
    out = {}
    for path in sorted(prefix.parent.glob(prefix.name + ".rank*")):
        vals = {}
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                it, v = line.split()
                vals[int(it)] = v
        out[path.name.rsplit(".", 1)[1]] = vals
    return out


def starts(prefix: Path):
    path = sorted(prefix.parent.glob(prefix.name + ".rank*"))[0]
    return [int(l.split()[2]) for l in path.read_text().splitlines() if l.startswith("# start")]


def reference(uninterrupted, *extra: str, nproc: int = 2):
    """The losses of an uninterrupted run of ``cmd(..., *extra)`` ({"rank<N>": losses} for each rank that
    writes them), run once per session for each layout and shared by the tests of both formats, and by
    test_s3_frameworks' (conftest.uninterrupted)."""
    flags = list(extra)
    if "--ckpt-format" in flags:
        at = flags.index("--ckpt-format")
        del flags[at:at + 2]

    def produce(d: Path):
        run(cmd(d / "ckpt", d / "loss", *extra, nproc=nproc), timeout=300)
        wait_no_agent(d / "ckpt")
        return loss_files(d / "loss")
    return uninterrupted(("megatron", ITERS, nproc, *flags), produce)


# PP=2 repeats the TP=2 path with another mp_rank naming: -m slow (CI stays under 15 minutes)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CONFIGS else n for n in CONFIGS])
def test_interrupted_run_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path, uninterrupted, name):
    """kill -9 of every trainer, relaunch, then SIGTERM to the launcher (torchrun forwards it to its
    workers), relaunch: the stitched losses equal an uninterrupted run's."""
    extra = CONFIGS[name]
    want = reference(uninterrupted, *extra)
    assert want and all(sorted(v) == list(range(1, ITERS + 1)) for v in want.values())

    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    # the killed run's agent keeps its snapshots 120 s: a restart on a loaded machine can take more than 20 s
    args = cmd(ckpt, loss, *extra, "--ckpt-log", str(log), "--step-sleep", "0.15", "--agent-idle-timeout", "120")
    rnd = random.Random(SEED + len(name))
    kill_at, term_at = rnd.randint(3, 5), rnd.randint(7, 9)
    watch = int(sorted(want)[0][len("rank"):])     # with PP only the last stage writes losses
    last = interrupted_runs(args, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)],
                            rank=watch)
    resumed = starts(loss)[1:]
    assert len(resumed) == 2 and resumed[0] >= kill_at - 1 and resumed[1] >= term_at - 1, \
        f"resumed from {resumed} after interrupts at {kill_at}, {term_at}: progress was lost"
    assert any(e["event"] == "load" and e.get("source") == "memory" for e in events(log))
    assert_console(tmp_path, last, resumed, ckpt, "iter_{:07d}".format, nproc=2)   # (stdout, as print_rank_0)
    assert loss_files(loss) == want, "losses after the resumes differ from the uninterrupted run"
    wait_no_agent(ckpt)

    newest = sorted(ckpt.glob("iter_*"))[-1]
    if "torch_dist" in extra:    # Megatron's distributed layout: its loader picks the backend from metadata.json
        assert json.loads((newest / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        common = torch.load(newest / "common.pt", weights_only=False)
        assert common["iteration"] == int(newest.name[5:]) and {"args", "optimizer", "opt_param_scheduler",
                                                               "content_metadata"} <= set(common)
        assert sorted(p.name for p in newest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(common["iteration"])
        return
    # the native file is what Megatron's torch-format loader reads: torch.load of model_optim_rng.pt
    native = torch.load(next(newest.glob("mp_rank_*/model_optim_rng.pt")), weights_only=False)
    assert native["checkpoint_version"] == 3.0 and native["iteration"] == int(newest.name[5:])
    # Megatron-LM's names: one model, or one per virtual pipeline chunk
    models = {"model0", "model1"} if "--vp" in extra else {"model"}
    assert models | {"args", "optimizer", "opt_param_scheduler", "rng_state",
                     "num_floating_point_operations_so_far"} <= set(native)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(native["iteration"])


# the concat path itself is checked exactly in CI by test_concat_state_equals_megatrons_own_resharding...
@pytest.mark.parametrize("saved_dp,resumed_dp,opt", [
    pytest.param(2, 1, "--use-distributed-optimizer", marks=pytest.mark.slow),
    pytest.param(1, 2, "--use-distributed-optimizer", marks=pytest.mark.slow),
    pytest.param(2, 1, "", marks=pytest.mark.slow)], ids=["distopt-2to1", "distopt-1to2", "plain-2to1"])
def test_concat_resumes_on_another_data_parallel_size(tmp_path, uninterrupted, saved_dp, resumed_dp, opt):
    """Saved at one DP size, resumed at the other with concat=True. DP=1 and DP=2 runs of this model
    agree to ~5e-7 on their own, so the resumed losses must match a run that never stopped to 1e-5;
    misplaced moments or main params would put them far apart within a step or two."""
    opt_args = [opt] if opt else []
    half = ITERS // 2
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"

    def launch(nproc, *extra):
        return cmd(ckpt, loss, *opt_args, "--ckpt-log", str(log), *extra, nproc=nproc)

    run(launch(saved_dp, "--iters", str(half)), timeout=300)
    wait_no_agent(ckpt)
    out = run(launch(resumed_dp, "--concat"), timeout=300)
    assert starts(loss)[-1] == half
    assert f"resharded to tp1.pp1.dp{resumed_dp}." in out.stdout, out.stdout[-3000:]
    loads = [e for e in events(log) if e["event"] == "load" and e.get("step")]
    assert loads and all(e["source"] == "storage" for e in loads), "another world size must load from storage"
    want = reference(uninterrupted, *opt_args, nproc=resumed_dp)["rank0"]
    got = loss_files(loss)["rank0"]
    assert sorted(got) == list(range(1, ITERS + 1))
    assert_losses_close(got, want, range(half + 1, ITERS + 1), rel=1e-5)
    wait_no_agent(ckpt)


@pytest.mark.slow
def test_moe_experts_split_over_ranks_resume_from_storage_in_the_torch_layout(tmp_path):
    """MoE with EP 2 in Megatron's torch layout: each EP rank has its own experts, so each writes its own
    model file (Megatron-LM's mp_rank_TT_EEE naming; before, only DP rank 0's was written and rank 1 would
    have resumed rank 0's experts). A resume from storage continues with the losses of a run that never
    stopped, exactly."""
    moe = ["--num-experts", "2", "--ep", "2", "--use-distributed-optimizer", "--iters", "10"]
    ref, ckpt = tmp_path / "ref", tmp_path / "ckpt"
    run(cmd(ref / "ckpt", ref / "loss", *moe), timeout=300)
    run(cmd(ckpt, tmp_path / "loss", *moe, "--iters", "5", "--save-storage-interval", "5"), timeout=300)
    wait_no_agent(ckpt)
    step = ckpt / "iter_0000005"
    assert sorted(p.parent.name for p in step.glob("*/model_optim_rng.pt")) == ["mp_rank_00_000", "mp_rank_00_001"]
    log = tmp_path / "audit.jsonl"
    run(cmd(ckpt, tmp_path / "loss", *moe, "--ckpt-log", str(log)), timeout=300)
    assert [(e["step"], e["source"]) for e in events(log) if e["event"] == "load" and e.get("step")] == \
        [(5, "storage"), (5, "storage")]
    got, reference = loss_files(tmp_path / "loss"), loss_files(ref / "loss")
    assert {r: {i: v for i, v in got[r].items() if i > 5} for r in got} == \
        {r: {i: v for i, v in reference[r].items() if i > 5} for r in reference}
    wait_no_agent(ckpt)
    wait_no_agent(ref / "ckpt")


@pytest.mark.slow   # the refusal's message; tests/test_megatron_reshard.py does the change with concat=True
def test_without_concat_the_torch_layout_refuses_another_tp_size_clearly(tmp_path):
    ckpt, loss = tmp_path / "ckpt", tmp_path / "loss"
    run(cmd(ckpt, loss, "--tp", "2", "--iters", "4"), timeout=300)
    wait_no_agent(ckpt)
    out = run(cmd(ckpt, loss, "--iters", "6", "--agent-idle-timeout", "2", nproc=1), timeout=300, check=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "saved in Megatron's torch layout with tp2.pp1.dp1.vp1.ep1; this run is tp1.pp1.dp1.vp1.ep1" in text, text[-3000:]
    assert "concat=True" in text
    wait_no_agent(ckpt)


def test_a_wrong_flag_at_relaunch_is_incompatible_and_costs_no_checkpoint(tmp_path):
    """Row 30: saved on DP=2 without the DistributedOptimizer, relaunched on one rank with it and concat=True:
    the adapter finds no optimizer shards to merge (its needed() raises a CheckpointError, a ValueError). The
    verdict is "incompatible": the job stops naming it and the step is neither marked damaged nor changed
    (before, it was rejected as damaged, training started over and the next commit replaced it); relaunched
    as saved, the job resumes it."""
    ckpt, loss = tmp_path / "ckpt", tmp_path / "loss"
    run(cmd(ckpt, loss, "--iters", "4"), timeout=300)
    wait_no_agent(ckpt)
    step = ckpt / "iter_0000004"
    before = {str(p.relative_to(step)): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()}
    out = run(cmd(ckpt, loss, "--iters", "8", "--use-distributed-optimizer", "--concat", "--agent-idle-timeout", "2",
                  nproc=1), timeout=300, check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert f"step 4 {step}: incompatible" in text and "on_no_valid_checkpoint" in text, text[-3000:]
    wait_no_agent(ckpt)
    damaged = ckpt / ".easyckpt-damaged.json"
    assert not damaged.exists() or "iter_0000004" not in damaged.read_text()
    assert {str(p.relative_to(step)): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()} == before
    run(cmd(ckpt, loss, "--iters", "6"), timeout=300)
    wait_no_agent(ckpt)
    assert starts(loss)[-1] == 4


@pytest.mark.slow   # the refusal's message; the same check guards the concat tests' layouts
def test_without_concat_a_different_data_parallel_size_is_refused_clearly(tmp_path):
    ckpt, loss = tmp_path / "ckpt", tmp_path / "loss"
    run(cmd(ckpt, loss, "--use-distributed-optimizer", "--iters", "4"), timeout=300)
    wait_no_agent(ckpt)
    out = run(cmd(ckpt, loss, "--use-distributed-optimizer", "--iters", "6", "--agent-idle-timeout", "2", nproc=1), timeout=300, check=False)
    assert out.returncode != 0
    assert "concat=True" in out.stdout + out.stderr
    wait_no_agent(ckpt)


def test_native_keys_and_converter_output_load_through_megatrons_own_paths(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(cmd(ckpt, tmp_path / "loss", "--use-distributed-optimizer", "--iters", "6", "--save-storage-interval", "3"),
        timeout=300)
    wait_no_agent(ckpt)
    conv = run([sys.executable, "-m", "easyckpt.cli", "convert", "megatron-distopt", str(ckpt)], timeout=120)
    assert "distrib_optim.pt" in conv.stdout
    verify = run([sys.executable, "-m", "easyckpt.cli", "verify", "--framework", "megatron", str(ckpt), "6"])
    assert "OK" in verify.stdout, "the converter's output is listed in the manifest and verifies"
    # what an operator sees of it: Megatron's layout, the saved arguments, bytes by group
    info = cli_json("inspect", ckpt)
    assert info["step"] == 6 and info["framework"] == "megatron"
    assert info["layout"] == {"tp": 1, "pp": 1, "dp": 2, "world": 2}
    assert info["args"]["args"]["use_distributed_optimizer"] is True and info["args"]["args"]["iters"] == 6
    assert info["metadata"]["mp_rank_00/model_optim_rng.pt"]["iteration"] == 6
    keys = {(t["file"], t["group"]) for t in info["tensors"]}
    assert {("mp_rank_00/model_optim_rng.pt", "model"), ("mp_rank_00/distrib_optim_dp001.pt", "optimizer"),
            ("mp_rank_00/distrib_optim.pt", "optimizer")} <= keys, keys
    groups = info["groups"]
    assert groups["model"]["bytes"] > 0 and groups["optimizer"]["bytes"] > 2 * groups["model"]["bytes"]
    check = run(script_cmd(NATIVE_CHECK, 2, str(ckpt)), timeout=300)
    assert check.stdout.count("NATIVE OK at iteration 6") == 2, check.stdout[-3000:]
    wait_no_agent(ckpt)


@pytest.mark.slow   # the single-optimizer converter runs in the default tier (above)
def test_the_converter_writes_a_chained_optimizer_as_megatron_does_for_moe(tmp_path):
    """MoE with its experts over 2 ranks: a ChainedOptimizer of a dense and an expert DistributedOptimizer.
    The converter writes each mp_rank_00_EEE/distrib_optim.pt as megatron-core's own
    ChainedOptimizer.save_parameter_state does, and megatron-core's load_parameter_state reads it back to
    the state easyckpt's own loader restores."""
    ckpt, moe = tmp_path / "ckpt", ["--num-experts", "2", "--ep", "2", "--use-distributed-optimizer"]
    run(cmd(ckpt, tmp_path / "loss", *moe, "--iters", "6", "--save-storage-interval", "3"), timeout=300)
    wait_no_agent(ckpt)
    conv = run([sys.executable, "-m", "easyckpt.cli", "convert", "megatron-distopt", str(ckpt)], timeout=120)
    assert conv.stdout.count("distrib_optim.pt") == 2, conv.stdout
    dense = torch.load(ckpt / "iter_0000006" / "mp_rank_00_000" / "distrib_optim.pt", weights_only=False)
    other = torch.load(ckpt / "iter_0000006" / "mp_rank_00_001" / "distrib_optim.pt", weights_only=False)
    assert isinstance(dense, list) and len(dense) == 2 and all(s is not None for s in dense)
    assert other[0] is None and other[1] is not None, "the dense state lives with its DP rank 0 only"
    check = run(script_cmd(NATIVE_CHECK, 2, str(ckpt), "--", *moe), timeout=300)
    assert check.stdout.count("NATIVE OK at iteration 6") == 2, check.stdout[-3000:]
    wait_no_agent(ckpt)


@pytest.mark.slow   # the same promises in the plain layout run in CI (test_faults, test_cli)
def test_pruning_foreign_files_and_a_damaged_shard_in_megatrons_layout(tmp_path):
    """The core promises under Megatron naming: only this job's iter_* dirs are pruned (to max_ckpt_num,
    each delete logged), foreign files stay byte-identical, and a damaged newest shard makes the loader
    fall back to the previous committed iteration, saying which file is bad."""
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    ckpt.mkdir()
    (ckpt / "iter_0000001").mkdir()                      # Megatron's naming, not ours: no manifest
    (ckpt / "iter_0000001" / "mp_rank_00").mkdir()
    (ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"native")
    (ckpt / "notes.txt").write_text("keep me")
    foreign = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    base = ["--use-distributed-optimizer", "--ckpt-log", str(log), "--save-storage-interval", "2",
            "--max-ckpt-num", "2"]
    run(cmd(ckpt, loss, *base, "--iters", "8", "--step-sleep", "0.05"), timeout=300)
    wait_no_agent(ckpt)
    ours = sorted(p.name for p in ckpt.glob("iter_*") if (p / "easyckpt_manifest.json").exists())
    assert len(ours) == 2 and ours[-1] == "iter_0000008", ours
    for path, data in foreign.items():
        assert path.read_bytes() == data, f"{path} was touched"
    ev = events(log)
    committed = {e["step"] for e in ev if e["event"] == "commit"}
    deleted = {e["step"] for e in ev if e["event"] == "delete" and e.get("reason") == "retention"}
    assert deleted == committed - {int(n[5:]) for n in ours}

    previous = int(ours[0][5:])
    shard = ckpt / "iter_0000008" / "mp_rank_00" / "distrib_optim_dp001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    # the operator tools see what the loader will do: Megatron's own directory is not ours, 8 is damaged
    listing = cli_json("ls", ckpt, "--verify", expect=1)   # damage found: exit 1
    rows = {r["step"]: r for r in listing["checkpoints"]}
    assert rows[1]["state"] == "incomplete" and "no manifest" in rows[1]["why"]
    assert rows[8]["state"] == "damaged" and "mp_rank_00/distrib_optim_dp001.pt: checksum" in rows[8]["why"]
    assert listing["picked"] == previous and rows[previous]["layout"] == {"tp": 1, "pp": 1, "dp": 2, "world": 2}
    bad = cli("verify", ckpt, "8", expect=1)
    assert "step 8: DAMAGED" in bad.stdout and "mp_rank_00/distrib_optim_dp001.pt: checksum" in bad.stdout
    run(cmd(ckpt, loss, *base, "--iters", "10"), timeout=300)
    loads = [e for e in events(log) if e["event"] == "load" and e.get("step")]
    assert loads[-1]["step"] == previous and loads[-1]["source"] == "storage"
    assert any(e["event"] == "error" and "distrib_optim_dp001.pt" in e.get("message", "") for e in events(log))
    wait_no_agent(ckpt)


def test_concat_state_equals_megatrons_own_resharding_of_the_converted_checkpoint(tmp_path):
    """State equality at the resume step: a DP=2 checkpoint loaded at DP=1 with concat=True holds exactly
    the main params and Adam moments that Megatron's own dp_zero loader produces from the converted
    distrib_optim.pt on the same DP=1 layout."""
    ckpt = tmp_path / "ckpt"
    run(cmd(ckpt, tmp_path / "loss", "--use-distributed-optimizer", "--iters", "6", "--save-storage-interval", "3"),
        timeout=300)
    wait_no_agent(ckpt)
    run([sys.executable, "-m", "easyckpt.cli", "convert", "megatron-distopt", str(ckpt)], timeout=120)
    check = run(script_cmd(NATIVE_CHECK, 1, str(ckpt), "--concat", torchrun=True), timeout=300)
    assert check.stdout.count("NATIVE OK at iteration 6") == 1, check.stdout[-3000:]
    wait_no_agent(ckpt)


def test_the_hook_says_clearly_when_megatron_training_is_missing():
    try:
        import megatron.training  # noqa: F401
        pytest.skip("megatron.training is importable here; the message is for installs without Megatron-LM")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="megatron.training.*cannot be imported here.*Megatron-LM checkout"):
        import easyckpt.megatron.hook  # noqa: F401


def test_the_hooks_import_error_names_the_module_that_is_really_missing(monkeypatch):
    """megatron.training present but one of its own imports missing (triton, in megatron-core 0.19's wheel
    on a machine without it): the message names that module, not megatron.training."""
    import importlib.abc

    class MissingTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "megatron.training" or name.startswith("megatron.training."):
                raise ModuleNotFoundError("No module named 'triton'", name="triton")
            return None

    monkeypatch.setattr(sys, "meta_path", [MissingTriton(), *sys.meta_path])
    for name in [m for m in sys.modules if m.startswith("megatron.training")] + ["easyckpt.megatron.hook"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match="No module named 'triton'. Install 'triton', which Megatron-LM needs"):
        import easyckpt.megatron.hook  # noqa: F401


@pytest.mark.parametrize("fmt", ["torch_dcp", "fsdp_dtensor"])
def test_a_format_easyckpt_does_not_write_is_refused_at_the_start_naming_the_ones_it_does(tmp_path, fmt):
    """Megatron 0.19's --ckpt-format choices include torch_dcp and fsdp_dtensor: never silently another
    layout (Megatron's loader, run with the same flags, could not read it); refused before anything starts."""
    import argparse

    from easyckpt import megatron as em
    from easyckpt.errors import ConfigError
    args = argparse.Namespace(ckpt_format=fmt, save=str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=rf"ckpt_format '{fmt}' is not written by easyckpt.*torch and torch_dist"):
        em.initialize_easyckpt(args=args)
    assert not (tmp_path / "ckpt").exists()
