"""The operator tools' own output: each command's lines go to the stdout the command started with, while
everything else that prints while it runs (DeepSpeed's import banner, a framework's warnings) is sent to stderr
(main.py), so that --json output stays parseable."""
from __future__ import annotations

import sys
from typing import Any, TextIO

_stdout: TextIO = sys.stdout


def to(stream: TextIO) -> None:
    """Where ``say`` writes from now on (main.py: the stdout a command started with)."""
    global _stdout
    _stdout = stream


def say(*parts: Any) -> None:
    """A line of the command's output."""
    print(*parts, file=_stdout, flush=True)
