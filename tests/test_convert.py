"""`easyckpt convert safetensors`: one committed step → one safetensors file of the full model weights, or for
a Trainer checkpoint a folder that `AutoModelForCausalLM.from_pretrained` loads into the trained model.

Real trainings write the checkpoints (the DeepSpeed engine on 2 ranks under torchrun, gloo; the Trainer under
ZeRO-2 on 2 processes, and alone). Each also dumps the model's full weights as the framework itself sees them
at the checkpointed (last) step, gathered under ZeRO-3: the ground truth the consolidated file must equal
exactly, key by key. Each training runs once per module and serves several tests.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch
from harness import ROOT, run, script_cmd, wait_no_agent
from safetensors.torch import load_file, save_file

TRAIN = ROOT / "examples" / "deepspeed" / "train.py"
HF = ROOT / "examples" / "deepspeed" / "hf_train.py"
STEPS = 4          # a multiple of the storage interval: the last step is a committed checkpoint
MANIFEST = "easyckpt_manifest.json"


def convert(save_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "easyckpt.cli", "convert", "safetensors", str(save_dir), *args],
               timeout=120, check=False)


def assert_weights_equal(path: Path, truth: Dict[str, torch.Tensor]) -> None:
    got = load_file(str(path))
    assert sorted(got) == sorted(truth)
    for key, want in truth.items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), f"{key} differs from the ground truth"


def assert_from_pretrained_loads(folder: Path, truth: Dict[str, torch.Tensor]) -> None:
    """``AutoModelForCausalLM.from_pretrained(folder)`` gives the trained model: its weights equal the ground
    truth's, and its logits equal those of a model built from the checkpoint's config with the truth loaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "float32", config
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    assert type(loaded).__name__ == "GPT2LMHeadModel" and loaded.dtype == torch.float32
    state = loaded.state_dict()
    assert sorted(state) == sorted(truth)
    for key, want in truth.items():
        assert torch.equal(state[key], want), f"from_pretrained loaded {key} unlike the checkpoint"
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))
    reference.load_state_dict(truth)
    ids = torch.arange(2 * 16).reshape(2, 16) % config["vocab_size"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, reference.eval()(ids).logits)


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """The plain DeepSpeed engine, per ZeRO stage, made when first needed: (save dir, full weights)."""
    cache = {}

    def get(zero: str):
        if zero not in cache:
            d = tmp_path_factory.mktemp(f"ds-zero{zero}")
            run(script_cmd(TRAIN, 2, "--save-dir", str(d / "ckpt"), "--zero", zero, "--iters", str(STEPS),
                           "--storage-interval", "2", "--idle-timeout", "1", "--dump-weights", str(d / "truth.pt"),
                           torchrun=True), timeout=300)
            wait_no_agent(d / "ckpt")
            cache[zero] = d / "ckpt", torch.load(d / "truth.pt", weights_only=True)
        return cache[zero]
    return get


def hf_run(tmp_path_factory, name: str, *extra: str, nproc: int):
    d = tmp_path_factory.mktemp(name)
    run(script_cmd(HF, nproc, "--output-dir", str(d / "out"), "--max-steps", str(STEPS), "--save-steps", "2",
                   "--idle-timeout", "1", "--dump-weights", str(d / "truth.pt"), *extra, torchrun=nproc > 1),
        timeout=300)
    wait_no_agent(d / "out")
    return d / "out", torch.load(d / "truth.pt", weights_only=True)


@pytest.fixture(scope="module")
def hf_zero2(tmp_path_factory):
    return hf_run(tmp_path_factory, "hf-zero2", "--zero", "2", nproc=2)


@pytest.fixture(scope="module")
def hf_plain(tmp_path_factory):
    return hf_run(tmp_path_factory, "hf-plain", nproc=1)


@pytest.mark.parametrize("zero", ["3", pytest.param("2", marks=pytest.mark.slow),
                                  pytest.param("0", marks=pytest.mark.slow)])
