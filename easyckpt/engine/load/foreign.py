"""Checkpoints easyckpt did not write, as the adapters need to recognise them before handing over.

- ``newest_plain_checkpoint``: a plain Hugging Face Trainer's newest ``checkpoint-N`` that looks complete.
- ``megatron_only_step``: Megatron's own step in a format only Megatron reads (torch_dist, torch_dcp).

Those checkpoints easyckpt does read go through adopt.py (a manifest built from the directory itself).
"""
from __future__ import annotations

import os
from typing import Optional

from easyckpt.config import NAMINGS, Naming
from easyckpt.engine.load.adopt import tracker_step
from easyckpt.formats import manifest as mf
from easyckpt.storage import stepfiles
from easyckpt.storage.savedir import SaveDir


def newest_plain_checkpoint(output_dir: str, above: int = 0) -> Optional[str]:
    """The newest ``checkpoint-N`` written by a plain Trainer (no easyckpt manifest) that looks complete
    (its trainer_state.json is readable and of step N), if newer than ``above``. The Trainer's adapter no
    longer uses it (the loader adopts such checkpoints after loading every file); kept for callers."""
    found = []
    for step, path in SaveDir(output_dir, NAMINGS["transformers"]).step_dirs():
        if step <= above or stepfiles.read(path) is not None:
            continue
        if stepfiles.trainer_state_step(path) == step:
            found.append((step, path))
    return max(found)[1] if found else None


def megatron_only_step(load_dir: str, naming: Naming) -> Optional[str]:
    """The step directory Megatron's tracker names in ``load_dir`` when it is Megatron's own checkpoint in
    a format only Megatron reads (a distributed-checkpoint format: no mp_rank_* directories), else None.
    A damaged ``--ckpt-format torch`` one is not such a step: easyckpt rejected it, Megatron would crash on it."""
    step = tracker_step(load_dir, naming)
    if step is None:
        return None
    step_dir = os.path.join(load_dir, naming.dir_name(step))
    try:
        names = os.listdir(step_dir)
    except OSError:
        return None
    if mf.MANIFEST_NAME in names or any(n.startswith("mp_rank_") for n in names):
        return None
    return step_dir
