"""What a test's processes were doing when one ran past its timeout, for the failure's message: CI keeps only
pytest's output, and a process killed silently says nothing of where it waited.

harness.env sets PYTHONFAULTHANDLER=1, so every Python process the tests start (the fork servers' children
inherit it from the server) writes the stacks of all its threads to its stderr on SIGABRT. On a timeout the
harness sends SIGABRT to the process tree and to the node agents its command names (those write to their
log in the save dir), reads on for a moment, kills what is left, and unlinks the shared memory the aborted
processes had mapped.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Sequence, Set

SHM = os.environ.get("EASYCKPT_SHM_DIR", "/dev/shm")     # as harness.SHM


def _parents() -> Dict[int, int]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    found[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return found


def descendants(pid: int) -> List[int]:
    """``pid`` and every process under it."""
    parents = _parents()
    tree, i = [pid], 0
    while i < len(tree):
        tree += [p for p, pp in parents.items() if pp == tree[i] and p not in tree]
        i += 1
    return tree


def agents_naming(names: Sequence[str]) -> List[int]:
    """The node agents whose command line (their configuration, JSON) holds any of ``names``."""
    wanted = [json.dumps(n)[1:-1].encode() for n in names]
    pids = []
    for entry in os.listdir("/proc"):
        try:
            line = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
        except OSError:
            continue
        if b"easyckpt.agent" in line and any(w in line for w in wanted):
            pids.append(int(entry))
    return pids


def _agents_named(cmd: Sequence[str]) -> List[int]:
    # the paths of ``cmd`` that are not files (its save dir): the interpreter's path is in every agent's
    # command line, and would name the agents of every other test running beside this one
    return agents_naming([a for a in map(str, cmd) if a.startswith("/") and not os.path.isfile(a)])


class Aborted:
    """``abort(pid)``: SIGABRT to ``pid``'s tree and to the agents ``cmd`` names, each writing its threads'
    stacks; ``clean()`` afterwards: wait (bounded) for them to end and unlink the easyckpt shared memory they
    had mapped, which an aborted agent no longer releases (a test leaves /dev/shm as it found it)."""

    def __init__(self, cmd: Sequence[str], job_ids: Sequence[str] = ()) -> None:
        self.cmd = cmd
        self.job_ids = job_ids      # the jobs whose segments go too: mapped or not yet when it was aborted
        self.pids: List[int] = []
        self.shm: Set[str] = set()

    def abort(self, pid: int) -> None:
        self.pids = list(dict.fromkeys(descendants(pid) + _agents_named(self.cmd)))
        for p in self.pids:
            try:
                with open(f"/proc/{p}/maps") as f:
                    self.shm |= {line.split(None, 5)[5].strip() for line in f
                                 if line.count(" ") >= 5 and f" {SHM}/easyckpt-" in line}
            except OSError:
                pass
        # one at a time, the launcher last: stacks written at once to one pipe would interleave
        for p in reversed(self.pids):
            _abort(p, wait=1.0)

    def clean(self, timeout: float = 10.0) -> None:
        # an agent a rank was starting as it was aborted: asked for its stacks too, then its segments go
        late = [p for p in _agents_named(self.cmd) if p not in self.pids]
        for p in late:
            _abort(p, wait=1.0)
        self.pids += late
        deadline = time.monotonic() + timeout
        while any(Path(f"/proc/{p}").exists() and _state(p) not in "ZX" for p in self.pids) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        # a job's key segment is read once, not mapped: it goes with the slots
        jobs = {path.rsplit("-", 2)[0] for path in self.shm if path.count("-") >= 3}
        jobs |= {f"{SHM}/easyckpt-{jid}" for jid in self.job_ids}
        for path in self.shm | {f"{SHM}/{n}" for n in os.listdir(SHM) for job in jobs
                                if f"{SHM}/{n}".startswith(f"{job}-")}:
            try:
                os.unlink(path.removesuffix(" (deleted)"))
            except OSError:
                pass


def _abort(pid: int, wait: float) -> None:
    """SIGABRT to ``pid``, then up to ``wait`` seconds for it to end (a full pipe may hold its last words)."""
    try:
        os.kill(pid, signal.SIGABRT)
    except OSError:
        return
    deadline = time.monotonic() + wait
    while _state(pid) not in "ZX" and time.monotonic() < deadline:
        time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def agent_logs(cmd: Sequence[str], tail: int = 4000) -> str:
    """The tails of the agent logs in the save dir ``cmd`` names (``--save-dir DIR``)."""
    args = list(map(str, cmd))
    if "--save-dir" not in args[:-1]:
        return ""
    logs = sorted(Path(args[args.index("--save-dir") + 1]).glob(".easyckpt-agent-*.log"))
    return "".join(f"\n{log}:\n{log.read_text(errors='replace')[-tail:]}" for log in logs)