def test_deepspeed_checkpoint_consolidates_to_the_engines_full_fp32_weights(tmp_path, deepspeed_runs, zero):
    ckpt, truth = deepspeed_runs(zero)
    step_dir = ckpt / f"global_step{STEPS}"
    manifest_before = (step_dir / MANIFEST).read_bytes()
    out = tmp_path / "model.safetensors"
    done = convert(ckpt, "--output", str(out), "--json", "--progress")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["kind"] == f"deepspeed-zero{zero}" and summary["step"] == STEPS
    assert summary["tensors"] == len(truth) and summary["bytes"] == sum(t.nbytes for t in truth.values())
    assert "read: 100%" in done.stderr and "write: 100%" in done.stderr, "no progress bars with --progress"
    assert_weights_equal(out, truth)
    assert (step_dir / MANIFEST).read_bytes() == manifest_before, "an output outside the step changed the checkpoint"
    refused = convert(ckpt, "--output", str(tmp_path / "folder"))
    assert refused.returncode == 1 and "no model config" in refused.stderr and ".safetensors" in refused.stderr
    assert not (tmp_path / "folder").exists()
    # the layout is DeepSpeed's own: its tools read it too (our test's own files, so their unrestricted
    # torch.load is acceptable here) and agree
    if zero == "0":
        # ZeRO-0 has no optimizer partitions and DeepSpeed saves param_shapes=None: its zero_to_fp32 cannot
        # read such a checkpoint (its own saves included). The engine's own loader restores the module
        # from the model-states file's "module" (load_module_state_dict): that must be what we converted.
        native = torch.load(step_dir / "mp_rank_00_model_states.pt", weights_only=False)
        assert native["param_shapes"] is None and not list(step_dir.glob("*optim_states.pt"))
        theirs = native["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=f"global_step{STEPS}")
    assert sorted(theirs) == sorted(truth) and all(torch.equal(theirs[k], truth[k]) for k in truth)


def test_hf_trainer_under_zero2_consolidates_the_fp32_weights_tied_ones_included(tmp_path, hf_zero2):
    out_dir, truth = hf_zero2
    out = tmp_path / "model.safetensors"
    done = convert(out_dir, "--output", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kind"] == "hf-deepspeed-zero2"
    assert "lm_head.weight" in truth           # tied to the input embedding; every key is kept
    assert_weights_equal(out, truth)
    trainer_copy = load_file(str(out_dir / f"checkpoint-{STEPS}" / "model.safetensors"))
    assert all(torch.equal(truth[k], v) for k, v in trainer_copy.items())
    # a folder: the fp32 masters as from_pretrained reads them, next to the Trainer's model files
    folder = tmp_path / "pretrained"
    done = convert(out_dir, "--output", str(folder), "--json")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert_from_pretrained_loads(folder, truth)


def test_hf_trainer_checkpoint_consolidates_its_model_weights(tmp_path, hf_plain):
    out_dir, truth = hf_plain
    out = tmp_path / "model.safetensors"
    done = convert(out_dir, "--output", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kind"] == "hf"
    # the Trainer stores a tied weight once (save_pretrained's rule); the file keeps what it stored
    assert_weights_equal(out, {k: v for k, v in truth.items() if k != "lm_head.weight"})


def test_default_output_is_a_from_pretrained_folder_in_the_step_that_verify_covers_and_sources_are_never_replaced(
        hf_plain):
    from easyckpt.cli.consolidate import to_safetensors
    from easyckpt.cli.pretrained import to_pretrained
    out_dir, truth = hf_plain
    step_dir = out_dir / f"checkpoint-{STEPS}"
    trainer_config = json.loads((step_dir / "config.json").read_text())
    assert trainer_config["architectures"] == ["GPT2LMHeadModel"] and trainer_config["dtype"] == "float32", \
        "TrainerWrapper's config.json lacks what save_pretrained writes"
    done = convert(out_dir, str(STEPS))
    assert done.returncode == 0, done.stderr
    folder = step_dir / "consolidated"
    assert f"from_pretrained({str(folder)!r})" in done.stdout, done.stdout
    to_pretrained(str(step_dir))       # a second conversion replaces its own earlier output
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        entry = files[f"consolidated/{name}"]
        assert entry["size"] == (folder / name).stat().st_size and entry["derived_by"]
    assert (folder / "generation_config.json").read_bytes() == (step_dir / "generation_config.json").read_bytes()
    assert_weights_equal(folder / "model.safetensors", {k: v for k, v in truth.items() if k != "lm_head.weight"})
    assert_from_pretrained_loads(folder, truth)
    output = step_dir / "consolidated.safetensors"       # the one-file form, inside the step too
    to_safetensors(str(step_dir), str(output))
    assert json.loads((step_dir / MANIFEST).read_text())["files"]["consolidated.safetensors"]["size"] == \
        output.stat().st_size
    verify = run([sys.executable, "-m", "easyckpt.cli", "verify", str(out_dir), str(STEPS), "--framework",
                  "transformers"], timeout=60, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    model = step_dir / "model.safetensors"
    before = model.read_bytes()
    with pytest.raises(ValueError, match="refusing to replace"):
        to_safetensors(str(step_dir), str(model))
    assert model.read_bytes() == before


def test_weights_above_the_shard_size_are_sharded_with_an_index_and_an_earlier_layout_is_replaced(tmp_path, hf_plain):
    from easyckpt.cli.pretrained import to_pretrained
    out_dir, truth = hf_plain
    step_dir = out_dir / f"checkpoint-{STEPS}"
    folder = tmp_path / "pretrained"
    to_pretrained(str(step_dir), str(folder))
    total = sum(t.nbytes for k, t in truth.items() if k != "lm_head.weight")
    summary = to_pretrained(str(step_dir), str(folder), max_shard_bytes=total // 3)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (folder / "model.safetensors").exists(), "the single file of before remains"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total == summary["bytes"]
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    assert all(load_file(str(p)) for p in shards)
    assert_from_pretrained_loads(folder, truth)
    with pytest.raises(ValueError, match="checkpoint itself"):
        to_pretrained(str(step_dir), str(step_dir))


@pytest.mark.parametrize("layout", ["sharded-safetensors", "pytorch_model.bin"])
def test_other_trainer_weight_layouts_consolidate_to_the_same_file(tmp_path, hf_plain, layout):
    """The Trainer's other layouts of the same weights (sharded with an index, or a torch pickle), written
    into a copy of a committed checkpoint-N and listed in its manifest."""
    from easyckpt.cli.consolidate import to_safetensors
    from easyckpt.formats import manifest as mf
    out_dir, _ = hf_plain
    step_dir = tmp_path / f"checkpoint-{STEPS}"
    shutil.copytree(out_dir / f"checkpoint-{STEPS}", step_dir)
    weights = load_file(str(step_dir / "model.safetensors"))
    os.unlink(step_dir / "model.safetensors")
    keys = sorted(weights)
    if layout == "sharded-safetensors":
        shards = {"model-00001-of-00002.safetensors": keys[:len(keys) // 2],
                  "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
        for name, part in shards.items():
            save_file({k: weights[k] for k in part}, str(step_dir / name), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
        (step_dir / "model.safetensors.index.json").write_text(json.dumps(index))
        written = [*shards, "model.safetensors.index.json"]
    else:
        torch.save(weights, step_dir / "pytorch_model.bin")
        written = ["pytorch_model.bin"]
    man = json.loads((step_dir / MANIFEST).read_text())
    del man["files"]["model.safetensors"]
    for name in written:
        data = (step_dir / name).read_bytes()
        man["files"][name] = {"size": len(data), "checksum": mf.checksum(data)}
    (step_dir / MANIFEST).write_text(json.dumps(man))
    summary = to_safetensors(str(step_dir), str(tmp_path / "out.safetensors"))
    assert summary["kind"] == "hf" and summary["tensors"] == len(weights)
    assert_weights_equal(tmp_path / "out.safetensors", weights)


def test_damaged_shard_fails_naming_the_file_and_writes_nothing(tmp_path, deepspeed_runs):
    ckpt, _ = deepspeed_runs("3")
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    victim = copy / f"global_step{STEPS}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    done = convert(copy, "--output", str(out_dir / "model.safetensors"))
    assert done.returncode == 1
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in done.stderr and "corrupted" in done.stderr, done.stderr
    assert list(out_dir.iterdir()) == [], "a damaged source left an output (or a temporary file) behind"


def test_a_directory_without_a_committed_checkpoint_is_refused(tmp_path):
    from easyckpt.cli.consolidate import to_safetensors
    done = convert(tmp_path, "--output", str(tmp_path / "x.safetensors"))
    assert done.returncode == 2 and "checkpoint" in done.stderr, done.stderr
    (tmp_path / "global_step3").mkdir()       # named like a step, but nothing was committed
    with pytest.raises(ValueError, match="not a committed easyckpt checkpoint"):
        to_safetensors(str(tmp_path / "global_step3"), str(tmp_path / "x.safetensors"))
    assert not (tmp_path / "x.safetensors").exists()


LOAD_ADAPTER = """
import json, sys, torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(42)       # the base model as hf_train.py builds it (from a config, its --seed)
base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
model = PeftModel.from_pretrained(base, sys.argv[1])
state, saved = model.state_dict(), load_file(sys.argv[1] + "/adapter_model.safetensors")
lora = {k: v for k, v in state.items() if ".lora_" in k}
assert len(lora) == len(saved) and all(any(torch.equal(v, s) for s in saved.values()) for v in lora.values())
print("loaded", len(lora))
"""


def test_a_lora_adapter_of_a_config_built_model_converts_with_the_hint_that_loads_it(tmp_path):
    """The base model was built from a config (adapter_config.json: base_model_name_or_path null), so
    from_pretrained of the adapter folder would look it up on the Hub and fail: the printed hint is PEFT's load
    onto the base built as in training, and that call, run as a user would, loads the adapter."""
    pytest.importorskip("peft", reason="peft is not installed (pip install -e .[peft])")
    out = tmp_path / "out"
    run(script_cmd(HF, 1, "--output-dir", str(out), "--max-steps", "2", "--save-steps", "2", "--idle-timeout", "1",
                   "--lora"), timeout=300)
    wait_no_agent(out)
    folder = out / "checkpoint-2" / "consolidated"
    said = convert(out, "2")
    assert said.returncode == 0, said.stderr
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert (f"load it with: PeftModel.from_pretrained(base, {str(folder)!r}), with base the model the adapter was "
            f"trained on, built as in training (adapter_config.json names no base model: base_model_name_or_path "
            f"is null, so AutoModelForCausalLM.from_pretrained cannot load this folder); or --base-model") \
        in said.stdout, said.stdout
    assert "from_pretrained-ready" not in said.stdout
    loaded = run([sys.executable, "-c", LOAD_ADAPTER, str(folder)], extra_env={"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert loaded.stdout.startswith("loaded "), loaded.stdout
