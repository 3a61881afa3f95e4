"""Training comes first: the agent's bulk work, and the trainer's own preparation of its snapshot slots, run
at a lower CPU priority than training.

Only the threads that move bytes are lowered (the persist worker and the hash threads it starts, the
replica sender, peer transfers): on Linux a thread's nice value is its own and the threads it starts
inherit it. The agent's loop keeps the trainers' priority, so it answers a hello, a flush or a SIGTERM
agreement at once even while the trainers keep every core busy (a job starting: a whole-process nice made
the first hello wait seconds behind the trainers' imports).
"""
from __future__ import annotations

import os
import threading

BULK_NICE = 10


def bulk_thread() -> None:
    """Lower the calling thread's priority by BULK_NICE (best effort: nothing where it cannot)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BULK_NICE))
    except (OSError, AttributeError):
        pass
