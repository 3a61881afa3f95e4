"""FSDP2 (torch.distributed.fsdp.fully_shard) under the plain-PyTorch adapter, on CPU with gloo: real
torchrun processes, the example's loop with --fsdp (every Linear and the root sharded over the ranks).

Checkpoints are torch DCP's layout (``.metadata`` + ``__R_0.distcp`` per rank): each rank snapshots its
local shards, nothing is gathered. Proved here: kill -9 then SIGTERM, each resumed with the losses of an
uninterrupted run bit for bit (from memory, then from storage through DCP's reader); DCP's own reader
(dcp_to_torch_save, in a process without easyckpt) reads a committed step and finds the weights the run
had; a resume on another world size (2 ranks -> 1) reshards through DCP and loads those weights.
"""
from __future__ import annotations

import random
import re
import signal

from harness import (
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

ITERS = 16
# the agent keeps the killed run's snapshot for 60 s: a restart on a loaded machine (or a GPU's first start) can take
# more than 10, and the resume must come from memory
COMMON = ["--fsdp", "--iters", str(ITERS), "--storage-interval", "4", "--idle-timeout", "60"]
SEED = 20261125


def test_fsdp2_resumes_exactly_after_kill9_and_sigterm_and_dcp_reads_what_it_saved(tmp_path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = tmp_path / "ref"
    run(train_cmd(ref / "ckpt", 2, *COMMON, "--loss-file", str(ref / "loss")), timeout=300)
    wait_no_agent(ref / "ckpt")
    rnd = random.Random(SEED)
    kill_at, term_at = rnd.randint(3, 6), rnd.randint(9, 12)
    ckpt, loss, log, final = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl", tmp_path / "final.pt"
    cmd = train_cmd(ckpt, 2, *COMMON, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05",
                    "--dump-final", str(final))
    interrupted_runs(cmd, loss, tmp_path, [(kill_at, signal.SIGKILL), (term_at, signal.SIGTERM)])
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref / "loss", rank), ITERS, f"FSDP rank {rank}")
    resumed = starts(loss)[1:]
    assert len(resumed) == 2 and resumed[0] >= kill_at - 1 and resumed[1] >= term_at - 1, resumed
    assert [e["source"] for e in events(log) if e["event"] == "load" and e.get("rank") == 0] == \
        ["none", "memory", "storage"]
    wait_no_agent(ckpt)

    step = ckpt / f"step_{ITERS:08d}"
    names = {p.name for p in step.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names and "model.safetensors" not in names, names
    # torch's own DCP reader, in one process without easyckpt: the weights the run ended with, whole
    dcp_to_torch_save(str(step), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    trained = torch.load(final, weights_only=True)
    model = {k[len("model."):]: v for k, v in whole.items() if k.startswith("model.")}
    assert set(model) == set(trained) and all(torch.equal(model[k], trained[k]) for k in trained)
    assert {k.rsplit(".", 1)[1] for k in whole if k.startswith("optim.state.0.weight.")} == \
        {"exp_avg", "exp_avg_sq", "step"}

    # another world size: the 2-rank step resumed on one rank, resharded by DCP's reader
    loaded = tmp_path / "loaded.pt"
    out = run(script_cmd(TRAIN, 1, "--save-dir", str(ckpt), *COMMON[:1], "--iters", str(ITERS + 2),
                         "--storage-interval", "4", "--idle-timeout", "10", "--loss-file", str(tmp_path / "one"),
                         "--dump-loaded", str(loaded), torchrun=True), timeout=300)
    assert starts(tmp_path / "one") == [ITERS], out.stdout[-3000:]
    said = out.stdout + out.stderr       # issue 51: said as a conversion, timed with it
    assert re.search(rf"easyckpt: resumed step {ITERS} from storage \(.*, verified\): [0-9.]+ [KM]iB in [0-9.]+ s, "
                     r"converted from 2 rank\(s\) to 1 by DCP's resharding \(the conversion included\)\n", said), \
        said[-3000:]
    assert "no RNG state" not in said, said[-3000:]      # rank 0 of the two had its own
    got = torch.load(loaded, weights_only=True)
    assert all(torch.equal(got[k], trained[k]) for k in trained), "the 1-rank resume loaded other weights"
    wait_no_agent(ckpt)


def test_a_whole_model_checkpoint_is_not_restored_into_an_fsdp_model_and_says_why(tmp_path):
    """Saved without FSDP (model.safetensors), relaunched with --fsdp: an "incompatible" verdict naming the
    layout, the step kept, and the job stops instead of starting fresh."""
    ckpt = tmp_path / "ckpt"
    run(train_cmd(ckpt, 2, "--iters", "4", "--storage-interval", "4", "--idle-timeout", "5"), timeout=300)
    wait_no_agent(ckpt)
    # (an idle timeout of its own: the refused job leaves no snapshot to keep, and the wait below is for its agent)
    out = run(train_cmd(ckpt, 2, *COMMON, "--idle-timeout", "5", "--loss-file", str(tmp_path / "loss")), timeout=300,
              check=False)
    said = out.stdout + out.stderr
    assert out.returncode != 0 and "restores only into a model whose parameters are not DTensors" in said, \
        said[-3000:]
    assert (ckpt / "step_00000004" / "model.safetensors").is_file()
    wait_no_agent(ckpt)
