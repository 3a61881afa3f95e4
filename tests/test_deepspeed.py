"""A DeepSpeed engine without the Trainer, through easyckpt.deepspeed: ZeRO 1, 2 and 3 on 2 ranks (CPU, gloo).

Each interrupted run is killed twice (kill -9 of both ranks, then SIGTERM) and relaunched with the same
command; losses must equal an uninterrupted run's bit for bit. The checkpoints are DeepSpeed's own:
``engine.load_checkpoint(save_dir)`` reads the newest through ``latest`` and restores the same state as
easyckpt's loader. A ZeRO-3 checkpoint of 2 ranks resumes on 1 through the universal checkpoint.
"""
from __future__ import annotations

import os
import random
import signal

import pytest
from harness import (
    ROOT,
    assert_losses_close,
    assert_losses_equal,
    cli,
    cli_json,
    events,
    interrupted_runs,
    killed_then_resumed,
    losses,
    run,
    script_cmd,
    starts,
    wait_no_agent,
)

TRAIN = ROOT / "examples" / "deepspeed" / "train.py"
CHECK = ROOT / "tests" / "deepspeed_native_check.py"
ITERS = 20
SEED = int(os.environ.get("EASYCKPT_TEST_SEED", "20261122"))


def ds(save_dir, loss, *extra, nproc=2, log=None):
    args = ["--save-dir", str(save_dir), "--loss-file", str(loss), "--iters", str(ITERS), "--idle-timeout", "20",
            *extra]
    if log is not None:
        args += ["--log-file", str(log)]
    return script_cmd(TRAIN, nproc, *args, torchrun=True)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs per ZeRO stage, made when first needed; stages 1 and 2 do the same arithmetic
    here (bit-identical losses) and share one: a test of either fails if they ever differ."""
    cache = {}

    def get(zero):
        key = "1" if zero == "2" else zero
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ds-zero{key}")
            run(ds(d / "ref", d / "ref-loss", "--zero", key), timeout=300)
            wait_no_agent(d / "ref")
            cache[key] = {r: losses(d / "ref-loss", r) for r in (0, 1)}
        return cache[key]
    return get


# ZeRO-1 and -2 of the plain engine go through the capture path ZeRO-1/2 under the Trainer test in CI
@pytest.mark.parametrize("zero", [pytest.param("1", marks=pytest.mark.slow), pytest.param("2", marks=pytest.mark.slow),
                                  "3"])
def test_kill9_and_sigterm_resume_with_equal_losses_and_deepspeed_reads_the_checkpoint(tmp_path, zero, references):
    reference = references(zero)
    rnd = random.Random(SEED + int(zero))
    kill_at, term_at = rnd.randint(3, 8), rnd.randint(11, 16)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmd = ds(ckpt, loss, "--zero", zero, "--step-sleep", "0.1", log=log)
    interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), reference[rank], ITERS, f"ZeRO-{zero} rank {rank}")
    resumed = starts(loss)[1:]
    assert len(resumed) == 2 and resumed[0] >= kill_at - 1 and resumed[1] >= term_at - 1, resumed
    assert any(e["event"] == "load" and e.get("source") == "memory" for e in events(log))
    wait_no_agent(ckpt)
    assert (ckpt / "latest").read_text() == f"global_step{ITERS}"
    out = run(script_cmd(CHECK, 2, str(ckpt), zero), timeout=300)
    assert "optimizer tensors equal" in out.stdout
    # what an operator sees of it: DeepSpeed's layout and config, the ZeRO partitions by group
    listing = cli_json("ls", ckpt)
    assert listing["framework"] == "deepspeed" and listing["picked"] == ITERS
    assert listing["checkpoints"][0]["layout"] == {"tp": 1, "pp": 1, "dp": 2, "world": 2}
    info = cli_json("inspect", ckpt)
    assert info["args"]["ds_config"]["zero_optimization"]["stage"] == int(zero)
    optim_files = {t["file"] for t in info["tensors"] if t["group"] == "optimizer"}
    assert optim_files >= {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}, optim_files
    assert info["groups"]["optimizer"]["bytes"] > 0
    cli("verify", ckpt)
    wait_no_agent(ckpt)


@pytest.mark.slow   # the conversion itself is also covered by the Trainer's ZeRO-2 2->1 test
def test_zero3_saved_on_two_ranks_resumes_on_one_through_the_universal_checkpoint(tmp_path):
    run(ds(tmp_path / "ref", tmp_path / "ref-loss", "--zero", "3", "--dropout", "0", nproc=1), timeout=300)
    reference = losses(tmp_path / "ref-loss")
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    resumed = killed_then_resumed(
        ds(ckpt, loss, "--zero", "3", "--dropout", "0", "--step-sleep", "0.1", "--idle-timeout", "2", log=log),
        ds(ckpt, loss, "--zero", "3", "--dropout", "0", nproc=1, log=log), ckpt, loss, tmp_path, kill_at=10)
    assert resumed >= 9
    assert any(e["event"] == "convert" for e in events(log))
    assert_losses_close(losses(loss), reference, range(resumed + 1, ITERS + 1), rel=1e-4)
    assert not list(ckpt.glob(".easyckpt-universal-*")), "the converted copy was not removed"
    wait_no_agent(ckpt)



def test_finalize_when_one_rank_skipped_the_last_snapshot_does_not_hang_in_zero3s_gather(tmp_path):
    """Rank 1's first persist is slowed, so both its slots stay reserved and it skips the next snapshots,
    the last step's included, which rank 0 has. At finalize rank 1 must snapshot that step, and ZeRO-3's
    checkpoint collection gathers parameters (a collective): rank 0 has to take part although it has
    nothing new to save, or both wait for ever."""
    ckpt, log, once = tmp_path / "ckpt", tmp_path / "audit.jsonl", tmp_path / "once"
    once.mkdir()
    iters = 6    # given last: argparse keeps the last --iters
    run(ds(ckpt, tmp_path / "loss", "--zero", "3", "--storage-interval", "2", "--step-sleep", "0.1",
           "--idle-timeout", "2", "--iters", str(iters), log=log), timeout=150,
        extra_env={"EASYCKPT_FAULTS": "agent.persist_file@1=sleep:4", "EASYCKPT_FAULT_ONCE_DIR": str(once)})
    skipped = {e["step"] for e in events(log) if e["event"] == "skip" and e.get("rank") == 1}
    assert iters in skipped, f"the scenario did not happen: rank 1 skipped {sorted(skipped)}"
    assert (ckpt / "latest").read_text() == f"global_step{iters}"
    cli("verify", ckpt, str(iters))
    wait_no_agent(ckpt)
