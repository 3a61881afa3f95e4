"""The overlapped snapshot: tensors the optimizer owns are copied while the next forward/backward runs,
and the optimizer's step waits for that copy. What is persisted for step S must still be step S.

The background copy is slowed down (fault point ``trainer.background_copy``) so that every optimizer
step really arrives while a copy is in flight: without the step pre-hook the next step would change
the parameters and Adam moments in the middle of the copy, and these comparisons would fail.
"""
from __future__ import annotations

import os
import secrets
import signal

import pytest
import torch
from harness import (
    assert_losses_equal,
    committed_steps,
    events,
    interrupted_runs,
    losses,
    run,
    train_cmd,
    wait_no_agent,
)
from safetensors.torch import load_file

from easyckpt.engine.save.overlap import (
    OVERLAP_MIN_BYTES,
    OptimizerWatch,
    auto_overlap,
    owned_bytes,
    torch_optimizers,
)
from easyckpt.engine.save.snapshot import (
    PendingSnapshot,
    ShardSpec,
    Snapshotter,
    read_snapshot,
)
from easyckpt.engine.shards.shardload import decode
from easyckpt.engine.shards.tree import rebuild
from easyckpt.ipc import shm
from easyckpt.storage.stepfiles import read_entry
from easyckpt.units import human

SLOW_COPY = {"EASYCKPT_FAULTS": "trainer.background_copy=sleep:0.3"}


def _flat(tree, prefix=""):
    """(path, tensor or value) leaves of a nested dict/list, for an exact comparison."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}/{i}")
    else:
        yield prefix, tree


def _assert_same(got, want, what):
    got, want = dict(_flat(got)), dict(_flat(want))
    assert got.keys() == want.keys(), f"{what}: keys differ"
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert torch.equal(got[k], want[k]), f"{what}: {k} differs from the state at the snapshot step"
        else:
            assert got[k] == want[k], f"{what}: {k}: {got[k]!r} != {want[k]!r}"


def test_overlapped_snapshots_persist_the_values_of_their_step(tmp_path):
    ckpt, dumps, log = tmp_path / "ckpt", tmp_path / "dumps", tmp_path / "audit.log"
    dumps.mkdir()
    run(train_cmd(ckpt, 2, "--iters", "8", "--storage-interval", "2", "--max-ckpt", "10",
                  "--dump-dir", str(dumps), "--log-file", str(log), "--overlap", "on"), extra_env=SLOW_COPY)
    wait_no_agent(ckpt)
    steps = committed_steps(ckpt)
    assert steps == [2, 4, 6, 8]
    for s in steps:
        d = ckpt / f"step_{s:08d}"
        _assert_same(load_file(str(d / "model.safetensors")), torch.load(dumps / f"model_{s}.pt"), f"step {s} model")
        skeleton, tensors = decode(read_entry(str(d), "optimizer.safetensors"))
        _assert_same(rebuild(skeleton, tensors)["optimizer"], torch.load(dumps / f"optim_{s}.pt"),
                     f"step {s} optimizer")
    snaps = [e for e in events(log) if e["event"] == "snapshot" and e["step"] < 8]
    assert len(snaps) == 14 and all("background_seconds" in e for e in snaps), "every snapshot was overlapped"
    # the next optimizer step came while the 0.3 s copy ran, and waited for it: the hook did its job
    assert all(e["seconds"] >= 0.2 for e in snaps), [e["seconds"] for e in snaps]


@pytest.mark.slow   # another layout of test_resume's kill -9 runs
def test_resume_after_kill_with_overlap_equals_uninterrupted(tmp_path):
    common = ["--iters", "12", "--storage-interval", "4", "--step-sleep", "0.05", "--overlap", "on"]
    run(train_cmd(tmp_path / "ref", 2, *common, "--loss-file", str(tmp_path / "ref_loss")))
    wait_no_agent(tmp_path / "ref")
    cmd = train_cmd(tmp_path / "ckpt", 2, *common, "--loss-file", str(tmp_path / "loss"))
    # killed while the snapshot of iteration 7 may still be in flight: resume from a complete one only
    interrupted_runs(cmd, tmp_path / "loss", tmp_path, [(7, signal.SIGKILL)])
    wait_no_agent(tmp_path / "ckpt")
    for rank in (0, 1):
        assert_losses_equal(losses(tmp_path / "loss", rank), losses(tmp_path / "ref_loss", rank), 12, f"rank {rank}")


def test_only_optimizer_owned_tensors_are_deferred():
    """A BatchNorm's running statistics change in the next forward, before any optimizer step: they
    must be copied before maybe_save returns, while the weights may wait for the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    job = secrets.token_hex(6)
    snap = Snapshotter(job, 0, 1)
    waits = []
    watch = OptimizerWatch(lambda: waits.append(pending.wait()))
    try:
        watch.add(opt)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
        pending = snap.snapshot(1, [ShardSpec("m", {"model": model.state_dict(),
                                                   "opt": opt.state_dict()["state"]})], False,
                                defer=watch.deferrable())
        assert isinstance(pending, PendingSnapshot)
        model(torch.randn(4, 8)).sum().backward()     # changes BatchNorm's running stats, not the weights
        opt.step()                                    # the hook waits for the copy before changing weights
        assert len(waits) == 1 and waits[0].step == 1
        got = read_snapshot(job, 0, waits[0].slot, 1)["m"]
        _assert_same(got["model"], expected, "model")
        _assert_same({int(k): v for k, v in got["opt"].items()}, expected_opt, "optimizer state")
        assert not torch.equal(model[1].running_mean, expected["1.running_mean"]), "the forward did change it"
    finally:
        watch.close()
        snap.close(unlink=True)
        assert not list(shm.list_segments(job))


