"""Megatron (megatron-core GPTModel and optimizer, 2 ranks on CPU with gloo, examples/megatron/pretrain_gpt.py) and
DeepSpeed (a real engine, ZeRO-3, examples/deepspeed/train.py) with their checkpoints in an object store
(s3://...), against a real S3 server (Ceph's RADOS Gateway, tests/s3server.py). Nothing is mocked.

- torch and torch_dist layouts on TP=2: kill -9, the agent gone with its snapshots, then a resume from the
  store with the losses of an uninterrupted run;
- a torch_dist checkpoint in the store resumed on TP=1 (Megatron's reader reshards it): the same losses as the
  same resume from a copy of that checkpoint on a local disk;
- DeepSpeed ZeRO-3 (every rank's partition of the parameters and optimizer): kill -9, then a resume from the
  store with the losses of an uninterrupted run; ZeRO-2 saved on 2 ranks in the store resumed on 1 through
  DeepSpeed's universal checkpoint (its converter reads a checked local copy of the step);
- the Hugging Face Trainer (2 processes, DDP, TrainerWrapper, examples/deepspeed/hf_train.py) with save_dir in
  the store beside a local output_dir, evaluating and keeping the best checkpoint: kill -9, then a resume from
  the store with an uninterrupted run's losses, and at the end the best model loaded from the store with the
  weights the uninterrupted run loads from its disk; ``easyckpt convert`` of a step in the store to a local
  folder gives the weights of the same step on a disk; the same Trainer with FSDP2 (its DCP layout, read by DCP's
  reader from a local copy holding each rank's own items, checked) resumed from the store with an uninterrupted
  run's losses; likewise Megatron's torch_dist on the same TP: each rank fetches its half.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import s3server
from harness import (
    ROOT,
    assert_losses_close,
    assert_losses_equal,
    cli,
    events,
    kill_tree,
    losses,
    run,
    script_cmd,
    start,
    starts,
    wait_for_iteration,
    wait_no_agent,
)

pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e .[s3])")

SCRIPT = ROOT / "examples" / "megatron" / "pretrain_gpt.py"
DEEPSPEED = ROOT / "examples" / "deepspeed" / "train.py"
HF = ROOT / "examples" / "deepspeed" / "hf_train.py"


server, bucket = s3server.fixtures()     # the session's gateway, a bucket per test


def cmd(save: str, loss: Path, local: Path, iters: int, *extra: str):
    return script_cmd(SCRIPT, 2, "--cpu", "--quiet", "--iters", str(iters), "--save", save, "--local-dir",
                      str(local), "--loss-file", str(loss), "--save-storage-interval", "4", "--agent-idle-timeout", "1",
                      *extra)


def _rank0(loss: Path):
    return losses(loss, 0) or losses(loss, 1)     # the pipeline's last stage writes the losses


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_killed_resumes_from_the_store_with_an_uninterrupted_runs_losses(bucket, tmp_path, uninterrupted,
                                                                                 fmt):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")
    _store, top = bucket
    layout = ["--tp", "2", "--ckpt-format", fmt]

    def produce(ref: Path):     # on a local disk; the same run as test_megatron's TP=2 reference (its key)
        run(cmd(str(ref / "ckpt"), ref / "loss", ref / "local", 12, *layout), timeout=300)
        wait_no_agent(ref / "ckpt")
        return {f"rank{r}": losses(ref / "loss", r) for r in (0, 1) if losses(ref / "loss", r)}
    reference = uninterrupted(("megatron", 12, 2, "--tp", "2"), produce)
    url, local, loss = f"{top}/meg", tmp_path / "local", tmp_path / "loss"
    proc = start(cmd(url, loss, local, 12, *layout, "--step-sleep", "0.3"), log=tmp_path / "first.out")
    wait_for_iteration(loss, 9, proc, timeout=300)
    kill_tree(proc)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")     # its snapshots gone: the store serves
    second = run(cmd(url, loss, local, 12, *layout), timeout=300)
    assert f"from storage ({url}/iter_" in second.stdout + second.stderr, (second.stdout + second.stderr)[-3000:]
    assert starts(loss)[-1] >= 8, starts(loss)
    assert_losses_equal(_rank0(loss), reference["rank0"], 12, f"Megatron {fmt} from the store")
    if fmt == "torch_dist":    # Megatron's reader opens paths: each rank's copy holds the items its TP half reads
        staged = [e for e in events(local / "easyckpt.log") if e["event"] == "staged"]
        assert sorted(e["rank"] for e in staged) == [0, 1], staged
        assert all(e["fetched"] + e["reused"] < 0.7 * e["listed"] for e in staged), staged
        # the items the load fetched and checked are written from memory, not fetched again (common.pt is)
        assert all(e["fetched"] < 0.02 * e["listed"] < e["reused"] for e in staged), staged


@pytest.mark.parametrize("saved, resumed", [
    (["--tp", "2"], ["--tp", "1"]),
    # the distributed optimizer on DP=2, the same layout (megatron-core's fully_reshardable load asks each rank for all)
    pytest.param(["--use-distributed-optimizer"], ["--use-distributed-optimizer"], marks=pytest.mark.slow),
], ids=["tp2-to-tp1", "distopt-dp2"])
def test_a_torch_dist_checkpoint_in_the_store_resumes_as_from_a_local_disk(bucket, tmp_path, saved, resumed):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")
    _store, top = bucket
    url, local = f"{top}/meg", tmp_path / "local"
    first = tmp_path / "first"
    fmt = ["--ckpt-format", "torch_dist"]
    run(cmd(url, first, local, 8, *saved, *fmt), timeout=300)
    run(cmd(str(tmp_path / "disk"), first, tmp_path / "disk-local", 8, *saved, *fmt), timeout=300)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    wait_no_agent(tmp_path / "disk", timeout=90, log=tmp_path / "disk-local" / "easyckpt.log")
    from_store, from_disk = tmp_path / "from-store", tmp_path / "from-disk"
    out = run(cmd(url, from_store, local, 12, *resumed, *fmt), timeout=300)
    text = out.stdout + out.stderr
    assert f"resumed step 8 from storage ({url}/iter_0000008" in text, text[-3000:]
    assert ("resharded to tp1" in text) == (saved != resumed), text[-3000:]
    run(cmd(str(tmp_path / "disk"), from_disk, tmp_path / "disk-local", 12, *resumed, *fmt), timeout=300)
    got, want = _rank0(from_store), _rank0(from_disk)
    assert sorted(got) == list(range(9, 13)) and got == want, (got, want)
    assert not list(local.glob(".easyckpt-scratch*")) and not [p for p in local.iterdir() if "restore" in p.name]
    staged = [e for e in events(local / "easyckpt.log") if e["event"] == "staged"]
    assert sorted(e["rank"] for e in staged) == [0, 1] and all(e["fetched"] <= e["listed"] for e in staged), staged
    assert all(e["fetched"] < e["reused"] for e in staged), staged      # the load's own reads, not fetched again


def ds(save: str, loss: Path, local: Path, iters: int, *extra: str):
    return script_cmd(DEEPSPEED, 2, "--save-dir", save, "--local-dir", str(local), "--loss-file", str(loss),
                      "--iters", str(iters), "--idle-timeout", "1", "--zero", "3", *extra, torchrun=True)


def test_deepspeed_zero2_saved_on_two_ranks_in_the_store_resumes_on_one_through_the_universal_checkpoint(
        bucket, tmp_path):
    """DeepSpeed's converter opens paths: the step comes through a checked local copy, removed after."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e .[deepspeed])")
    _store, top = bucket
    ref = tmp_path / "ref"
    run(script_cmd(DEEPSPEED, 1, "--save-dir", str(tmp_path / "ref-ckpt"), "--loss-file", str(ref), "--iters", "12",
                   "--idle-timeout", "1", "--zero", "2", "--dropout", "0", torchrun=True), timeout=300)
    url, local, loss = f"{top}/ds-dp", tmp_path / "local", tmp_path / "loss"
    run(script_cmd(DEEPSPEED, 2, "--save-dir", url, "--local-dir", str(local), "--loss-file", str(loss), "--iters", "8",
                   "--idle-timeout", "1", "--zero", "2", "--dropout", "0", torchrun=True), timeout=300)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    second = run(script_cmd(DEEPSPEED, 1, "--save-dir", url, "--local-dir", str(local), "--loss-file", str(loss),
                            "--iters", "12", "--idle-timeout", "1", "--zero", "2", "--dropout", "0", torchrun=True),
                 timeout=300)
    text = second.stdout + second.stderr
    assert f"resumed step 8 from storage ({url}/global_step8" in text, text[-3000:]
    assert any(e["event"] == "convert" for e in events(local / "easyckpt.log"))
    assert_losses_close(losses(loss), losses(ref), range(9, 13), rel=1e-4)
    assert not [p for p in local.iterdir() if "universal" in p.name or "restore" in p.name], sorted(local.iterdir())


