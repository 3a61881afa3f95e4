"""Progress bars for long operations (load, verify, convert, inspect), on stderr.

Shown when stderr is a terminal, or when forced (``--progress`` on the command line,
``EASYCKPT_PROGRESS=1`` for a training process); never mixed into stdout, so ``--json`` output stays
parseable. tqdm draws them when it is installed (it comes with transformers and DeepSpeed); otherwise a
plain line per tenth of the work is printed.
"""
from __future__ import annotations

import os
import sys
from typing import Optional


def wanted(force: Optional[bool] = None) -> bool:
    if force is not None:
        return force
    env = os.environ.get("EASYCKPT_PROGRESS")
    if env is not None:
        return env not in ("", "0", "false", "no")
    return sys.stderr.isatty()


class Progress:
    """``with Progress(total_bytes, "verify") as bar: bar.update(n)``; a no-op when not wanted."""

    def __init__(self, total: int, desc: str, force: Optional[bool] = None, unit: str = "B"):
        self.total, self.desc, self.unit = max(int(total), 0), desc, unit
        self.done = 0
        self._bar = None
        self._plain_next = 0
        self.on = wanted(force) and self.total > 0
        if self.on:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=self.total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024,
                                 file=sys.stderr, dynamic_ncols=True, leave=True, mininterval=0.2)

    def update(self, n: int) -> None:
        if not self.on:
            return
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.done >= self._plain_next or self.done >= self.total:
            pct = 100 * min(self.done, self.total) // self.total
            print(f"{self.desc}: {pct}% ({self.done:,d} of {self.total:,d} {self.unit})", file=sys.stderr,
                  flush=True)
            self._plain_next = self.done + self.total // 10

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
