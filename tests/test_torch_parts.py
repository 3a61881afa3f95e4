"""Reading part of a torch.save file the agent wrote (what a reshard of Megatron's torch layout needs of
every old rank's file): the agent records the file's head (the pickle) and each storage as manifest items;
the loader reads the pickle, asks which tensors are wanted, and reads and checks only their storages. The
file stays one that torch.load reads whole; tensors not picked come back as meta tensors; a damaged picked
storage rejects the step, a damaged unpicked one is never read; a manifest whose items disagree with the
pickle is refused."""
from __future__ import annotations

import dataclasses
import mmap

import pytest
import torch

from easyckpt.storage.nativefiles import _write_torch
from easyckpt.engine.load.stepread import read_files
from easyckpt.engine.shards.torchpickle import flatten_pickled
from easyckpt.formats import manifest as mf
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.formats.slotmeta import SlotFile, TensorSpan
from easyckpt.storage.posix import PosixStorage

REL = "mp_rank_00/model_optim_rng.pt"


def make_step(tmp_path):
    tree = {"model": {"a.weight": torch.arange(12, dtype=torch.float32).view(3, 4),
                      "b.weight": torch.full((5,), 7, dtype=torch.bfloat16), "empty": torch.zeros(0)},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(3, 4), "step": torch.tensor(5.0)}}},
            "iteration": 10}
    skeleton, tensors = flatten_pickled(tree)
    slot, spec, at = bytearray(), [], 0
    for key, t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        spec.append([key, str(t.dtype), list(t.shape), at, at + len(raw)])
        slot += raw
        at += len(raw)
    step = tmp_path / "iter_0000010"
    (step / "mp_rank_00").mkdir(parents=True)
    out = PosixStorage().open_writer(str(step / REL), direct=False)
    buf = mmap.mmap(-1, max(len(slot), 1))
    buf[:len(slot)] = bytes(slot)
    with memoryview(buf) as view:
        f = SlotFile(REL, True, ShardFormat.TORCH, 0, len(slot), tuple(TensorSpan(*t) for t in spec), skeleton)
        digest, items = _write_torch(out, view, f)
        out.finish()
    out.close()
    files = {REL: mf.FileEntry(out.size, digest, ShardFormat.TORCH, items)}
    return tree, step, mf.validate(mf.build(10, "job", "megatron", 1, files).to_json())


def with_items(man, items):
    """``man`` with REL's items replaced (a manifest that passed its own checks, disagreeing with the pickle)."""
    return man.with_files({REL: dataclasses.replace(man.files[REL], items=tuple(items))})


def pick_model_a(path, tree, trees):
    return path[:2] == ("model", "a.weight") or path[-1] == "step"


def test_the_file_loads_whole_and_its_items_cover_the_pickle_and_each_storage(tmp_path):
    tree, step, man = make_step(tmp_path)
    whole = torch.load(step / REL, weights_only=True)
    assert torch.equal(whole["model"]["a.weight"], tree["model"]["a.weight"]) and whole["iteration"] == 10
    items = man.files[REL].items
    assert items[0][0] == 0 and items[0][3][0] == "archive/data.pkl"
    assert [i[1] for i in items[1:]] == [48, 10, 0, 48, 4]       # each storage's bytes, in record order
    data = (step / REL).read_bytes()
    assert all(mf.checksum(data[o:o + n]) == c for o, n, c, _ in items)


def test_only_the_picked_storages_are_read_and_the_rest_are_meta(tmp_path):
    tree, step, man = make_step(tmp_path)
    trees, problem, nbytes, _ = read_files(str(step), man, [(REL, False, pick_model_a)], None)
    assert problem is None
    got = trees[REL]
    assert torch.equal(got["model"]["a.weight"], tree["model"]["a.weight"])
    assert got["model"]["b.weight"].is_meta and got["model"]["b.weight"].dtype == torch.bfloat16
    assert got["optimizer"]["state"][0]["exp_avg"].is_meta and got["optimizer"]["state"][0]["step"].item() == 5.0
    assert got["iteration"] == 10
    items = man.files[REL].items
    assert nbytes == items[0][1] + 48 + 4 < man.files[REL].size