def test_deepspeed_zero3_killed_resumes_from_the_store_with_an_uninterrupted_runs_losses(bucket, tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e .[deepspeed])")
    _store, top = bucket
    ref = tmp_path / "ref"
    run(ds(str(tmp_path / "ref-ckpt"), ref, tmp_path / "ref-local", 12), timeout=300)
    url, local, loss = f"{top}/ds", tmp_path / "local", tmp_path / "loss"
    proc = start(ds(url, loss, local, 12, "--step-sleep", "0.3"), log=tmp_path / "first.out")
    wait_for_iteration(loss, 8, proc, timeout=300)
    kill_tree(proc)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")     # its snapshots gone: the store serves
    second = run(ds(url, loss, local, 12), timeout=300)
    assert f"from storage ({url}/global_step" in second.stdout + second.stderr, (second.stdout + second.stderr)[-3000:]
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref, rank), 12, f"DeepSpeed ZeRO-3 rank {rank} from the store")


def hf(out: Path, loss: Path, weights: Path, *extra: str):
    # the best checkpoint is the highest eval loss: an early one, so that loading it changes the weights
    return script_cmd(HF, 2, "--output-dir", str(out), "--loss-file", str(loss), "--max-steps", "20", "--eval-best",
                      "--best-greater", "--dump-weights", str(weights), "--idle-timeout", "1", *extra)


