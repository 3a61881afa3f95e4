"""trainer_state.json made at every snapshot (transformers/statejson.py): byte for byte what the Trainer's own save
writes (``json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True)``), while its log history grows, changes
in place, shrinks or holds values of other types; each entry encoded once while nothing before it changes. In
process, on a real Trainer's state and callbacks."""
from __future__ import annotations

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers")

from easyckpt.transformers import statejson  # noqa: E402
from easyckpt.transformers.statejson import TrainerStateJson  # noqa: E402


class _Trainer:
    """What TrainerStateJson reads of a Trainer: its state, callback handler and control (the real classes)."""

    def __init__(self) -> None:
        from transformers.trainer_callback import (CallbackHandler, DefaultFlowCallback, EarlyStoppingCallback,
                                                   PrinterCallback, TrainerControl, TrainerState)
        self.state = TrainerState(global_step=3, max_steps=10, logging_steps=1, train_batch_size=4)
        self.control = TrainerControl()
        self.callback_handler = CallbackHandler([DefaultFlowCallback(), PrinterCallback(), EarlyStoppingCallback(2)], None, None, None, None)


def _trainers_way(trainer: _Trainer) -> str:
    """What Trainer._save_checkpoint writes: the callbacks' states put in, then save_to_json's dump."""
    from transformers.trainer_callback import ExportableState
    data = dataclasses.asdict(trainer.state)
    callbacks = dict(data.get("stateful_callbacks") or {})
    for cb in trainer.callback_handler.callbacks + [trainer.control]:
        if isinstance(cb, ExportableState):
            callbacks[cb.__class__.__name__] = cb.state()
    data["stateful_callbacks"] = callbacks
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def test_the_text_is_the_trainers_as_the_history_grows_changes_and_shrinks(monkeypatch):
    trainer, made = _Trainer(), TrainerStateJson()
    history = trainer.state.log_history
    encoded = []
    monkeypatch.setattr(statejson, "_entry", lambda e, _real=statejson._entry: encoded.append(e) or _real(e))
    assert made.text(trainer) == _trainers_way(trainer)          # no entry yet: []
    steps = []
    for step in range(1, 7):
        history.append({"loss": 1.5 / step, "grad_norm": step, "learning_rate": 5e-05, "epoch": step / 4,
                        "step": step, "eval": {"nested": [step, None, "é"]}})
        steps.append(made.text(trainer))
        assert steps[-1] == _trainers_way(trainer)
    assert len(encoded) == 6                                      # each entry once
    history[2]["grad_norm"] = 3.0                                 # 3 -> 3.0: equal in Python, not in the file
    assert made.text(trainer) == _trainers_way(trainer) and '"grad_norm": 3.0' in made.text(trainer)
    history[1]["eval"]["nested"].append(1)                        # deep inside an entry
    assert made.text(trainer) == _trainers_way(trainer)
    del history[-2:]
    assert made.text(trainer) == _trainers_way(trainer)
    trainer.state.log_history = [{"loss": float("nan")}, {"flag": True, "n": None}]     # another list
    assert made.text(trainer) == _trainers_way(trainer)
    trainer.state.best_metric, trainer.state.global_step = 0.25, 9
    assert made.text(trainer) == _trainers_way(trainer)


def test_values_marshal_does_not_take_and_a_value_like_the_mark_are_written_the_trainers_way():
    class Number(float):
        pass
    trainer, made = _Trainer(), TrainerStateJson()
    trainer.state.log_history = [{"loss": Number(0.5)}, {"loss": 0.25}]
    assert made.text(trainer) == _trainers_way(trainer)
    trainer.state.log_history.append({"loss": 0.125})
    trainer.state.best_model_checkpoint = statejson._MARK
    assert made.text(trainer) == _trainers_way(trainer)


def test_the_live_state_is_left_as_it_was():
    trainer, made = _Trainer(), TrainerStateJson()
    trainer.state.log_history.append({"loss": 1.0})
    before = dataclasses.asdict(trainer.state)
    made.text(trainer)
    assert dataclasses.asdict(trainer.state) == before and trainer.state.log_history == [{"loss": 1.0}]
