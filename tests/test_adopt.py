"""Row 26: checkpoints the frameworks wrote themselves (no easyckpt manifest) in the save directory are
adopted: easyckpt resumes from the newest complete one, says so on the console, leaves it untouched, and
its own later saves commit beside it. Real frameworks in real processes, written by their own savers:
Megatron (megatron-core objects saved as Megatron-LM's --ckpt-format torch does), a plain DeepSpeed engine
(engine.save_checkpoint) and the plain HF Trainer (save_strategy="steps")."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from harness import (
    ROOT,
    committed_steps,
    events,
    losses,
    run,
    script_cmd,
    starts,
    wait_no_agent,
)


def tree_bytes(path: Path):
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def adopted_loads(log: Path):
    return [e for e in events(log) if e["event"] == "load" and e.get("source") == "adopted"]


# ---- Megatron -----------------------------------------------------------------------------------------

MEGATRON = ROOT / "examples" / "megatron" / "pretrain_gpt.py"


def megatron_cmd(script: Path, *args: str):
    return script_cmd(script, 2, *args)


def megatron_losses(prefix: Path):
    return {int(line.split()[0]): line.split()[1] for line in Path(f"{prefix}.rank1").read_text().splitlines()
            if line and not line.startswith("#")}


# TP=2: each rank its own mp_rank_TT file; DP=2 with the DistributedOptimizer: Megatron's gathered
# distrib_optim.pt, read by DP rank 0 and scattered by megatron-core's own dp_zero loader
# torch_dist with the DistributedOptimizer: Megatron-LM's default dp_reshardable sharding, read back in the
# sharding its content metadata names (asking for fully_reshardable keys crashed: KeyError)
MEGATRON_LAYOUTS = {"tp2": (["--tp", "2"], ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]),
                    "dp2_distopt": (["--use-distributed-optimizer"],
                                    ["mp_rank_00/model_optim_rng.pt", "mp_rank_00/distrib_optim.pt"]),
                    "dp2_distopt_torch_dist": (["--use-distributed-optimizer", "--ckpt-format", "torch_dist"],
                                               [".metadata", "metadata.json", "__0_0.distcp", "__1_0.distcp"]),
                    "dp2_distopt_torch_dist_fully_reshardable": (
                        ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"],
                        [".metadata", "metadata.json", "__0_0.distcp"])}     # (rank 0 holds every replica here)
# megatron-core 0.16's saver adds common.pt and a second file per rank (__R_1.distcp); 0.19's keeps the common
# state inside the DCP files
TORCH_DIST_EXTRA = re.compile(r"common\.pt|__\d+_\d+\.distcp")


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow) if n.endswith("fully_reshardable") else n
                                    for n in sorted(MEGATRON_LAYOUTS)])     # (the other sharding: the slow tier)
def test_megatrons_own_checkpoint_is_adopted_and_later_saves_commit(tmp_path, layout):
    """Megatron saved iteration 3 itself (iter_0000003, tracker "3", no manifest); a relaunch with easyckpt
    resumes from it with Megatron's state (losses equal an uninterrupted run's), says so on the console,
    and commits its own later iterations while iter_0000003 stays byte-identical."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")
    extra, files = MEGATRON_LAYOUTS[layout]
    common = ["--cpu", "--quiet", *extra, "--iters", "8"]
    ckpt, ref, loss, log = tmp_path / "ckpt", tmp_path / "ref-loss", tmp_path / "loss", tmp_path / "audit.jsonl"
    sharding = {"NATIVE_OPTIM_SHARDING": "fully_reshardable"} if layout.endswith("fully_reshardable") else None
    run(megatron_cmd(ROOT / "tests" / "megatron_native_save.py", str(ckpt), "3", "--", *common, "--loss-file",
                     str(ref)), extra_env=sharding, timeout=300)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    native = tree_bytes(ckpt / "iter_0000003")
    names = {p.relative_to(ckpt / "iter_0000003").as_posix() for p in native}
    if "torch_dist" in layout:
        assert set(files) <= names and all(TORCH_DIST_EXTRA.fullmatch(n) for n in names - set(files)), names
    else:
        assert names == set(files)

    out = run(megatron_cmd(MEGATRON, *common, "--loss-file", str(loss), "--save", str(ckpt),
                           "--save-storage-interval", "4", "--ckpt-log", str(log), "--agent-idle-timeout", "5"),
              timeout=300)
    assert "easyckpt: resuming from Megatron's own checkpoint iter_0000003 (no easyckpt manifest)" in out.stdout, \
        out.stdout[-3000:] + out.stderr[-3000:]
    assert [int(l.split()[2]) for l in Path(f"{loss}.rank1").read_text().splitlines() if l.startswith("# start")] \
        == [3], "easyckpt did not resume from Megatron's iteration 3"
    got, want = megatron_losses(loss), megatron_losses(ref)     # the plain run went on to 8 without stopping
    assert sorted(got) == list(range(4, 9)) and got == {i: want[i] for i in got}, "losses after adopting differ"
    assert {e["step"] for e in adopted_loads(log)} == {3}
    wait_no_agent(ckpt)
    mine = committed_steps(ckpt, "iter_*")        # (a snapshot may be skipped under back-pressure)
    assert mine and mine[-1] == 8 and min(mine) > 3, mine
    assert tree_bytes(ckpt / "iter_0000003") == native, "Megatron's own checkpoint was touched"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "8"


