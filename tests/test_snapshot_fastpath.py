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
    assert set(cache) == {"a.safetensors", "b"}


def test_a_skeleton_marshal_cannot_hold_is_encoded_each_time():
    class Name(str):
        pass
    cache: dict = {}
    skeletons = {"a": {Name("k"): Name("v")}}
    assert _meta(skeletons, cache)["skeletons"] == {"a": {"k": "v"}}
    assert cache == {}


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