def test_auto_overlap_only_when_a_core_is_free(tmp_path):
    """snapshot_overlap=None: on a CPU box whose cores all compute, the copy stays synchronous (a copy
    thread would compete with the training for cores); with a core free, it stays synchronous too for a state as
    small as this worker's (below OVERLAP_MIN_BYTES, the handover costs more than the copy); the decision and
    its reason are in the audit log. test_auto_overlap_by_size takes the other branches in process."""
    log = tmp_path / "audit.log"
    run(train_cmd(tmp_path / "ckpt", 2, "--iters", "2", "--log-file", str(log)))
    wait_no_agent(tmp_path / "ckpt")
    free_core = len(os.sched_getaffinity(0)) > 2      # 2 ranks x OMP_NUM_THREADS=1 compute
    decided = [e for e in events(log) if e["event"] == "overlap"]
    assert len(decided) == 2 and all(not e["on"] and "cores" in e["message"] for e in decided), decided
    assert all(("the optimizer's tensors hold" in e["message"]) == free_core for e in decided), decided
    snaps = [e for e in events(log) if e["event"] == "snapshot"]
    assert snaps and all("background_seconds" not in e for e in snaps)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one computing, one free for the copy")
def test_auto_overlap_by_size():
    """auto_overlap with a core free: on for optimizer-owned host tensors of OVERLAP_MIN_BYTES or more (counted
    once per storage, parameters and state), off below, with the size in the reason; off whatever the size when
    the ranks' threads take every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cores = len(os.sched_getaffinity(0))
        floats = OVERLAP_MIN_BYTES // 4
        big = torch.optim.SGD([torch.nn.Parameter(torch.zeros(floats))])
        assert owned_bytes(list(torch_optimizers(big))) == OVERLAP_MIN_BYTES
        assert auto_overlap(big, 1) == (True, f"{cores} cores, the training computes on 1")
        on, why = auto_overlap(big, cores)
        assert not on and "all computing" in why
        # just below: the parameter and a state tensor of half its size each, seen through a wrapper
        half = torch.nn.Parameter(torch.zeros(floats // 2 - 1))
        small = torch.optim.AdamW([half])
        small.state[half]["exp_avg"] = torch.zeros(floats // 2)
        small.state[half]["alias"] = half.data          # the parameter's storage again: counted once
        assert owned_bytes(list(torch_optimizers(small))) == OVERLAP_MIN_BYTES - 4

        class Wrapper:
            optimizer = small
        on, why = auto_overlap(Wrapper(), 1)
        assert not on and f"the optimizer's tensors hold {human(OVERLAP_MIN_BYTES - 4)}, under" in why, why
    finally:
        torch.set_num_threads(threads)
