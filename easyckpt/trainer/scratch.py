"""Files for framework calls that only speak in paths: scratch directories next to the checkpoints.

The Hugging Face Trainer's tokenizer or processor can only save itself into a directory, its resume path
reads ``trainer_state.json`` from one, and DeepSpeed ships a helper script as a file of its package.
Adapters hold no file I/O (DESIGN.md), so they come here. A scratch directory is named after the job and,
where ranks differ, the rank, so that two jobs or ranks on one output directory never share one; whoever
made it removes it.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, List, Tuple


def files_written_by(save: Callable[[str], None], scratch: str) -> List[Tuple[str, bytes]]:
    """The files ``save(directory)`` writes (top level, sorted by name), read back from the scratch
    directory ``scratch``, which is emptied first and removed after."""
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        save(scratch)
        out = []
        for name in sorted(os.listdir(scratch)):
            with open(os.path.join(scratch, name), "rb") as f:
                out.append((name, f.read()))
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def file_bytes(path: str) -> bytes:
    """The content of a file that ships with a framework (e.g. DeepSpeed's zero_to_fp32.py)."""
    with open(path, "rb") as f:
        return f.read()


def staged_file(directory: str, name: str, data: bytes) -> str:
    """``directory`` holding one file ``name`` with ``data`` (for a loader that reads it by path)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
    return directory


def remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
