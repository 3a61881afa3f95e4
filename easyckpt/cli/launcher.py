"""``easyckpt run [--max-restarts N] [--backoff S] -- <training command>``

Runs the command (typically ``torchrun ...``) until it succeeds. Each attempt resumes from the newest
state through ``load_checkpoint``: from memory when the node agent still holds a snapshot at least as
new as storage (a crash of the trainers leaves the agent and its snapshots alive), else from storage.

An attempt ends in one of three ways:
  success      exit status 0 and no SIGTERM checkpoint in this attempt: done.
  preemption   the trainers saved on SIGTERM and exited (``exit_after_ondemand_checkpoint``): restarted
               at once and not counted against --max-restarts, unless the launcher itself got the
               signal (the machine is going away): then it stops, with status 0.
  crash        anything else: restarted after S, 2S, 4S, ... seconds (at most 300), at most N times.
The launcher forwards SIGTERM/SIGINT/SIGHUP to the command's process group, and prints a summary: per
attempt, how it ended, the iteration it resumed from (memory or storage, and how long the load took),
the last iteration reached and how many iterations the failure cost.

torchrun --max-restarts restarts only its worker group, within one torchrun, on any failure alike, with
no backoff. ``easyckpt run`` wraps the whole launch (torchrun included, so a crashed or killed torchrun
is restarted too), tells preemptions from crashes and reports lost iterations. Use one of the two: with
both, one crash is retried by torchrun first.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional

from easyckpt.engine.link import runlog

MAX_BACKOFF = 300.0


@dataclass
class Attempt:
    number: int
    returncode: int
    kind: str                        # success | preemption | crash | stopped
    resumed_from: Optional[int]
    source: Optional[str]            # memory | storage | none
    load_seconds: Optional[float]
    reached: Optional[int]
    lost: Optional[int] = None       # iterations of this attempt the next one had to redo


class Launcher:
    def __init__(self, cmd: List[str], max_restarts: int, backoff: float, out=sys.stderr):
        self.cmd, self.max_restarts, self.backoff, self.out = cmd, max_restarts, backoff, out
        self.attempts: List[Attempt] = []
        self.child: Optional[subprocess.Popen] = None
        self.signalled: Optional[int] = None

    def _forward(self, signum: int, frame) -> None:
        self.signalled = signum
        if self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        run_dir = tempfile.mkdtemp(prefix="easyckpt-run-")
        crashes = 0
        try:
            while True:
                attempt = self._attempt(run_dir, len(self.attempts) + 1)
                if self.attempts:
                    prev = self.attempts[-1]
                    if prev.reached is not None and attempt.resumed_from is not None:
                        prev.lost = max(0, prev.reached - attempt.resumed_from)
                self.attempts.append(attempt)
                if attempt.kind == "success":
                    return 0
                if self.signalled is not None:
                    attempt.kind = "stopped" if attempt.kind != "preemption" else "preemption"
                    self._say(f"got signal {self.signalled}: not restarting")
                    return 0 if attempt.kind == "preemption" else attempt.returncode or 1
                if attempt.kind == "preemption":
                    self._say(f"attempt {attempt.number}: saved on SIGTERM at iteration {attempt.reached}; "
                              f"restarting")
                    continue
                crashes += 1
                if crashes > self.max_restarts:
                    self._say(f"attempt {attempt.number} failed (exit {attempt.returncode}); "
                              f"--max-restarts {self.max_restarts} used up: giving up")
                    return attempt.returncode or 1
                wait = min(MAX_BACKOFF, self.backoff * 2 ** (crashes - 1))
                self._say(f"attempt {attempt.number} failed (exit {attempt.returncode}); restart {crashes} of "
                          f"{self.max_restarts} in {wait:g}s")
                self._sleep(wait)
                if self.signalled is not None:
                    return attempt.returncode or 1
        finally:
            self._summary()
            shutil.rmtree(run_dir, ignore_errors=True)
            for s, h in previous.items():
                signal.signal(s, h)

    def _attempt(self, run_dir: str, number: int) -> Attempt:
        for name in os.listdir(run_dir):
            if name.startswith("progress."):
                os.unlink(os.path.join(run_dir, name))
        env = dict(os.environ, **{runlog.ENV_DIR: run_dir, runlog.ENV_ATTEMPT: str(number)})
        self._say(f"attempt {number}: {' '.join(self.cmd)}")
        self.child = subprocess.Popen(self.cmd, env=env, start_new_session=True)
        while True:
            try:
                rc = self.child.wait()
                break
            except InterruptedError:   # pragma: no cover - PEP 475 retries, kept for clarity
                continue
        self.child = None
        mine = [e for e in runlog.events(run_dir) if e.get("attempt") == number]
        resume = next((e for e in mine if e["event"] == "resume"), None)
        preempted = any(e["event"] == "sigterm_save" and e.get("exit") for e in mine)
        kind = "success" if rc == 0 and not preempted else "preemption" if preempted else "crash"
        return Attempt(number, rc, kind, resume["step"] if resume else None, resume["source"] if resume else None,
                       resume["seconds"] if resume else None, runlog.last_progress(run_dir))

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.signalled is None and time.monotonic() < end:
            time.sleep(min(0.1, end - time.monotonic()))

    def _say(self, text: str) -> None:
        print(f"easyckpt run: {text}", file=self.out, flush=True)

    def _summary(self) -> None:
        restarts = len(self.attempts) - 1
        lines = [f"easyckpt run: {len(self.attempts)} attempt(s), {restarts} restart(s)",
                 f"{'attempt':>7}  {'ended':<10} {'exit':>5}  {'resumed from':<26} {'reached':>8} {'lost':>5}"]
        for a in self.attempts:
            src = "-" if a.resumed_from is None else (
                f"{a.resumed_from} ({a.source}, {a.load_seconds:.3f}s)" if a.source != "none" else "scratch")
            lines.append(f"{a.number:>7}  {a.kind:<10} {a.returncode:>5}  {src:<26} "
                         f"{'-' if a.reached is None else a.reached:>8} {'-' if a.lost is None else a.lost:>5}")
        print("\n".join(lines), file=self.out, flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a training command until it succeeds, resuming after each failure",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-restarts", type=int, default=3, help="crashes to restart after (default 3)")
    p.add_argument("--backoff", type=float, default=10.0, help="seconds before the first restart, doubling")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    p.set_defaults(fn=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        print("easyckpt run: no command; usage: easyckpt run [--max-restarts N] [--backoff S] -- torchrun ...",
              file=sys.stderr)
        return 2
    if args.max_restarts < 0 or args.backoff < 0:
        print("easyckpt run: --max-restarts and --backoff must not be negative", file=sys.stderr)
        return 2
    return Launcher(cmd, args.max_restarts, args.backoff).run()
