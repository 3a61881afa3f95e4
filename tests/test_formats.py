"""Shard formats written by the agent from a real snapshot slot: safetensors (default) and native
torch.save files (Megatron/DeepSpeed layouts), both read back by easyckpt's safe loader."""
from __future__ import annotations

import argparse
import enum
import json
import os
import signal

import pytest
import torch

from easyckpt.agent.stepwriter import persist_slot
from easyckpt.engine.load.stepread import read_step
from easyckpt.engine.save.snapshot import ShardSpec, Snapshotter, read_snapshot
from easyckpt.engine.shards.safeload import safe_torch_load
from easyckpt.formats.manifest import MANIFEST_NAME, build
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.ipc import shm


class _Local(enum.Enum):   # an enum outside the frameworks' packages
    A = 1


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/easyckpt-pwned",))


@pytest.fixture
def snap():
    s = Snapshotter("feedfacecafe", rank=0, world_size=1)
    yield s
    s.close(unlink=True)


def _state():
    torch.manual_seed(0)
    return {"args": argparse.Namespace(hidden=64, dtype=torch.bfloat16, layout=torch.strided),
            "iteration": 7, "model": {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int64),
                                      "h": torch.randn(2, dtype=torch.bfloat16)},
            "rng_state": [{"torch_rng_state": torch.get_rng_state(), "random": (3, tuple(range(5)), None)}]}


def test_torch_format_shard_is_native_and_loads_safely(tmp_path, snap):
    state = _state()
    res = snap.snapshot(7, [ShardSpec("mp_rank_00/model_optim_rng.pt", state, True, fmt="torch"),
                            ShardSpec("extra.safetensors", {"x": torch.ones(3)}, True)], persist=True)
    step, files, nbytes, _, _ = persist_slot(shm.slot_path("feedfacecafe", 0, res.slot), res.generation,
                                          str(tmp_path), 0)
    assert step == 7 and files["mp_rank_00/model_optim_rng.pt"].format == ShardFormat.TORCH
    native = torch.load(tmp_path / "mp_rank_00/model_optim_rng.pt", weights_only=False)   # the framework's way
    assert native["args"].hidden == 64 and native["args"].dtype == torch.bfloat16
    for k, v in state["model"].items():
        assert torch.equal(native["model"][k], v)
    assert native["rng_state"][0]["random"] == (3, tuple(range(5)), None)
    # Megatron's loader hands these straight to torch.set_rng_state, which ignores a view's offset
    torch.set_rng_state(native["rng_state"][0]["torch_rng_state"])
    assert torch.equal(torch.get_rng_state(), state["rng_state"][0]["torch_rng_state"])
    (tmp_path / MANIFEST_NAME).write_text(build(7, "x", "t", 1, files).to_bytes().decode())
    trees, problem, _, _ = read_step(str(tmp_path), lambda m: [(r, False) for r in m.files])
    assert problem is None
    assert torch.equal(trees["mp_rank_00/model_optim_rng.pt"]["model"]["h"], state["model"]["h"])
    mem = read_snapshot("feedfacecafe", 0, res.slot, 7)
    assert mem["mp_rank_00/model_optim_rng.pt"]["args"] == state["args"]


def test_a_malicious_pickle_in_a_checkpoint_is_not_executed(tmp_path):
    """Row 16 for the torch format: a shard whose pickle would run a command is refused."""
    import io
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "payload": _Evil()}, buf)
    with pytest.raises(ValueError, match="posix.system|os.system|allow-list"):
        safe_torch_load(buf.getvalue())
    assert not os.path.exists("/tmp/easyckpt-pwned")


def test_framework_enums_and_namespace_are_allowed_but_foreign_classes_are_not():
    import io
    buf = io.BytesIO()
    torch.save({"a": argparse.Namespace(x=1), "d": torch.float16}, buf)
    assert safe_torch_load(buf.getvalue())["a"].x == 1
    # Megatron-LM's arguments hold args.exit_signal, a signal.Signals
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(exit_signal=signal.SIGTERM)}, buf)
    assert safe_torch_load(buf.getvalue())["args"].exit_signal is signal.SIGTERM

    buf = io.BytesIO()
    torch.save({"e": _Local.A}, buf)
    with pytest.raises(ValueError, match="allow-list"):
        safe_torch_load(buf.getvalue())


