"""Runs that take turns on the machine (bench_overhead.py ``--interleave``): each process tree in turn runs for a
few seconds while the others are stopped (SIGSTOP to a process and every process under it, SIGCONT at its turn),
and the windows of time each ran are kept, so that each run's step time counts only its own."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Dict, List, Tuple


def descendants(pid: int) -> List[int]:
    """``pid`` and every process under it (easyckpt's agent runs in a session of its own, but is its child)."""
    children: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def signal_tree(pid: int, sig: int) -> None:
    for p in descendants(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass



def take_turns(procs: List[subprocess.Popen], turn: float, timeout: float, what: str) -> List[List[Tuple[float, float]]]:
    """Let ``procs`` (all started, all but the first stopped) run ``turn`` seconds each in turn until every one
    ended; the (start, end) windows each ran. Kills what still runs after ``timeout`` seconds, or on an error."""
    windows: List[List[Tuple[float, float]]] = [[] for _ in procs]
    deadline = time.monotonic() + timeout
    current, opened = 0, time.perf_counter()
    try:
        while True:
            end = time.perf_counter() + turn
            while procs[current].poll() is None and time.perf_counter() < end:
                time.sleep(0.005)
            alive = [i for i, p in enumerate(procs) if p.poll() is None]
            if procs[current].poll() is None and len(alive) > 1:
                signal_tree(procs[current].pid, signal.SIGSTOP)
            windows[current].append((opened, time.perf_counter()))
            if not alive:
                return windows
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: still running after {timeout:g} s")
            current = next((i for i in alive if i > current), alive[0])
            opened = time.perf_counter()
            signal_tree(procs[current].pid, signal.SIGCONT)
    finally:
        for p in procs:
            if p.poll() is None:
                signal_tree(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