def test_a_damaged_picked_storage_rejects_the_step_and_an_unpicked_one_is_not_read(tmp_path):
    _, step, man = make_step(tmp_path)
    items = man.files[REL].items
    path = step / REL
    data = bytearray(path.read_bytes())
    data[items[4][0] + 10] ^= 0xFF            # optimizer exp_avg: not picked
    path.write_bytes(bytes(data))
    assert read_files(str(step), man, [(REL, False, pick_model_a)], None)[1] is None
    data[items[1][0] + 3] ^= 0xFF             # model a.weight: picked
    path.write_bytes(bytes(data))
    trees, problem, _, _ = read_files(str(step), man, [(REL, False, pick_model_a)], None)
    assert trees is None and problem.corrupt and f"{REL}: item 1" in problem.reason and "corrupted" in problem.reason


def test_items_that_disagree_with_the_pickle_are_refused(tmp_path):
    _, step, man = make_step(tmp_path)
    man = with_items(man, man.files[REL].items[:3])     # a storage the pickle names is not listed
    problem = read_files(str(step), man, [(REL, False, pick_model_a)], None)[1]
    assert problem.corrupt and "which its items do not list" in problem.reason
    _, step2, man2 = make_step(tmp_path / "2")
    items = list(man2.files[REL].items)
    length = items[1].length + 4             # a storage of another size than the pickle says
    items[1] = items[1]._replace(length=length, checksum=mf.checksum(
        (step2 / REL).read_bytes()[items[1].offset:items[1].offset + length]))
    man2 = with_items(man2, items)
    assert "the pickle says" in read_files(str(step2), man2, [(REL, False, pick_model_a)], None)[1].reason
    man2 = with_items(man2, items[1:])       # no head
    assert "do not begin with the file's head" in read_files(str(step2), man2, [(REL, False, pick_model_a)], None)[1].reason


def test_the_shard_pickle_is_torch_saves_own_and_each_loaded_tensor_has_hooks_of_its_own():
    """flatten_pickled lets the C pickler walk the tree (it runs at every snapshot of a Megatron, DeepSpeed or HF
    Trainer shard): for tensors of distinct shapes its data.pkl is byte for byte the one torch.save writes;
    a tensor met twice is one storage record, as in torch.save; tensors inside other objects (an argparse
    Namespace) are storage records too, never pickled by value; an OrderedDict's attributes (a state dict's
    _metadata) are kept; every loaded tensor gets its own hooks dict."""
    import argparse
    import base64
    import collections
    import io
    import zipfile

    from easyckpt.engine.shards.torchpickle import unflatten_pickled

    plain = {"a": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
             "step": 3, "lr": 1e-3, "betas": (0.9, 0.999), "flags": [True, None, "x"]}
    skeleton, tensors = flatten_pickled(plain)
    buf = io.BytesIO()
    torch.save(plain, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        torch_pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    assert base64.b64decode(skeleton["__torchzip"]) == torch_pkl
    assert [k for k, _ in tensors] == skeleton["storages"]
    assert tensors[0][1] is plain["a"] and tensors[1][1] is plain["b"]      # no copy, no detach needed

    shared = torch.randn(2, 2)
    sd = collections.OrderedDict(w=torch.zeros(3), v=torch.zeros(3))
    sd._metadata = {"": {"version": 1}}          # what nn.Module.state_dict puts on its OrderedDict
    tree = {"args": argparse.Namespace(hidden=4, t=torch.full((2,), 7.0)), "x": shared, "y": [shared], "sd": sd}
    skeleton, tensors = flatten_pickled(tree)
    # named by where each sits (the manifest's items are named so): shared once, by its first place; the
    # Namespace's tensor has no path through dicts and lists, only its record number
    assert [k for k, _ in tensors] == ["#0", "/x#1", "/sd/w#2", "/sd/v#3"]
    back = unflatten_pickled(skeleton, dict(tensors))
    assert back["y"][0] is back["x"] and torch.equal(back["x"], shared)
    assert torch.equal(back["args"].t, tree["args"].t) and back["args"].hidden == 4
    assert back["sd"]._metadata == {"": {"version": 1}} and list(back["sd"]) == ["w", "v"]
    hooks = [back["sd"]["w"]._backward_hooks, back["sd"]["v"]._backward_hooks, back["x"]._backward_hooks]
    assert all(h == collections.OrderedDict() for h in hooks) and len({id(h) for h in hooks}) == 3

    with pytest.raises(TypeError, match="sparse"):
        flatten_pickled({"s": torch.eye(3).to_sparse()})