def test_raw_shards_are_written_as_they_are_and_read_back_from_memory_and_storage(tmp_path, snap):
    state = json.dumps({"global_step": 7, "log_history": [{"loss": 1.5}]}, indent=2) + "\n"
    blob = bytes(range(256)) * 3
    res = snap.snapshot(7, [ShardSpec("trainer_state.json", state, True, fmt="raw"),
                            ShardSpec("sub/training_args.bin", blob, True, fmt="raw"),
                            ShardSpec("model.safetensors", {"w": torch.ones(3)}, True)], persist=True,
                        info={"protect": [3]})
    step, files, _, _, info = persist_slot(shm.slot_path("feedfacecafe", 0, res.slot), res.generation,
                                           str(tmp_path), 0)
    assert info == {"protect": [3]} and files["trainer_state.json"].format == ShardFormat.RAW
    assert (tmp_path / "trainer_state.json").read_text() == state
    assert (tmp_path / "sub" / "training_args.bin").read_bytes() == blob
    (tmp_path / MANIFEST_NAME).write_text(build(7, "x", "t", 1, files).to_bytes().decode())
    trees, problem, _, _ = read_step(str(tmp_path), lambda m: [(r, False) for r in m.files])
    assert problem is None and trees["sub/training_args.bin"] == blob
    assert read_snapshot("feedfacecafe", 0, res.slot, 7)["trainer_state.json"] == state.encode()


def test_deepspeed_and_numpy_data_classes_are_allowed():
    import io

    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address
    buf = io.BytesIO()
    torch.save({"scaler": LossScaler(1.0), "map": {"w": fragment_address(numel=4, start=8)},
                "rng": np.random.get_state()}, buf)
    out = safe_torch_load(buf.getvalue())
    assert out["map"]["w"].start == 8 and out["scaler"].cur_scale == 1.0
    assert np.array_equal(out["rng"][1], np.random.get_state()[1])


def test_retention_keeps_the_newest_and_protected_steps_like_the_trainer():
    from easyckpt.storage.retention import KeepLast
    dirs = [(s, f"checkpoint-{s}") for s in (30, 25, 20, 15, 10, 5)]
    assert [s for s, _ in KeepLast(2).to_delete(dirs)] == [20, 15, 10, 5]
    assert [s for s, _ in KeepLast(2, protect=[10]).to_delete(dirs)] == [25, 20, 15, 5]
    assert [s for s, _ in KeepLast(1, protect=[10]).to_delete(dirs)] == [25, 20, 15, 5]   # newest + best
    assert [s for s, _ in KeepLast(3, protect=[30]).to_delete(dirs)] == [15, 10, 5]
    assert KeepLast(None, protect=[10]).to_delete(dirs) == []


def test_distcp_shards_hold_each_tensor_item_as_torch_saves_it_at_the_stated_offsets(tmp_path, snap):
    """A torch.distributed.checkpoint data file, written by the agent from the slot: each tensor item must
    load with torch.load from exactly [offset, offset + size) as the trainer computed them (DCP's reader
    slices the file there), and a bytes item must be there verbatim."""
    import io

    from easyckpt.engine.shards.tree import dcp_item_size
    items = [b"object-bytes\x00\x01", torch.randn(3, 5), torch.arange(7, dtype=torch.int64),
             torch.randn(2, 2, dtype=torch.bfloat16)[:, 1], b""]
    res = snap.snapshot(3, [ShardSpec("__0_0.distcp", items, True, fmt="dcp")], persist=True)
    _, files, _, _, _ = persist_slot(shm.slot_path("feedfacecafe", 0, res.slot), res.generation, str(tmp_path), 0)
    data = (tmp_path / "__0_0.distcp").read_bytes()
    sizes = [dcp_item_size(item) for item in items]       # what the trainer states in the metadata
    assert files["__0_0.distcp"].format == ShardFormat.DCP and len(data) == sum(sizes)
    offset = 0
    for item, size in zip(items, sizes):
        piece = data[offset:offset + size]
        if isinstance(item, bytes):
            assert piece == item
        else:
            assert torch.equal(torch.load(io.BytesIO(piece), weights_only=True), item)
        offset += size
    mem = read_snapshot("feedfacecafe", 0, res.slot, 3)["__0_0.distcp"]
    assert mem[0] == items[0] and torch.equal(mem[3], items[3])
    (tmp_path / MANIFEST_NAME).write_text(build(3, "x", "t", 1, files).to_bytes().decode())
    trees, problem, _, _ = read_step(str(tmp_path), lambda m: [(r, False) for r in m.files])
    assert problem is None and trees == {"__0_0.distcp": None}


