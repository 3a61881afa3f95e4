"""The engine and the agent in one interpreter (tests/inproc.py): save, persist, commit, resume, with ranks
as threads and the real Agent's handlers, coordinator, commit and retention behind an in-process link."""
from __future__ import annotations

import os

import torch
from inproc import model_and_optimizer, node, ranks, state, train_step

from easyckpt.config import Config
from easyckpt.ipc import shm
from easyckpt.storage.savedir import SaveDir


def test_two_ranks_save_commit_and_resume_the_newest_step_exactly(tmp_path):
    cfg = Config(save_dir=str(tmp_path / "ckpt"), save_mem_interval=1, save_storage_interval=2, max_ckpt_num=2,
                 autocheckpoint_on_sigterm=False)

    def first(ckpt, group):
        model, opt = model_and_optimizer()
        losses = []
        for step in range(1, 8):
            losses.append(train_step(model, opt, step))
            ckpt.save(step, state(ckpt, model, opt, step), optimizer=opt)
        assert ckpt.finalize() == 7
        return losses

    with node(cfg) as local:
        losses = ranks(cfg, local, 2, first)
    assert losses[0] == losses[1]
    sd = SaveDir.of(cfg)
    assert [s for s, _ in sd.committed(own=True)] == [7, 6]        # max_ckpt_num=2 pruned the rest
    assert not shm.segments_of(cfg.job_id)                          # every trainer said bye: memory released

    def resumed(ckpt, group):
        model, opt = model_and_optimizer(seed=1)                     # other weights: the load must replace them
        st = state(ckpt, model, opt)
        step, _ = ckpt.load(st)
        more = [train_step(model, opt, s) for s in range(step + 1, step + 3)]
        ckpt.finalize(persist=False)
        return step, more

    cfg2 = Config(save_dir=cfg.save_dir, save_mem_interval=1, save_storage_interval=2, max_ckpt_num=2,
                  autocheckpoint_on_sigterm=False)
    with node(cfg2) as local:
        got = ranks(cfg2, local, 2, resumed)
    assert [s for s, _ in got] == [7, 7]

    model, opt = model_and_optimizer()
    reference = [train_step(model, opt, s) for s in range(1, 10)]
    assert got[0][1] == reference[7:9] and got[1][1] == reference[7:9]
    assert os.path.isdir(sd.step_path(7))
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(reference[:7]))


def test_a_damaged_step_is_rejected_marked_by_the_agent_and_the_previous_one_restores(tmp_path):
    """The verdict path in one interpreter: rank 0's loader finds step 4 corrupt, tells the agent (the real
    handler marks it damaged), and both ranks restore step 2."""
    cfg = Config(save_dir=str(tmp_path / "ckpt"), save_mem_interval=1, save_storage_interval=2, max_ckpt_num=None,
                 autocheckpoint_on_sigterm=False)

    def first(ckpt, group):
        model, opt = model_and_optimizer()
        for step in range(1, 5):
            train_step(model, opt, step)
            ckpt.save(step, state(ckpt, model, opt, step), optimizer=opt)
        ckpt.finalize()

    with node(cfg) as local:
        ranks(cfg, local, 2, first)
    sd = SaveDir.of(cfg)
    shard = os.path.join(sd.step_path(4), "model.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[-3] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(bytes(data))

    def resumed(ckpt, group):
        model, opt = model_and_optimizer(seed=1)
        step, _ = ckpt.load(state(ckpt, model, opt))
        ckpt.finalize(persist=False)
        return step

    with node(cfg) as local:
        assert ranks(cfg, local, 2, resumed) == [2, 2]
    assert os.path.basename(sd.step_path(4)) in sd.read_damaged()
