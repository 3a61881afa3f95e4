"""The threads that run the background part of a snapshot (background.py): one that stays for the process's
life for the host copies, and one that feeds a device's copies, instead of threads started and joined per
snapshot. Starting and joining a thread cost an overlapped snapshot of a tiny state 130 us on a 2-core VM;
handing the work to a thread that waits for it, 15 us.

concurrent.futures' workers end as the per-snapshot non-daemon threads did: at the process's end the
interpreter lets each finish the copy it runs (and any queued) before it finalizes, so no copy is cut off
inside torch (a thread stopped inside a C++ frame at shutdown aborts the process). Work handed over later,
from an exit handler, runs on a thread of its own, as before. A forked child starts its own workers: the
parent's threads are not in it.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict

_pools: Dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _forked() -> None:
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def start(kind: str, work: Callable[[], None]) -> "Future[None]":
    """Run ``work`` on this process's ``kind`` thread (named ``easyckpt-KIND``); its future is done when it
    returned. ``work`` reports its own errors (the background copy keeps them for the snapshot's wait)."""
    with _lock:
        pool = _pools.get(kind)
        if pool is None:
            pool = _pools[kind] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"easyckpt-{kind}")
    try:
        return pool.submit(work)
    except RuntimeError:        # the interpreter is shutting down (an exit handler's finalize): a thread of its own
        done: "Future[None]" = Future()

        def run() -> None:
            try:
                work()
            finally:
                done.set_result(None)
        threading.Thread(target=run, name=f"easyckpt-{kind}", daemon=False).start()
        return done
