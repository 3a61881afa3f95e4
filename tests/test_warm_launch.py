"""The warm launcher of the tests (tests/warm_torchrun.py, tests/forked_worker.py): its workers start as the
workers torchrun execs do, so a test run through it proves what it would prove under torchrun as users run
it. Each worker reports what an exec'd worker has: the default SIGTERM/SIGHUP/SIGQUIT dispositions and
Python's SIGINT handler, no parent-death signal, its script as ``__main__`` with its directory first on
``sys.path``, torchrun's environment; its exit handlers run at its end; an exit status reaches torchrun."""
from __future__ import annotations

import json
import textwrap

from harness import kill_tree, run, script_cmd, start, worker_pids

PROBE = textwrap.dedent("""
    import atexit, ctypes, json, os, signal, sys
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    libc, death = ctypes.CDLL(None), ctypes.c_int(-1)
    libc.prctl(2, ctypes.byref(death), 0, 0, 0)              # PR_GET_PDEATHSIG
    seen = {"term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "hup": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
            "quit": signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL,
            "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "death": death.value, "main": __name__, "path0": sys.path[0], "argv": sys.argv[1:],
            "world": os.environ["WORLD_SIZE"], "comm": open(f"/proc/{os.getpid()}/comm").read().strip()}
    atexit.register(lambda: open(f"{out}.exit{rank}", "w").write("ran"))
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(seen, f)
    if len(sys.argv) > 2 and rank == 1:
        sys.exit(int(sys.argv[2]))
""")


def test_a_warm_launched_worker_starts_and_ends_as_an_execd_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "seen"
    cmd = script_cmd(probe, 2, str(out))
    assert "warm_torchrun.py" in cmd[1], cmd
    run(cmd, timeout=120)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen.rank{rank}").read_text())
        assert seen == {"term": True, "hup": True, "quit": True, "int": True, "death": 0, "main": "__main__",
                        "path0": str(tmp_path), "argv": [str(out)], "world": "2", "comm": f"rank{rank}"}, seen
        assert (tmp_path / f"seen.exit{rank}").read_text() == "ran", f"rank {rank}'s exit handlers did not run"


def test_a_warm_launched_workers_exit_status_fails_the_launch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = run(script_cmd(probe, 2, str(tmp_path / "seen"), "3"), timeout=120, check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "exitcode" in proc.stderr and ": 3" in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "seen.exit1").read_text() == "ran", "the failing rank's exit handlers did not run"


def test_worker_pids_finds_each_warm_launched_rank_by_its_name(tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    proc = start(script_cmd(sleeper, 2), log=tmp_path / "log")
    try:
        pids = worker_pids(proc, 2, timeout=60)
        assert sorted(pids) == [0, 1] and proc.pid not in pids.values(), pids
        for rank, pid in pids.items():
            assert open(f"/proc/{pid}/comm").read().strip() == f"rank{rank}"
    finally:
        kill_tree(proc)
