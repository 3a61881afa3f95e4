"""What a trainer tells ``easyckpt run`` about itself (only when it runs under it).

``easyckpt run`` puts ``EASYCKPT_RUN_DIR`` (a private temporary directory) and ``EASYCKPT_RUN_ATTEMPT``
into the training command's environment. The engine then keeps there:

  progress.rank{R}   8 bytes: the last iteration rank R completed (a store into a mapping per safe
                     point, so the launcher can tell how many iterations a crash cost)
  events.jsonl       one line per resume (step, memory/storage, seconds) and per SIGTERM save
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import time
from typing import Any, Dict, List, Optional

ENV_DIR = "EASYCKPT_RUN_DIR"
ENV_ATTEMPT = "EASYCKPT_RUN_ATTEMPT"


class LastStep:
    """The last iteration this rank completed, kept in an 8-byte mapping that `easyckpt run` reads (a store
    per safe point, no system call)."""

    def __init__(self, rank: int):
        self.mm: Optional[mmap.mmap] = None
        run_dir = os.environ.get(ENV_DIR)
        if not run_dir or not os.path.isdir(run_dir):
            return
        fd = os.open(os.path.join(run_dir, f"progress.rank{rank}"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 8)
            self.mm = mmap.mmap(fd, 8)
        finally:
            os.close(fd)

    def mark(self, step: int) -> None:
        if self.mm is not None:
            struct.pack_into("<q", self.mm, 0, step)


def record(event: str, **fields: Any) -> None:
    run_dir = os.environ.get(ENV_DIR)
    if not run_dir or not os.path.isdir(run_dir):
        return
    line = json.dumps({"event": event, "attempt": int(os.environ.get(ENV_ATTEMPT, "0")), "time": time.time(),
                       **fields}) + "\n"
    fd = os.open(os.path.join(run_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def last_progress(run_dir: str) -> Optional[int]:
    """The furthest iteration any rank completed (None: no trainer reported any)."""
    steps = []
    for name in os.listdir(run_dir):
        if name.startswith("progress.rank"):
            with open(os.path.join(run_dir, name), "rb") as f:
                raw = f.read(8)
            if len(raw) == 8:
                steps.append(struct.unpack("<q", raw)[0])
    return max(steps) if steps else None


def events(run_dir: str) -> List[Dict[str, Any]]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
