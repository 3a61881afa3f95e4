"""SIGTERM → one on-demand checkpoint of a step every rank agrees on.

The signal handler only records the signal (and calls the handler that was installed before it).
Everything that may block runs in a daemon thread, the watcher:

* It learns of the signal through the interpreter's wakeup fd, which the C-level handler writes even
  while the main thread is stuck in C code (a hung collective, a long kernel), and tells the node
  agent at once: the agent's grace deadline starts with the signal, not with the next safe point.
* It runs the agreement over the job's c10d store, so that the main thread pays one attribute read
  per iteration (``pending``) and never joins a collective that the other ranks are not in.

Agreement (one round per signal; keys under ``easyckpt/<job>/<round>/`` of the default store):
  1. A rank whose main thread finds the signal at safe point s asks its watcher to propose; the first
     ``add("proposals")`` wins and sets ``proposed``.
  2. Every watcher that sees ``proposed`` sets its ``pending`` flag, then acks with the first safe point
     its main thread can still stop at: the one it waits at, else the last one it passed + 1.
     (The main thread checks ``pending`` at every safe point, so it never runs past that one unaware.)
  3. The proposer's watcher, once every rank acked, publishes T = the largest ack. A rank whose main
     thread found ``pending`` waits at its safe point until T is known, trains on to T, saves T.
Why this cannot deadlock: ranks only *wait* at safe points, and only until T is published, which
needs nothing from any main thread. Data-parallel ranks are at most one step apart, so T is the
signalled step or the one after it.

Processes forked from the trainer are no trainers: at the fork they drop the handler and the wakeup fd
(a socket shared with the trainer, whose watcher would take their signals for its own) and get the
SIGTERM handling the trainer had before easyckpt. DataLoader workers, which a scheduler's SIGTERM to the
whole job would otherwise kill before the trainer can save, leave SIGTERM to the trainer (loader_workers.py).
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import threading
import time
from typing import Any, Callable, List, Optional

from easyckpt.engine.link import loader_workers
from easyckpt.errors import PreemptionError
from easyckpt.storage.auditlog import AuditLog


def _default_store() -> Any:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


class Preemption:
    def __init__(self, job_id: str, rank: int, world_size: int, grace: float, log: AuditLog,
                 tell_agent: Callable[[float], object], dead_ranks: Callable[[], List[int]]):
        self.job_id, self.rank, self.world_size, self.grace, self.log = job_id, rank, world_size, grace, log
        self.tell_agent, self.dead_ranks = tell_agent, dead_ranks
        self.pending = False                  # the one attribute a safe point reads
        # under torchrun the store lives in the launcher (TORCHELASTIC_USE_AGENT_STORE): once it is gone (the
        # launcher was killed, its workers re-parented) every store call fails, each with a C++ backtrace
        self._launcher = os.getppid() if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" \
            else None
        self._store_gone: Optional[str] = None
        self._store_warned = 0.0
        self.signalled_at: Optional[float] = None   # wall time of the first SIGTERM not yet saved
        self.ack_timeout = min(60.0, grace / 4)
        # shared between the main thread and the watcher (guarded by _lock where both write)
        self._lock = threading.Lock()
        self._round = 0
        self.at = 0                          # last safe point the main thread passed
        self._waiting_at: Optional[int] = None
        self._want_propose: Optional[int] = None
        self._decision: Optional[str] = None  # "T" or "abort:<why>"
        self._told_agent = False
        self._previous: Any = None
        self._installed = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._old_wakeup_fd = -1
        self._fork_mask = threading.local()

    # ---- installation (main thread) -----------------------------------------------------

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            self.log.emit("warning", rank=self.rank, message="initialize_easyckpt was not called from the main "
                                                             "thread: no SIGTERM autocheckpoint in this process")
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        try:
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        except ValueError:
            self._old_wakeup_fd = -1
        self._installed = True
        os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_in_parent,
                            after_in_child=self._forget_in_child)
        if not loader_workers.guard():
            self.log.emit("warning", rank=self.rank, message="this torch's DataLoader is not the one easyckpt knows: "
                                                             "its workers die of a SIGTERM sent to the whole job")
        self._thread = threading.Thread(target=self._watch, daemon=True, name="easyckpt-sigterm")
        self._thread.start()
        # a process that ends without finalize: the watcher must not be inside a c10d store call when the
        # interpreter tears down (C++ aborts: "terminate called without an active exception")
        atexit.register(self._stop_watcher)
        return True

    def _stop_watcher(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def uninstall(self) -> None:
        if not self._installed:
            return
        self._stop_watcher()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            try:
                signal.set_wakeup_fd(self._old_wakeup_fd)
            except ValueError:
                pass
        loader_workers.unguard()
        self._installed = False

    # SIGTERM stays blocked in the forking thread across a fork, so that the child cannot run the inherited
    # handler (nor write into the trainer's wakeup socket) before _forget_in_child; a SIGTERM sent to the
    # child meanwhile waits for the mask to be restored, and then meets the handling the trainer had before.
    def _before_fork(self) -> None:
        if self._installed:
            self._fork_mask.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def _after_fork_in_parent(self) -> None:
        old, self._fork_mask.old = getattr(self._fork_mask, "old", None), None
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _forget_in_child(self) -> None:
        """In a process just forked from the trainer: nothing of this object may act there (it would flag a
        checkpoint that process never takes, and write its signals into the trainer's wakeup socket)."""
        old, self._fork_mask.old = getattr(self._fork_mask, "old", None), None
        try:
            self._forget()
        finally:
            if old is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _forget(self) -> None:
        if not self._installed:
            return
        self._installed = False
        self._thread = None
        try:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            signal.set_wakeup_fd(self._old_wakeup_fd)
        except (ValueError, OSError):
            pass
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()       # this process's copy; the trainer keeps its own
        self._wake_r = self._wake_w = None

    def _handler(self, signum: int, frame: Any) -> None:
        # only flags: the safe point and the watcher do the work
        if self.signalled_at is None:
            self.signalled_at = time.time()
        self.pending = True
        if callable(self._previous):
            self._previous(signum, frame)

    # ---- the safe point (main thread) --------------------------------------------------

    def target(self, step: int) -> Optional[int]:
        """Called at a safe point when ``pending``: the agreed step (``step`` itself: save now), or None
        when this rank has to train on to reach it."""
        self.at = step
        if self.world_size == 1 or _default_store() is None:
            return step
        with self._lock:
            if self._decision is None and self.signalled_at is not None and self._want_propose is None:
                self._want_propose = step
            self._waiting_at = step
        deadline = time.monotonic() + self.ack_timeout + 30
        while self._decision is None:
            if time.monotonic() > deadline:
                raise PreemptionError(f"rank {self.rank}: no step was agreed on within {self.ack_timeout + 30:.0f}s "
                                      f"after SIGTERM; the rank that proposed it may have died")
            time.sleep(0.002)
        self._waiting_at = None
        decision = self._decision
        if decision.startswith("abort:"):
            raise PreemptionError(decision[len("abort:"):])
        agreed = int(decision)
        if step > agreed:
            raise PreemptionError(f"rank {self.rank} is at step {step}, past the agreed step {agreed}")
        return agreed if step == agreed else None

    def deadline_left(self) -> float:
        start = self.signalled_at if self.signalled_at is not None else time.time()
        return start + self.grace - time.time()

    def done(self) -> None:
        """The agreed step is committed: the next SIGTERM starts a new round."""
        with self._lock:
            self._round += 1
            self._want_propose = self._decision = self._waiting_at = None
            self.signalled_at = None
            self._told_agent = False
            self.pending = False

    # ---- the watcher thread ------------------------------------------------------------

    def _poll_interval(self) -> float:
        # every rank polls the store: keep the store's load bounded on large jobs
        return max(0.05, self.world_size / 1000)

    def _watch(self) -> None:
        assert self._wake_r is not None
        r = self._wake_r
        state = _Round()
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([r], [], [], self._poll_interval())
            except (OSError, ValueError):
                return
            if ready:
                try:
                    data = r.recv(512)
                except OSError:
                    data = b""
                if signal.SIGTERM in data and self.signalled_at is None:
                    self.signalled_at = time.time()     # the main thread may be stuck in C code
                    self.pending = True
                if self._old_wakeup_fd >= 0 and data:
                    try:
                        os.write(self._old_wakeup_fd, data)   # whoever installed a wakeup fd before us
                    except OSError:
                        pass
            if self.signalled_at is not None and not self._told_agent:
                self._told_agent = True
                try:
                    self.tell_agent(self.signalled_at)
                except Exception as exc:  # noqa: BLE001 - the save at the safe point still happens
                    self.log.emit("warning", rank=self.rank, message=f"could not tell the agent of SIGTERM: {exc}")
            if self.world_size > 1 and not self._launcher_gone():
                try:
                    state = self._agree(state)
                except Exception as exc:  # noqa: BLE001 - a broken store: the safe point times out, naming it
                    time.sleep(0.5)
                    if not self._launcher_gone() and time.monotonic() - self._store_warned > 60:
                        self._store_warned = time.monotonic()     # once a minute, not at every poll
                        self.log.emit("warning", rank=self.rank, message=f"SIGTERM agreement: {exc}")

    def _launcher_gone(self) -> bool:
        """Whether torchrun, which holds the store, has died (this process was re-parented): said once, on
        rank 0's console, and the agreement stops (no store call can succeed again)."""
        if self._store_gone is not None:
            return True
        if self._launcher is None or os.getppid() == self._launcher:
            return False
        self._store_gone = (f"the launcher (pid {self._launcher}) that holds the ranks' store is gone: SIGTERM "
                            f"agreement is off for the rest of this run (snapshots and persistence go on)")
        if self.rank == 0:
            self.log.emit("warning", rank=self.rank, message=self._store_gone)
        else:
            self.log.record("warning", rank=self.rank, message=self._store_gone)
        return True

    def _agree(self, state: "_Round") -> "_Round":
        base = _default_store()
        if base is None:
            return state
        if state.round != self._round:
            state = _Round(self._round)
        import torch.distributed as dist
        store = dist.PrefixStore(f"easyckpt/{self.job_id}/{state.round}/", base)
        self._share_notice(store, state)
        if self._want_propose is not None and not state.tried:
            state.tried = True
            if store.add("proposals", 1) == 1:
                state.proposer, state.proposed_at = True, time.monotonic()
                store.set("proposed", str(self.rank))
                self.log.emit("sigterm", rank=self.rank, step=self._want_propose, message="proposing an on-demand "
                                                                                          "checkpoint to all ranks")
        if not state.seen and (state.proposer or store.check(["proposed"])):
            state.seen = True
            with self._lock:
                if state.round == self._round:
                    self.pending = True
        if state.seen and not state.acked:
            with self._lock:
                stop_at = self._waiting_at if self._waiting_at is not None else self.at + 1
            store.set(f"ack/{self.rank}", str(stop_at))
            store.add("acks", 1)
            state.acked = True
        if state.proposer and not state.published:
            self._decide(store, state)
        if self._decision is None and state.seen and store.check(["decided"]):
            decision = store.get("decided").decode()
            with self._lock:
                if state.round == self._round:
                    self._decision = decision
        return state

    def _share_notice(self, store: Any, state: "_Round") -> None:
        """A SIGTERM on some node starts every node's agent's grace clock, not only its own: a node whose
        trainers are stuck cannot propose, and the agents of the other nodes must still persist their
        shards of the fallback step (recovery.py), or the coordinator could never commit it."""
        if self.signalled_at is not None:
            if not state.noticed:
                state.noticed = True
                store.compare_set("term", "", repr(self.signalled_at))   # the first signal's time
            return
        if not self._told_agent and store.check(["term"]):
            self._told_agent = True
            try:
                self.tell_agent(float(store.get("term").decode()))
            except Exception as exc:  # noqa: BLE001 - the agent's own notice, or none
                self.log.emit("warning", rank=self.rank, message=f"could not tell the agent of SIGTERM: {exc}")

    def _decide(self, store: Any, state: "_Round") -> None:
        if store.add("acks", 0) >= self.world_size:
            keys = [f"ack/{r}" for r in range(self.world_size)]
            agreed = max(int(v) for v in store.multi_get(keys))
            store.set("decided", str(agreed))
            state.published = True
            return
        waited = time.monotonic() - state.proposed_at
        missing: List[int] = []
        if waited > self.ack_timeout or int(waited * 2) != state.dead_checks:
            state.dead_checks = int(waited * 2)
            missing = [r for r in range(self.world_size) if not store.check([f"ack/{r}"])]
        dead = sorted(set(missing) & set(self.dead_ranks())) if missing else []
        if dead or waited > self.ack_timeout:
            why = (f"ranks {dead} died" if dead else
                   f"ranks {missing} did not answer within {self.ack_timeout:.0f}s")
            store.set("decided", f"abort:SIGTERM on-demand checkpoint abandoned: {why}; the node agent persists "
                                 f"the newest complete snapshot instead")
            state.published = True


class _Round:
    def __init__(self, round_: int = 0):
        self.round = round_
        self.tried = self.proposer = self.seen = self.acked = self.published = self.noticed = False
        self.proposed_at = 0.0
        self.dead_checks = -1
