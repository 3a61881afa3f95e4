"""The CUDA paths, on a GPU: snapshot slots page-locked (cudaHostRegister), device-to-host copies on a side
stream while the next step runs, the CUDA RNG restored, FSDP2 with a CUDA mesh (NCCL), the HF Trainer's FSDP2
on the GPU. They run only where torch sees a GPU; CI's machines have none, so there they are skipped, saying
so. The same proofs on CPU are in test_overlap.py, test_resume.py, test_fsdp.py and test_transformers.py.

Run on a GPU machine: ``python -m pytest tests/test_cuda.py``.
"""
from __future__ import annotations

import random
import signal

import pytest
import torch
from harness import (
    ROOT,
    TRAIN,
    assert_losses_equal,
    events,
    interrupted_runs,
    losses,
    run,
    script_cmd,
    starts,
    train_cmd,
    wait_no_agent,
)
from inproc import node, ranks

from easyckpt.config import Config
from easyckpt.pytorch import PytorchState
from easyckpt.storage.savedir import SaveDir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no GPU here: the CUDA paths (page-locked slots, side-stream copies) need one")

SEED = 20261126
ITERS = 20


def test_overlapped_device_snapshots_are_pinned_and_persist_the_values_of_their_step(tmp_path):
    """In one process: a model and Adam on the GPU, a snapshot every step copied on the side stream while the
    next step runs; the slots were page-locked, and the step persisted holds exactly the weights of that step
    (the copy was not overtaken by the next optimizer step)."""
    from safetensors.torch import load_file

    cfg = Config(save_dir=str(tmp_path / "ckpt"), save_mem_interval=1, save_storage_interval=3, max_ckpt_num=2,
                 autocheckpoint_on_sigterm=False, snapshot_overlap=True)

    def body(ckpt, group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        at = {}
        for step in range(1, 10):
            x = torch.randn(64, 256, device="cuda")
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            at[step] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            ckpt.save(step, PytorchState(ckpt, model, opt, None, step, None), optimizer=opt)
        pinned = list(ckpt.engine.snapshotter._pinned)
        assert ckpt.finalize() == 9
        return at, pinned

    with node(cfg) as local:
        [(at, pinned)] = ranks(cfg, local, 1, body)
    assert any(pinned), "no snapshot slot was page-locked for the device-to-host copies"
    sd = SaveDir.of(cfg)
    for step, _ in sd.committed(own=True):
        saved = load_file(f"{sd.step_path(step)}/model.safetensors")
        assert set(saved) == set(at[step]) and all(torch.equal(saved[k], at[step][k]) for k in saved), step


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_gpu_run_resumes_exactly_after_kill9_and_sigterm(tmp_path, overlap):
    """The example's loop on the GPU (dropout draws from the CUDA generator): kill -9, then SIGTERM, each
    relaunched; the losses equal an uninterrupted run's bit for bit."""
    # idle 60 s: the killed run's snapshot must outlive the relaunch, whose CUDA start can take more than 10 s
    # (with 10, one H200 run resumed from storage: the agent had left before the relaunch attached)
    common = ["--device", "cuda", "--iters", str(ITERS), "--storage-interval", "4", "--overlap", overlap,
              "--idle-timeout", "60"]
    ref = tmp_path / "ref"
    run(train_cmd(ref / "ckpt", 1, *common, "--loss-file", str(ref / "loss")), timeout=300)
    wait_no_agent(ref / "ckpt")
    rnd = random.Random(SEED)
    kill_at, term_at = rnd.randint(3, 8), rnd.randint(11, 16)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmd = train_cmd(ckpt, 1, *common, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05")
    interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    assert_losses_equal(losses(loss), losses(ref / "loss"), ITERS, f"GPU, overlap {overlap}")
    assert [e["source"] for e in events(log) if e["event"] == "load"] == ["none", "memory", "storage"]
    wait_no_agent(ckpt)


def test_fsdp2_on_a_cuda_mesh_resumes_exactly_after_kill9(tmp_path):
    """FSDP2 with its parameters on the GPU (one rank: this machine's GPU; NCCL for the model, gloo for
    easyckpt's own collectives): kill -9, relaunch, the losses of an uninterrupted run; the step is DCP's
    layout."""
    common = ["--save-dir", "", "--fsdp", "--device", "cuda", "--iters", str(ITERS), "--storage-interval", "4",
              "--idle-timeout", "60"]

    def cmd(save, *more):
        args = list(common)
        args[1] = str(save)
        return script_cmd(TRAIN, 1, *args, *more, torchrun=True)

    ref = tmp_path / "ref"
    run(cmd(ref / "ckpt", "--loss-file", str(ref / "loss")), timeout=300)
    wait_no_agent(ref / "ckpt")
    ckpt, loss = tmp_path / "ckpt", tmp_path / "loss"
    interrupted_runs(cmd(ckpt, "--loss-file", str(loss), "--step-sleep", "0.05"), loss, tmp_path,
                     [(random.Random(SEED).randint(5, 12), signal.SIGKILL)])
    assert_losses_equal(losses(loss), losses(ref / "loss"), ITERS, "FSDP2 on the GPU")
    assert len(starts(loss)) == 2, starts(loss)
    wait_no_agent(ckpt)
    names = {p.name for p in (ckpt / f"step_{ITERS:08d}").iterdir()}
    assert {".metadata", "__0_0.distcp"} <= names, names


HF = ROOT / "examples" / "deepspeed" / "hf_train.py"


def test_the_trainers_fsdp2_on_the_gpu_resumes_exactly_after_kill9_and_sigterm_in_the_trainers_own_layout(tmp_path):
    """The HF Trainer with FSDP2 on the GPU (one rank, NCCL; accelerate's own FSDP path, no CPU switch): kill -9,
    then SIGTERM, each resumed with the losses of an uninterrupted run (from memory, then from storage);
    checkpoint-N is accelerate's sharded layout, and a plain Trainer with FSDP resumes from it with the same
    losses."""
    steps = 24

    def hf(out, loss, *more):
        return script_cmd(HF, 1, "--output-dir", str(out), "--loss-file", str(loss), "--max-steps", str(steps),
                          "--fsdp", "--idle-timeout", "60", *more, torchrun=True)

    ref = tmp_path / "ref"
    run(hf(ref / "out", ref / "loss"), timeout=300)
    wait_no_agent(ref / "out")
    rnd = random.Random(SEED + 17)
    kill_at, term_at = rnd.randint(3, 9), rnd.randint(13, 19)
    out, loss, log = tmp_path / "out", tmp_path / "loss", tmp_path / "audit.jsonl"
    interrupted_runs(hf(out, loss, "--step-sleep", "0.05", "--log-file", str(log)), loss, tmp_path,
                     [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    assert_losses_equal(losses(loss, 0), losses(ref / "loss", 0), steps, "Trainer FSDP2 on the GPU")
    assert [e["source"] for e in events(log) if e["event"] == "load"] == ["none", "memory", "storage"]
    wait_no_agent(out)
    last = out / "checkpoint-20"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {p.name for p in (last / part).iterdir()} == {".metadata", "__0_0.distcp"}, part

    plain = tmp_path / "plain-loss"
    res = run(hf(tmp_path / "plain", plain, "--plain", "--resume", str(last)), timeout=300, check=False)
    # as on CPU (test_transformers.py), the plain Trainer's FSDP run may abort in torch's teardown after training
    said = res.stdout + res.stderr
    assert res.returncode == 0 or "terminate called without an active exception" in said, said[-4000:]
    got = losses(plain, 0)
    assert starts(plain) == [20] and sorted(got) == list(range(21, steps + 1)), got
    assert got == {i: losses(ref / "loss", 0)[i] for i in got}, "a plain Trainer from easyckpt's FSDP checkpoint"
