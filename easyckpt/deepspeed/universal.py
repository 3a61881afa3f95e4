"""A DeepSpeed step converted to a universal checkpoint, for a resume on another data-parallel size.

Plain ZeRO refuses another data-parallel size; DeepSpeed's universal checkpoint does not. Rank 0 converts
the committed step into a scratch directory under the save dir (only the files its manifest lists,
verified and unpickled safely: DeepSpeed's converter would glob the directory and torch.load whatever it
finds with weights_only=False), every rank loads from it, and rank 0 removes it once no rank reads it.
A step resharded from the nodes' memory was written out in each node's /dev/shm (engine/load/render.py): the node's
first rank converts it inside that private directory, for its node; nothing goes to or comes from the save dir.
The adapter only calls DeepSpeed's loader on the directory this module hands it.
"""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from typing import Iterator, Tuple

from easyckpt.config import Config
from easyckpt.engine.link.dist import all_gather
from easyckpt.engine.load import render
from easyckpt.engine.load.sources import Loaded
from easyckpt.engine.scratch import fresh, remove
from easyckpt.engine.scratch import path as scratch_path
from easyckpt.errors import CheckpointError
from easyckpt.formats.manifest import MANIFEST_NAME


def work_dir(cfg: Config) -> str:
    """The job's scratch directory for the converted copy (one per job: two jobs never share it): beside the
    checkpoints, or for an object store's job in its node-local directory."""
    return scratch_path(cfg.node_dir if cfg.in_store else cfg.save_dir, "universal", cfg.job_id)


def where(cfg: Config, loaded: Loaded, rank: int) -> Tuple[str, bool]:
    """Where ``loaded``'s converted copy goes, and whether this rank converts it: beside a step written out in this
    node's memory, by the rank that wrote it (one per node); else the job's scratch directory, by rank 0."""
    if loaded.source == "resharded" and loaded.path is not None:
        return render.beside(loaded.path, "universal"), loaded.node_first
    return work_dir(cfg), rank == 0


@contextmanager
def converted(tag_dir: str, tag: str, scratch: str, converts: bool, world_size: int) -> Iterator[str]:
    """``scratch`` holding ``tag`` as a universal checkpoint, converted from ``tag_dir`` (the directory
    holding DeepSpeed's files of ``tag``) by the rank that ``converts`` (one per scratch: rank 0, or the first of
    each node for a node's own scratch); every rank enters and leaves together (collectives). A conversion that
    fails raises CheckpointError on every rank."""
    error = None
    if converts:
        fresh(scratch)
        from easyckpt.deepspeed.convert import to_universal
        # the manifest sits in the step directory: tag_dir itself (plain engine), or its parent (the
        # Trainer's checkpoint-N/global_stepN)
        nested = not os.path.lexists(os.path.join(tag_dir, MANIFEST_NAME))
        step_dir = os.path.dirname(tag_dir.rstrip("/")) if nested else tag_dir
        try:
            to_universal(step_dir, tag, scratch, prefix=os.path.basename(tag_dir.rstrip("/")) + "/" if nested else "")
        except (ValueError, OSError, subprocess.SubprocessError) as exc:
            error = str(exc)
    errors = [e for e in all_gather(error, world_size) if e]
    try:
        if errors:
            raise CheckpointError(errors[0])
        yield scratch
    finally:
        all_gather(None, world_size)          # nobody removes the copy while another rank still reads it
        if converts:
            remove(scratch)
