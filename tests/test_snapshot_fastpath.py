"""The per-snapshot shortcuts of a tiny state's fixed cost (issue 50 item 5) give what the long way gives: the
slot's JSON kept per skeleton, the keys checked joined, the Python RNG words' tensor kept while they do not move,
the host tensors copied in one call. In process, on our own formats."""
from __future__ import annotations

import json
import random

import torch

from easyckpt.engine.save import rng
from easyckpt.engine.save.background import copy_all
from easyckpt.engine.save.metajson import encode_meta
from easyckpt.engine.shards.tree import flatten, unflatten


def _meta(skeletons, cache=None):
    return json.loads(encode_meta(b"[]", 3, skeletons, {"x": 1}, cache))


def test_a_kept_skeleton_json_is_used_only_for_the_same_skeleton_types_included():
    """1, 1.0 and True are equal in Python and differ in JSON (and on restore): each gets its own encoding."""
    cache: dict = {}
    for value in (1, 1.0, True, 1, -0.0, 0.0, "1"):
        skeletons = {"a.safetensors": {"lr": value, "betas": {"__tuple": [0.9, 0.999]}}, "b": {"__t": "k"}}
        got = _meta(skeletons, cache)
        assert got == _meta(skeletons) == {"files": [], "step": 3, "skeletons": skeletons, "info": {"x": 1}}
        assert type(got["skeletons"]["a.safetensors"]["lr"]) is type(value)
        assert json.dumps(got["skeletons"]["a.safetensors"]["lr"]) == json.dumps(value)
    assert set(cache) == {"a.safetensors", "b", "\0info"}       # (the info is kept the same way)


def test_a_small_skeleton_holding_an_int_is_kept_entry_by_entry_and_gives_the_same_json():
    """The snapshotter's cache (KeptJson): the rank state's iteration changes at every snapshot, the rest does not;
    its entries are kept one by one, and the text is exactly the whole skeleton's JSON, whatever the entries
    hold (1, 1.0, True, -0.0, a big int, NaN, non-ASCII keys); keys that keep changing do not grow it forever."""
    from easyckpt.engine.save.metajson import KeptJson
    cache = KeptJson()
    rng = {"python": {"version": 3, "state": {"__t": "rng/python/state"}, "gauss": None}, "torch": {"__t": "rng/torch"}}
    for it, extra in enumerate([None, 1, 1.0, True, -0.0, 0.0, 2 ** 70, float("nan"), {"é": [1, "ü"]}, "1"]):
        skeletons = {"rank.safetensors": {"iteration": it, "rng": rng, "extra": extra}}
        text = encode_meta(b"[]", 3, skeletons, {"x": 1}, cache)
        assert text == encode_meta(b"[]", 3, skeletons, {"x": 1}), extra
        got = json.loads(text)["skeletons"]["rank.safetensors"]
        assert got["iteration"] == it and type(got["extra"]) is type(extra) and got["rng"] == rng
    assert "rank.safetensors\0rng" in cache.entries and "rank.safetensors" not in cache
    for i in range(1000):            # a new key at every snapshot
        encode_meta(b"[]", 3, {"r": {f"k{i}": {"v": "x"}, "n": i}}, {}, cache)
    assert len(cache.entries) <= 256


def test_a_skeleton_marshal_cannot_hold_is_encoded_each_time():
    class Name(str):
        pass
    cache: dict = {}
    skeletons = {"a": {Name("k"): Name("v")}}
    assert _meta(skeletons, cache)["skeletons"] == {"a": {"k": "v"}}
    assert "a" not in cache


def test_dict_keys_are_told_plain_or_keyed_as_one_by_one():
    """The joined check: a key starting with "__" (flatten's own tags), one holding NUL then "__", keys that are
    not strings, an empty dict, a str subclass."""
    class Name(str):
        pass
    cases = [{}, {"a": 1, "b": 2}, {"__t": 1}, {"a": 1, "__b": 2}, {"a\0__b": 1}, {"a\0b": 1, "c": 2},
             {1: "x", 2: "y"}, {"a": 1, 2: "y"}, {Name("n"): 1}, {(1, 2): 3}]
    for tree in cases:
        skeleton, tensors = flatten({"d": tree})
        assert unflatten(json.loads(json.dumps(skeleton)), dict(tensors)) == {"d": tree}, tree
        keyed = "__dict" in skeleton["d"] if isinstance(skeleton["d"], dict) else False
        plain = all(isinstance(k, str) and not k.startswith("__") for k in tree)
        assert keyed == (not plain), tree


