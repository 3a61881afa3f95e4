"""Python's and numpy's RNG states read from the generators' memory (engine/save/rngmemory.py): always exactly what
random.getstate() and np.random.get_state() say, across what a training loop does to them, and numpy's and
Python's own calls used wherever the bytes could not be proven."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from easyckpt.engine.save import rng, rngmemory
from easyckpt.transformers import rng as trainer_rng


ARGS = SimpleNamespace(parallel_mode=SimpleNamespace(value="not_distributed"))   # (read only where CUDA is)


def same_as_public(state: dict) -> bool:
    python, numpy = state["python"], state["numpy"]
    mine = (python["version"], tuple(python["state"].tolist()), python["gauss"])
    theirs = np.random.get_state()
    return mine == random.getstate() and numpy[0] == theirs[0] and bool((numpy[1] == theirs[1]).all()) \
        and tuple(numpy[2:]) == tuple(theirs[2:])


def draws() -> list:
    return [random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(2).tolist()]


MOVES = [
    lambda: None,
    lambda: random.random(),
    lambda: random.gauss(0, 1),            # a second Gaussian cached: gauss_next set
    lambda: random.gauss(0, 1),            # ... and used
    lambda: np.random.randn(1),            # numpy's has_gauss set, its words moved
    lambda: np.random.randn(1),            # has_gauss used: the words stay, has_gauss goes back to 0
    lambda: np.random.rand(700),           # past the 624 words: a new block of the twister
    lambda: random.seed(3),
    lambda: np.random.seed(3),
]


def test_the_capture_is_what_the_public_calls_say_after_each_move():
    random.seed(7)
    np.random.seed(7)
    for move in MOVES:
        move()
        assert same_as_public(rng.capture())
        trainer = trainer_rng.states(ARGS)          # the HF Trainer's rng_state file: the same tuples
        assert trainer["python"] == random.getstate() and (trainer["numpy"][1] == np.random.get_state()[1]).all()
    assert rngmemory.PYTHON.usable and rngmemory.NUMPY.usable       # the bytes served, not the fallback


def test_a_state_set_back_with_the_same_words_and_another_cached_gaussian_is_seen():
    np.random.seed(5)
    np.random.randn(1)                     # a Gaussian cached
    cached = np.random.get_state()
    np.random.randn(1)                     # used: the same words, none cached
    assert rng.capture()["numpy"][3] == 0
    np.random.set_state(cached)            # the words of the last capture, a Gaussian cached again
    got = rng.capture()["numpy"]
    assert got[3] == 1 and got[4] == cached[4]


def test_a_capture_restores_to_the_same_draws():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    np.random.randn(1)
    random.gauss(0, 1)
    state = rng.capture()
    expected = draws()
    rng.restore(state)
    assert draws() == expected


@pytest.mark.filterwarnings("ignore:get_state and legacy")     # numpy's own call, as before this module
def test_another_bit_generator_is_read_through_numpy():
    before = np.random.get_state()
    kept = np.random.mtrand._rand._bit_generator
    np.random.set_bit_generator(np.random.PCG64(9))
    try:
        assert rngmemory.NUMPY.read() is None
        assert rng.capture()["numpy"] == np.random.get_state()      # numpy's own dict for a PCG64
    finally:
        np.random.set_bit_generator(kept)
        np.random.set_state(before)
    assert same_as_public(rng.capture())


def test_bytes_that_do_not_prove_themselves_are_never_used(monkeypatch):
    monkeypatch.setattr(rngmemory, "_HEAD", rngmemory._HEAD + 4)     # a layout not what the module expects
    python = rngmemory.PythonState()
    assert python.read() is None and python.usable is False
    assert python.getstate() == random.getstate()
    numpy = rngmemory.NumpyState()
    monkeypatch.setattr(rngmemory, "_find_gauss", lambda rs, base: (rngmemory._HEAD, 8))     # the wrong bytes
    before = np.random.get_state()
    np.random.randn(1)
    assert numpy.read() is None and numpy.usable is False
    after = np.random.get_state()          # the proof set the generator back where it was
    np.random.set_state(before)
    np.random.randn(1)
    assert (after[1] == np.random.get_state()[1]).all() and after[2:] == np.random.get_state()[2:]


@pytest.mark.parametrize("drawn", [False, True])
def test_the_python_state_tuple_is_kept_only_while_nothing_is_drawn(drawn):
    first = rngmemory.PYTHON.getstate()
    if drawn:
        random.random()
    again = rngmemory.PYTHON.getstate()
    assert again == random.getstate()
    assert (again[1] is first[1]) is not drawn