def test_the_trainer_killed_resumes_from_the_store_and_loads_its_best_model_from_there(bucket, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[transformers])")
    import torch
    _store, top = bucket
    ref, ref_weights = tmp_path / "ref", tmp_path / "ref-weights.pt"
    run(hf(tmp_path / "ref-out", ref, ref_weights), timeout=300)
    url, out, loss, weights = f"{top}/hf", tmp_path / "out", tmp_path / "loss", tmp_path / "weights.pt"
    proc = start(hf(out, loss, weights, "--save-dir", url, "--step-sleep", "0.3"), log=tmp_path / "first.out")
    wait_for_iteration(loss, 12, proc, timeout=300)
    kill_tree(proc)
    wait_no_agent(url, timeout=90, log=out / "easyckpt.log")     # its snapshots gone: the store serves
    second = run(hf(out, loss, weights, "--save-dir", url), timeout=300)
    text = second.stdout + second.stderr
    assert f"from storage ({url}/checkpoint-1" in text, text[-3000:]     # 10, or 11 (persisted as the job died)
    assert "does not exist anymore" not in text, text[-3000:]          # the best checkpoint in the store is kept
    assert not list(out.glob("checkpoint-*")), "checkpoint-N go to the store, not to output_dir"
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref, rank), 20, f"Trainer rank {rank} from the store")
    # load_best_model_at_end: the uninterrupted run loads an early checkpoint from its disk; the resumed one the
    # same checkpoint from the store (through a verified local copy, since removed), so the same weights
    best = json.loads((tmp_path / "ref-out" / "checkpoint-20" / "trainer_state.json").read_text())
    assert not best["best_model_checkpoint"].endswith("checkpoint-20"), best["best_model_checkpoint"]
    got, want = torch.load(weights), torch.load(ref_weights)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not [p for p in out.iterdir() if "best" in p.name or "resume" in p.name or "restore" in p.name], \
        sorted(p.name for p in out.iterdir())
    # easyckpt convert reads a step in the store into a local folder (never into the committed step itself)
    refused = cli("convert", "safetensors", url, "20", expect=1)
    assert "object store, where a committed step is never changed: give --output a local path" in refused.stderr
    cli("convert", "safetensors", url, "20", "--output", str(tmp_path / "conv"))
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "conv" / "model.safetensors"))
    want = load_file(str(tmp_path / "ref-out" / "checkpoint-20" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_trainers_fsdp2_killed_resumes_from_the_store_with_an_uninterrupted_runs_losses(bucket, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[transformers])")
    _store, top = bucket

    def fsdp(out: Path, loss: Path, *extra: str):
        return script_cmd(HF, 2, "--output-dir", str(out), "--loss-file", str(loss), "--max-steps", "20", "--fsdp",
                          "--idle-timeout", "1", *extra)
    ref = tmp_path / "ref"
    run(fsdp(tmp_path / "ref-out", ref), timeout=300)
    url, out, loss = f"{top}/fsdp", tmp_path / "out", tmp_path / "loss"
    proc = start(fsdp(out, loss, "--save-dir", url, "--step-sleep", "0.3"), log=tmp_path / "first.out")
    wait_for_iteration(loss, 12, proc, timeout=300)
    kill_tree(proc)
    wait_no_agent(url, timeout=90, log=out / "easyckpt.log")     # its snapshots gone: the store serves
    second = run(fsdp(out, loss, "--save-dir", url), timeout=300)
    assert f"from storage ({url}/checkpoint-1" in second.stdout + second.stderr, (second.stdout + second.stderr)[-3000:]
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref, rank), 20, f"Trainer FSDP2 rank {rank} from the store")
    left = sorted(p.name for p in out.iterdir())
    assert not [n for n in left if "restore" in n or "resume" in n], left     # the local copy is removed
    # DCP's reader opens paths: per rank, a copy of the model's and of the optimizer's items its shards read
    staged = [e for e in events(out / "easyckpt.log") if e["event"] == "staged"]
    assert sorted(e["rank"] for e in staged) == [0, 0, 1, 1], staged
    assert all(e["fetched"] + e["reused"] < 0.7 * e["listed"] for e in staged), staged
    assert all(e["fetched"] < e["reused"] for e in staged), staged      # most of it the load had fetched and checked