def test_tensor_keys_are_the_paths_and_stay_unique():
    t = torch.ones(2)
    skeleton, tensors = flatten({"a": {"b": [t, (t,)]}, "a/b": {"0": t}, "": t})
    assert [k for k, _ in tensors] == ["a/b/0", "a/b/1/0", "a/b/0#1", "_"]
    assert skeleton["a"]["b"][0] == {"__t": "a/b/0"}


def test_the_python_rng_words_tensor_is_reused_only_while_the_words_stay():
    random.seed(11)
    first = rng.capture()["python"]["state"]
    again = rng.capture()["python"]["state"]
    assert again is first                     # nothing drawn: the same tensor
    random.random()
    moved = rng.capture()["python"]["state"]
    assert moved is not first and not torch.equal(moved, first)
    state = rng.capture()
    expected = [random.random() for _ in range(3)]
    rng.restore(state)
    assert [random.random() for _ in range(3)] == expected
    random.seed(11)                            # back to the first words: equal values, a state that restores
    assert torch.equal(rng.capture()["python"]["state"], first)


def test_one_copy_call_copies_every_kind_of_host_tensor():
    srcs = [torch.randn(3, 4).t(), torch.tensor(5, dtype=torch.int64), torch.empty(0),
            torch.randn(7, dtype=torch.bfloat16), torch.tensor([True, False]), torch.arange(6.0)[::2]]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    copy_all(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


# ---- treeplan: a shard's walk written out for its shape ------------------------------------------------------

def _same_as_walk(plan, tree):
    from easyckpt.engine.shards.tree import flatten
    got = plan.run(tree)
    skeleton, tensors = flatten(tree)
    assert got is not None
    assert json.dumps(got[0]) == json.dumps(skeleton) and got[0] == skeleton
    assert [k for k, _ in got[1]] == [k for k, _ in tensors]
    for (_, a), (_, b) in zip(got[1], tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and a.data_ptr() == b.data_ptr() and not a.requires_grad


def _tree(lr=0.1, step=3, scale=1.0):
    import collections

    import numpy as np
    w = torch.nn.Parameter(torch.full((2, 3), scale))
    return {"model": collections.OrderedDict(w=w, b=torch.zeros(3)),
            "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(2) * scale}},
                          "param_groups": [{"lr": lr, "betas": (0.9, 0.999), "amsgrad": False, "fused": None,
                                            "params": [0], "name": "g"}]},
            "rng": {"numpy": ("MT19937", np.arange(4, dtype=np.uint32), step, 0, 0.0)},
            "nested": [[1, [2.5, None]], ()], "iteration": step, "": {"a/b": torch.ones(1)}, "a": {"b": torch.ones(1)}}


def test_a_plan_gives_what_the_walk_gives_for_every_tree_of_the_same_shape():
    from easyckpt.engine.shards.tree import flatten
    from easyckpt.engine.shards.treeplan import FlatPlan
    first = _tree()
    plan = FlatPlan.make(first, flatten(first)[1])
    assert plan is not None
    for tree in (first, _tree(lr=0.05, step=4, scale=2.0), _tree(lr=1, step=5), _tree(lr=True), _tree(lr=-0.0),
                 _tree(lr=float("inf"))):
        _same_as_walk(plan, tree)      # values (and their types) are read, not kept


def test_a_plan_answers_none_for_any_other_shape():
    import collections

    from easyckpt.engine.shards.tree import flatten
    from easyckpt.engine.shards.treeplan import FlatPlan
    first = _tree()
    plan = FlatPlan.make(first, flatten(first)[1])

    def changed(edit):
        tree = _tree()
        edit(tree)
        return tree
    others = [
        lambda t: t.update(extra=1),                                        # a key more
        lambda t: t.pop("iteration"),                                       # a key less
        lambda t: t.update(iteration=t.pop("iteration")),                   # the same keys, another order
        lambda t: t["optimizer"].update(state={True: t["optimizer"]["state"][0]}),   # 0 -> True: equal, not same
        lambda t: t["optimizer"].update(state={None: t["optimizer"]["state"][0]}),
        lambda t: t["nested"][0].append(3),                                 # a list longer
        lambda t: t["optimizer"]["param_groups"][0].update(betas=[0.9, 0.999]),     # tuple -> list
        lambda t: t.update(model=dict(t["model"])),                         # OrderedDict -> dict
        lambda t: t.update(iteration=torch.tensor(3)),                      # a number -> a tensor
        lambda t: t["model"].update(w=1.0),                                 # a tensor -> a number
        lambda t: t.update(iteration=collections.Counter()),                # a dict subclass
        lambda t: t["model"].update(b=torch.zeros(3).to_sparse()),          # not strided
    ]
    for i, edit in enumerate(others):
        tree = changed(edit)
        assert plan.run(tree) is None, i
        try:
            skeleton, tensors = flatten(tree)
        except TypeError:                  # (the sparse tensor: the walk refuses it as well)
            continue
        again = FlatPlan.make(tree, tensors)
        if again is not None:
            _same_as_walk(again, tree)


def test_no_plan_for_nodes_only_the_walk_takes():
    import enum

    import numpy as np

    from easyckpt.engine.shards.tree import flatten
    from easyckpt.engine.shards.treeplan import FlatPlan

    class Name(str):
        pass

    class Level(enum.IntEnum):
        LOW = 1
    subclass = np.arange(3).view(type("Array", (np.ndarray,), {}))
    for odd in (torch.Size([2]), torch.float16, b"x", np.float32(1.5), {Name("k"): 1}, Level.LOW, {(1, 2): 3},
                subclass, {-0.0: 1}):
        tree = {"a": odd, "t": torch.ones(1)}
        assert FlatPlan.make(tree, flatten(tree)[1]) is None, odd


def test_a_shard_whose_shape_keeps_changing_stops_getting_new_plans():
    from easyckpt.engine.shards.tree import flatten
    from easyckpt.engine.shards.treeplan import Flattener
    flattener = Flattener()
    history: list = []
    for step in range(40):
        history.append(step)                               # a list in the shard grows every step
        tree = {"history": list(history), "t": torch.ones(1)}
        assert flattener.flatten("s", tree)[0] == flatten(tree)[0]
    assert flattener._makes["s"] == Flattener.EAGER_MAKES
    steady = {"t": torch.ones(1), "n": 1}
    for step in range(Flattener.SERVED_BEFORE_REMAKE + 3):
        flattener.flatten("u", dict(steady, n=step))
    # the first snapshot walks only; the second walks and makes the plan, which serves the rest
    assert flattener._makes["u"] == 1 and flattener._served["u"] == Flattener.SERVED_BEFORE_REMAKE + 1


def test_a_tree_of_tensors_alone_gets_one_skeleton_object_and_its_json_is_kept_with_it():
    """A model's state dict has no value but its tensors: its plan hands out the same skeleton every time, which the
    slot's JSON takes as unchanged without marshalling it; a tree with a number in it gets a new one each time."""
    import collections

    from easyckpt.engine.save.metajson import KeptJson
    from easyckpt.engine.shards.treeplan import FlatPlan
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    tree = model.state_dict()
    plan = FlatPlan.make(tree, flatten(tree)[1])
    assert plan is not None
    first, again = plan.run(model.state_dict()), plan.run(model.state_dict())
    assert first is not None and again is not None and first[0] is again[0]
    _same_as_walk(plan, model.state_dict())
    model[0].weight = torch.nn.Parameter(torch.ones(2, 3))      # a parameter replaced: read where it now is
    assert plan.run(model.state_dict())[1][0][1].data_ptr() == model[0].weight.data_ptr()
    cache = KeptJson()
    walked = flatten(tree)[0]
    for skeletons in ({"m": first[0]}, {"m": again[0]}, {"m": walked}, {"m": first[0]}):
        assert _meta(skeletons, cache) == _meta({"m": walked}) == {
            "files": [], "step": 3, "skeletons": {"m": walked}, "info": {"x": 1}}
    with_number = collections.OrderedDict(w=torch.ones(1), n=1)
    numbered = FlatPlan.make(with_number, flatten(with_number)[1])
    assert numbered is not None
    assert numbered.run(with_number)[0] is not numbered.run(with_number)[0]
