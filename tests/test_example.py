"""The example a user copies (examples/pytorch/train.py) runs, resumes exactly, and trains the same as
the test worker (tests/worker_pytorch.py) that every other PyTorch test drives, so neither can drift."""
from __future__ import annotations

import sys

from harness import (
    EXAMPLE,
    assert_losses_equal,
    losses,
    run,
    starts,
    wait_no_agent,
)
from harness import users_train_cmd as train_cmd


def test_the_example_resumes_where_it_stopped_with_the_losses_of_the_test_worker(tmp_path):
    ref_loss, loss = tmp_path / "ref", tmp_path / "loss"
    run(train_cmd(tmp_path / "ref-ckpt", 1, "--iters", "10", "--storage-interval", "4", "--loss-file",
                  str(ref_loss), "--idle-timeout", "5"))
    wait_no_agent(tmp_path / "ref-ckpt")
    save = tmp_path / "ckpt"
    example = [sys.executable, str(EXAMPLE), "--save-dir", str(save), "--storage-interval", "4",
               "--loss-file", str(loss)]
    run(example + ["--iters", "8"])
    wait_no_agent(save)
    run(example + ["--iters", "10"])
    wait_no_agent(save)
    assert starts(loss) == [0, 8]
    assert_losses_equal(losses(loss), losses(ref_loss), 10, "the example against the test worker")