# ---- DeepSpeed ----------------------------------------------------------------------------------------

DS_TRAIN = ROOT / "examples" / "deepspeed" / "train.py"


def test_plain_deepspeed_checkpoint_is_adopted_and_a_save_newer_than_latest_is_not(tmp_path):
    """engine.save_checkpoint alone wrote global_step4, 8, 12 (and 16, removed: as if the plain run had
    stopped at 15) and ``latest`` names global_step8: global_step12 is a save that never finished. easyckpt's
    DeepSpeed verbs resume from global_step8 with DeepSpeed's state (the plain run's own losses from there
    on; client_state checked by the example) and say so; global_step12 is passed over loudly, left alone."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e .[deepspeed])")
    ckpt, ref, loss, log = tmp_path / "ckpt", tmp_path / "ref-loss", tmp_path / "loss", tmp_path / "audit.jsonl"
    base = ["--save-dir", str(ckpt), "--zero", "2", "--dropout", "0", "--iters", "16"]
    run(script_cmd(ROOT / "tests" / "deepspeed_native_save.py", 2, "4", "--", *base, "--loss-file", str(ref)),
        timeout=300)
    assert (ckpt / "latest").read_text() == "global_step16"
    shutil.rmtree(ckpt / "global_step16")
    (ckpt / "latest").write_text("global_step8")
    native = tree_bytes(ckpt)

    out = run(script_cmd(DS_TRAIN, 2, *base, "--loss-file", str(loss), "--storage-interval", "5", "--idle-timeout", "5",
                         "--log-file", str(log)), timeout=300)
    said = out.stdout + out.stderr
    assert "easyckpt: resuming from DeepSpeed's own checkpoint global_step8 (no easyckpt manifest)" in said, said[-4000:]
    assert "global_step12 is newer than the step latest names (8)" in said, said[-4000:]
    assert starts(loss) == [8]
    for rank in (0, 1):
        got, want = losses(loss, rank), losses(ref, rank)
        assert sorted(got) == list(range(9, 17)) and got == {i: want[i] for i in got}, f"rank {rank} after adopting"
    assert {e["step"] for e in adopted_loads(log)} == {8}
    wait_no_agent(ckpt)
    mine = committed_steps(ckpt, "global_step*")
    assert mine and mine[-1] == 16 and min(mine) > 8, mine
    assert {p: b for p, b in tree_bytes(ckpt).items() if p in native and p.name != "latest"} == \
        {p: b for p, b in native.items() if p.name != "latest"}, "DeepSpeed's own files were touched"


# ---- the HF Trainer -----------------------------------------------------------------------------------

HF = ROOT / "examples" / "deepspeed" / "hf_train.py"


def test_plain_trainers_newest_complete_checkpoint_is_adopted(tmp_path):
    """The plain Trainer wrote checkpoint-5, -10 and -15 (save_strategy="steps", save_steps=5); checkpoint-15's
    optimizer.pt is truncated. TrainerWrapper(trainer).train(resume_from_checkpoint=True) passes over
    checkpoint-15 (it does not load), resumes from checkpoint-10 (equal losses), and says both."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[transformers])")
    out_dir, ref, loss, log = tmp_path / "out", tmp_path / "ref-loss", tmp_path / "loss", tmp_path / "audit.jsonl"
    run(script_cmd(HF, 1, "--output-dir", str(out_dir), "--loss-file", str(ref), "--max-steps", "20", "--save-steps",
                   "5", "--plain", "--resume", "none"), timeout=300)
    shutil.rmtree(out_dir / "checkpoint-20")          # as if the plain run had been stopped after step 17
    optim = out_dir / "checkpoint-15" / "optimizer.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    native = tree_bytes(out_dir)

    out = run(script_cmd(HF, 1, "--output-dir", str(out_dir), "--loss-file", str(loss), "--max-steps", "20",
                         "--save-steps", "5", "--idle-timeout", "5", "--log-file", str(log)), timeout=300)
    said = out.stdout + out.stderr
    assert "easyckpt: the HF Trainer's own checkpoint checkpoint-15 is incomplete or unreadable" in said, said[-4000:]
    assert "optimizer.pt: unreadable" in said
    assert "easyckpt: resuming from the HF Trainer's own checkpoint checkpoint-10 (no easyckpt manifest)" in said, \
        said[-4000:]
    assert starts(loss) == [10]
    got, want = losses(loss), losses(ref)           # the plain run went on to 20 without stopping
    assert sorted(got) == list(range(11, 21)) and got == {i: want[i] for i in got}, "losses after adopting differ"
    assert {e["step"] for e in adopted_loads(log)} == {10}
    wait_no_agent(out_dir)
    # the resumed Trainer saves at 15 and 20 (save_steps comes back with trainer_state.json); what becomes of
    # step 15, whose name the Trainer's own unreadable directory holds, is the agent's concern, not this row's
    assert 20 in committed_steps(out_dir, "checkpoint-*")
    kept = {p: b for p, b in native.items() if p.parent.name in ("checkpoint-5", "checkpoint-10")}
    assert {p: b for p, b in tree_bytes(out_dir).items() if p in kept} == kept, "the Trainer's own files were touched"


