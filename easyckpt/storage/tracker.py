"""The framework's tracker file (Megatron's latest_checkpointed_iteration.txt, DeepSpeed's ``latest``): written after
each commit as a hint for the frameworks' own loaders; easyckpt's loader trusts manifests, never the tracker, so a
crash before it is written loses nothing."""
from __future__ import annotations

import os
from typing import Any, Optional

from easyckpt import _faults as faults
from easyckpt.errors import TrackerNotUpdated
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import Naming
from easyckpt.storage import damaged
from easyckpt.storage.base import Storage
from easyckpt.storage.commit import Committed


def write(storage: Storage, root: str, naming: Naming, step: int, done: Any) -> None:
    """Name ``step`` in the tracker (an atomic write), if the naming has one; TrackerNotUpdated, carrying ``done``
    (the commit, which stands), when it cannot be written."""
    faults.inject("agent.before_tracker")
    if naming.tracker:
        path = os.path.join(root, naming.tracker)
        try:
            storage.write_atomic(path, naming.tracker_text(step).encode())
        except OSError as exc:
            raise TrackerNotUpdated(f"step {step} is committed, but its tracker {path} was not updated ({exc}): the "
                                    f"framework's own loader may not see it; easyckpt's loader reads manifests",
                                    done) from exc
    faults.inject("agent.after_tracker")


def finish(storage: Storage, root: str, naming: Naming, step: int, final: str, manifest: mf.Manifest) -> Committed:
    """The end of either commit strategy's commit: the step's name clean of any damaged mark (a name once rejected
    is clean again), the tracker naming it; the commit's record."""
    damaged.clear(storage, root, os.path.basename(final))
    done = Committed(final, manifest.nbytes, manifest)
    write(storage, root, naming, step, done)
    return done


def read(storage: Storage, root: str, naming: Naming) -> Optional[int]:
    """The step the tracker names, or None (no tracker, unreadable, not a regular file)."""
    if not naming.tracker:
        return None
    try:
        text = storage.read(os.path.join(root, naming.tracker), 0, 256)
    except OSError:
        return None
    return naming.parse_tracker(text.decode("ascii", "replace"))
