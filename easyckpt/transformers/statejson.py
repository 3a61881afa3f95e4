"""trainer_state.json as the Trainer's ``_save_checkpoint`` would write it now, made at every snapshot.

The Trainer writes it with ``json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True)``: a deep copy and an
encoding in pure Python (json's C encoder takes no indent) of the whole ``log_history``, which grows by an entry at
every logging step. At about 19 us an entry on the test VM, a run logging every step paid 18 ms a snapshot after
1,000 steps and 235 ms after 10,000, and the snapshot budget spaced the snapshots further apart the longer the job
ran. Here each entry is encoded once: the history's marshal tells whether the entries seen before are still there,
unchanged and of the same types (the Trainer only appends), and only the new ones are encoded. The text is the
Trainer's, byte for byte (tests/test_trainer_state_json.py).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import marshal
from typing import Any, List

# stands for the history in the dump of the rest (no value of a TrainerState holds NUL; were one to, the text is made
# the Trainer's way)
_MARK = "\0easyckpt:log_history\0"
_MARK_JSON = json.dumps(_MARK)
_LIST = 5                   # a marshalled list's type byte and item count, before its items
_ITEM = ",\n    "           # between two entries of the history, as json writes it at that depth


def _entry(entry: Any) -> str:
    # an entry as json writes it two levels deep (the top dict, the history's list): each line indented 4 more
    return json.dumps(entry, indent=2, sort_keys=True).replace("\n", "\n    ")


class TrainerStateJson:
    """The text of one Trainer's trainer_state.json, its history's entries kept encoded between snapshots."""

    def __init__(self) -> None:
        self._items = b""           # the marshalled entries encoded so far
        self._count = 0
        self._texts: List[str] = []

    def text(self, trainer: Any) -> str:
        """The file, with the ``stateful_callbacks`` the Trainer's save would add (it appends them only when it
        really saves, so the live state is left as it is)."""
        from transformers.trainer_callback import ExportableState
        state = trainer.state
        rest = copy.copy(state)
        rest.log_history = []
        data = dataclasses.asdict(rest)
        callbacks = dict(data.get("stateful_callbacks") or {})
        for cb in trainer.callback_handler.callbacks + [trainer.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                callbacks[name] = (list(callbacks[name]) + [cb.state()]) if isinstance(callbacks.get(name), list) \
                    else cb.state()
        data["stateful_callbacks"] = callbacks
        history = state.log_history
        data["log_history"] = _MARK
        text = json.dumps(data, indent=2, sort_keys=True)
        if text.count(_MARK_JSON) != 1 or type(history) is not list:
            data["log_history"] = history
            return json.dumps(data, indent=2, sort_keys=True) + "\n"
        return text.replace(_MARK_JSON, self._history(history)) + "\n"

    def _history(self, history: List[Any]) -> str:
        try:
            items = marshal.dumps(history, 2)[_LIST:]
        except ValueError:          # a value marshal does not take (a subclass): encoded whole, nothing kept
            self._items, self._count, self._texts = b"", 0, []
            return json.dumps(history, indent=2, sort_keys=True).replace("\n", "\n  ")
        if not items.startswith(self._items) or len(history) < self._count:
            self._count, self._texts = 0, []        # an entry changed or went: all encoded again
        self._texts.extend([_entry(e) for e in history[self._count:]])     # (all made before any is kept)
        self._items, self._count = items, len(history)
        return "[\n    " + _ITEM.join(self._texts) + "\n  ]" if self._texts else "[]"