# ---- what is read, and what is not (no framework needed: the loader's own rules) ----------------------

def test_adoption_reads_only_regular_files_inside_the_step_and_never_a_damaged_easyckpt_step(tmp_path):
    """A native step whose needed file is a symlink to a file outside is incomplete (the target is never
    opened); a file that unpickles a non-allow-listed global is refused (nothing runs); a step directory
    that is itself a symlink, or carries an easyckpt manifest (even a damaged one), is not a candidate;
    a directory newer than the framework's tracker is passed over, and said."""
    import torch

    from easyckpt.config import NAMINGS
    from easyckpt.engine.load import adopt

    naming = NAMINGS["megatron"]
    save = tmp_path / "save"
    outside = tmp_path / "outside.pt"
    torch.save({"iteration": 1}, outside)

    def step(n, payload=None):
        d = save / f"iter_{n:07d}" / "mp_rank_00"
        d.mkdir(parents=True)
        if payload is not None:
            torch.save(payload, d / "model_optim_rng.pt")
        return d

    step(1).joinpath("model_optim_rng.pt").symlink_to(outside)                   # a link out of the step
    step(2, {"iteration": 2, "hook": print})                                       # a pickled global, not data
    step(3, {"iteration": 3}).parent.joinpath("easyckpt_manifest.json").write_text("{not json")   # ours, damaged
    step(4, {"iteration": 4, "weights": torch.ones(2)})                            # complete
    (save / "iter_0000005").symlink_to(save / "iter_0000004", target_is_directory=True)
    step(6, {"iteration": 6})                                                      # newer than the tracker
    (save / "latest_checkpointed_iteration.txt").write_text("5")

    said = []
    found = {c.step: c for c in adopt.candidates(str(save), naming, said.append)}
    assert sorted(found) == [1, 2, 4]
    assert said == ["Megatron's own checkpoint iter_0000006 is newer than the step "
                    "latest_checkpointed_iteration.txt names (5): an interrupted save, not adopted"]
    needed = lambda inv: [("mp_rank_00/model_optim_rng.pt", False), ("easyckpt_rng/rank_00000.safetensors", True)]
    trees, problem, _, inv = adopt.read_candidate(found[1], needed)
    assert trees is None and problem == "mp_rank_00/model_optim_rng.pt: missing" and not inv.files
    trees, problem, _, _ = adopt.read_candidate(found[2], needed)
    assert trees is None and "not on easyckpt's allow-list" in problem and "print" in problem
    trees, problem, nbytes, inv = adopt.read_candidate(found[4], needed)
    assert problem is None and trees["mp_rank_00/model_optim_rng.pt"]["iteration"] == 4
    assert inv.adopted and inv.checksum is None and inv.info == {"tp": 1, "pp": 1}
    assert nbytes == (save / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").stat().st_size
