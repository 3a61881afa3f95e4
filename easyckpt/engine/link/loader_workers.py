"""DataLoader workers leave SIGTERM to their trainer (RELIABILITY row 27).

A scheduler's cancel or preemption (Slurm's ``scancel``, a node drain) signals every process of the job
at once. torch's worker handler lets a worker end quietly only on its parent's SIGTERM; anyone else's
kills it, and the trainer then raises "DataLoader worker (pid …) is killed by signal: Terminated" at its
next batch or SIGCHLD — before its safe point, so no on-demand checkpoint is taken. While easyckpt's
SIGTERM handling is installed in a trainer (``guard``; preempt.py calls it):

1. The trainer starts every DataLoader worker with SIGTERM blocked (the mask is inherited through fork
   and exec alike, so fork, spawn and forkserver workers are covered from their first instruction).
2. The worker runs torch's own worker loop behind ``_worker_loop``, which first starts a thread that
   takes each SIGTERM with ``sigwaitinfo``: one from the trainer (the DataLoader's own ``terminate()``,
   multiprocessing's at exit for daemonic children) ends the worker at once, exactly as torch's handler
   does; anyone else's is dropped. So workers still end with their trainer — the DataLoader shuts them
   down, or their watchdog sees the trainer gone — and never before it.

Why blocked + ``sigwaitinfo`` and not ``SIG_IGN``: torch's worker loop installs its own SIGTERM handler
first thing, over an inherited SIG_IGN; and an ignored SIGTERM would also ignore the trainer's
``terminate()``, so a trainer exiting with a live iterator would wait on its workers forever.

Limits: a forkserver already running when the first DataLoader iterator is created (started by other
code) was started without the mask and dies of the scheduler's SIGTERM, taking its workers with it;
processes a worker starts inherit the blocked SIGTERM. Other processes forked from the trainer keep the
SIGTERM disposition the trainer had before easyckpt (preempt.py), so e.g. a ``multiprocessing.Pool`` still
terminates its workers.

torch names used (private, stable since torch 1.x): ``torch.utils.data._utils.worker._worker_loop``, looked
up when each worker is created, and ``torch.utils.data.dataloader._MultiProcessingDataLoaderIter``, which
creates them. Without them (another torch) ``guard`` returns False and nothing changes.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Any, Callable, Optional, cast

_lock = threading.Lock()
_guarded = False
# torch's own functions, saved once: a forked worker finds the loop here (a spawned one imports torch's)
_torch_loop: Optional[Callable[..., Any]] = None
_torch_iter_init: Optional[Callable[..., Any]] = None


def guard() -> bool:
    """From now on, DataLoader workers this process starts leave SIGTERM to it. True when in effect."""
    global _guarded, _torch_loop, _torch_iter_init
    try:
        from torch.utils.data import dataloader
        from torch.utils.data._utils import worker
        iterator = dataloader._MultiProcessingDataLoaderIter
        loop = worker._worker_loop
    except (ImportError, AttributeError):
        return False
    with _lock:
        if not _guarded:
            if _torch_loop is None:
                _torch_loop, _torch_iter_init = loop, iterator.__init__
            worker._worker_loop = _worker_loop
            iterator.__init__ = _start_workers  # type: ignore[method-assign]  # patching torch's class
            _guarded = True
    return True


def unguard() -> None:
    """Workers started from now on get torch's SIGTERM handling again (those running keep theirs)."""
    global _guarded
    with _lock:
        if not _guarded:
            return
        from torch.utils.data import dataloader
        from torch.utils.data._utils import worker
        # torch's functions were saved by guard() before _guarded was set
        if worker._worker_loop is _worker_loop:
            worker._worker_loop = cast(Callable[..., Any], _torch_loop)
        if dataloader._MultiProcessingDataLoaderIter.__init__ is _start_workers:
            dataloader._MultiProcessingDataLoaderIter.__init__ = (  # type: ignore[method-assign]  # torch's class
                cast(Callable[..., Any], _torch_iter_init))
        _guarded = False


def _start_workers(self: Any, *args: Any, **kwargs: Any) -> None:
    """``_MultiProcessingDataLoaderIter.__init__``, which starts the workers, with SIGTERM blocked in this
    thread: a worker inherits the mask, so no SIGTERM can reach it before ``_worker_loop`` takes over. The
    trainer itself still gets a SIGTERM sent meanwhile (through another thread, or when the mask is restored)."""
    assert _torch_iter_init is not None
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        _torch_iter_init(self, *args, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _worker_loop(*args: Any, **kwargs: Any) -> None:
    """The target of a DataLoader worker (pickled by name for spawn/forkserver): torch's loop, with
    SIGTERM taken by a thread that honours only the trainer's."""
    _sigterm_from_trainer_only()
    loop = _torch_loop
    if loop is None:          # a fresh interpreter (spawn, forkserver): nobody replaced torch's loop here
        from torch.utils.data._utils import worker
        loop = worker._worker_loop
    if loop is _worker_loop:
        raise RuntimeError("easyckpt: torch's DataLoader worker loop is not known in this process")
    loop(*args, **kwargs)


def _sigterm_from_trainer_only() -> None:
    # blocked since the worker was created; again in case another start path skipped _start_workers. Every
    # thread started from here on (torch's, queue feeders) inherits the mask, so only sigwaitinfo takes it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = multiprocessing.parent_process()
    trainer = parent.pid if parent is not None and parent.pid is not None else os.getppid()

    def serve() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == trainer:
                os._exit(0)   # what torch's worker handler does on its parent's SIGTERM

    threading.Thread(target=serve, name="easyckpt-worker-sigterm", daemon=True).start()
