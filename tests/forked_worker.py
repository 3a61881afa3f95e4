"""One worker of tests/warm_torchrun.py: ``forked_worker.py SCRIPT ARGS...``, run by torchrun's ``--run-path``
in a process forked from the launcher. It undoes what the fork carried over, so that SCRIPT starts as in a
worker torchrun execs, then runs SCRIPT as ``__main__``:

- torch's multiprocessing asks for SIGINT when the launcher dies: an exec'd worker has no such signal (a
  killed launcher's ranks train on);
- the launcher's signal handlers (torchrun's own, for SIGTERM, SIGINT, SIGHUP, SIGQUIT): the defaults;
- the launcher's exit handlers: cleared; the script's own run at its end, after its non-daemon threads
  ended, as at an interpreter's exit (multiprocessing ends a forked child without them);
- ``sys.path[0]``: the script's directory;
- the process name (``/proc/PID/comm``) says ``rankN``: the environment a process started with
  (``/proc/PID/environ``) is the launcher's, so harness.worker_pids finds a rank's pid by this name.

An exit status of 0 (``sys.exit(0)``, easyckpt's exit after a SIGTERM save) returns normally: torchrun's
forked workers report their end through a queue, and one that exits without it leaves the launcher waiting.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


def _as_if_exec() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(f"rank{os.environ.get('RANK', '0')}".encode()[:15]), 0, 0, 0)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()


def main() -> None:
    _as_if_exec()
    spec = importlib.util.spec_from_file_location("zygote", os.path.join(os.path.dirname(__file__), "zygote.py"))
    assert spec is not None and spec.loader is not None
    zygote = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zygote)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    code = zygote.run_as_main(script)
    if code:
        raise SystemExit(code)          # multiprocessing's end of the child: the status torchrun reports


main()