def test_a_steps_verdict_is_the_gravest_any_rank_found_with_every_ranks_reason():
    from easyckpt.formats import verdicts
    assert verdicts.combine(5, "p", [None, None]) is None
    v = verdicts.combine(5, "p", [verdicts.incompatible("another layout"), verdicts.corrupt("a.bin: checksum"),
                                  verdicts.corrupt("b.bin: missing")])
    assert v.corrupt and v.ranks == (1, 2) and v.reason == "rank 1: a.bin: checksum; rank 2: b.bin: missing"
    v = verdicts.combine(7, None, [verdicts.incompatible("needs rank_00003.safetensors")])
    assert not v.corrupt and v.kind is verdicts.Kind.INCOMPATIBLE and v.reason == "needs rank_00003.safetensors"
    assert v.words() == "step 7: incompatible (rank 0): needs rank_00003.safetensors"
    assert verdicts.combine(1, None, [verdicts.unreadable("EIO"), verdicts.untrusted("owned by uid 65534")]).kind \
        is verdicts.Kind.UNTRUSTED


def test_rng_state_is_kept_as_tensors_and_the_tuple_form_of_earlier_snapshots_still_restores():
    """Python's RNG state is one tensor in a snapshot (625 numbers walked and written as JSON at every snapshot
    were a fifth of a tiny state's cost); a snapshot taken before holds the tuple, and both restore."""
    import random

    from easyckpt.engine.save import rng
    from easyckpt.engine.shards.tree import flatten, unflatten
    random.seed(7)
    state = rng.capture()
    skeleton, tensors = flatten(state)
    assert len(json.dumps(skeleton)) < 400      # no number of the state is in the skeleton
    expected = [random.random() for _ in range(3)]
    rng.restore(unflatten(skeleton, dict(tensors)))
    assert [random.random() for _ in range(3)] == expected
    old = dict(state, python=random.getstate())      # the earlier form
    expected = [random.random() for _ in range(3)]
    rng.restore(unflatten(*(lambda s, t: (s, dict(t)))(*flatten(old))))
    assert [random.random() for _ in range(3)] == expected


def test_flatten_skeletons_of_an_optimizer_state_are_those_of_the_general_walk():
    """The walk's shortcuts (dicts keyed by parameter index, plain tuples, tensors that need no detach) give the
    skeleton the general path gives: a subclass of dict and of tuple takes the general path."""
    import collections

    from easyckpt.engine.shards.tree import flatten, unflatten
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tree = {"optimizer": opt.state_dict(), "params": dict(model.named_parameters()), "t": (1, 2.0, "x")}
    skeleton, tensors = flatten(tree)
    general, general_tensors = flatten(collections.OrderedDict(
        optimizer=collections.OrderedDict(state=collections.OrderedDict(tree["optimizer"]["state"]),
                                          param_groups=tree["optimizer"]["param_groups"]),
        params=tree["params"], t=type("T", (tuple,), {})(tree["t"])))
    assert skeleton == general and [k for k, _ in tensors] == [k for k, _ in general_tensors]
    assert skeleton["optimizer"]["state"]["__dict"][0][0] == 0 and skeleton["t"] == {"__tuple": [1, 2.0, "x"]}
    assert all(not t.requires_grad for _, t in tensors)     # the parameters were detached, the rest kept
    back = unflatten(skeleton, dict(tensors))
    assert back["optimizer"]["param_groups"][0]["betas"] == tree["optimizer"]["param_groups"][0]["betas"]
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], tree["optimizer"]["state"][0]["exp_avg"])
