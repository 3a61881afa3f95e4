"""The warm launcher of the tests (tests/warm_torchrun.py, tests/forked_worker.py) and their fork server
(tests/zygote.py): the processes they start begin as exec'd ones do, so a test run through them proves what it
would prove under torchrun, or ``python SCRIPT``, as users run it. Each process reports what an exec'd one has:
the default SIGTERM/SIGHUP/SIGQUIT dispositions and Python's SIGINT handler, no parent-death signal, its script as
``__main__`` with its directory first on ``sys.path``, its own environment and working directory; its exit
handlers run at its end; an exit status, or the signal that ended it, reaches the test."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import harness
import pytest
import zygote
from harness import kill_tree, run, script_cmd, start, worker_pids

# what an exec'd process has, as each probe reports it
SEEN = textwrap.dedent("""
    import atexit, ctypes, json, os, signal, sys
    out = sys.argv[1]
    libc, death = ctypes.CDLL(None), ctypes.c_int(-1)
    libc.prctl(2, ctypes.byref(death), 0, 0, 0)              # PR_GET_PDEATHSIG
    seen = {"term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "hup": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
            "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "death": death.value, "main": __name__, "path0": sys.path[0], "argv": sys.argv[1:],
            "comm": open(f"/proc/{os.getpid()}/comm").read().strip()}
""")

PROBE = SEEN + textwrap.dedent("""
    rank = int(os.environ["RANK"])
    seen.update(quit=signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL, world=os.environ["WORLD_SIZE"])
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


SINGLE = SEEN + textwrap.dedent("""
    seen.update(chld=signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL, cwd=os.getcwd(),
                mine=os.environ.get("EASYCKPT_PROBE"), sid=os.getsid(0) == os.getpid(), torch="torch" in sys.modules,
                easyckpt=any(m.startswith("easyckpt") for m in sys.modules))
    atexit.register(lambda: open(out + ".exit", "w").write("ran"))
    json.dump(seen, open(out, "w"))
    print("to stdout"); print("to stderr", file=sys.stderr)
    if len(sys.argv) > 2:
        if sys.argv[2] == "sleep":
            import time; time.sleep(120)
        sys.exit(int(sys.argv[2]))
""")


def _single(tmp_path, *args):
    probe = tmp_path / "single.py"
    probe.write_text(SINGLE)
    return [sys.executable, str(probe), str(tmp_path / "seen"), *args]


def test_a_forked_process_starts_and_ends_as_an_execd_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = zygote.run(_single(tmp_path), ["torch"], harness.env({"EASYCKPT_PROBE": "set"}), timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "to stdout\n", "to stderr\n"), proc
    seen = json.loads((tmp_path / "seen").read_text())
    assert seen == {"term": True, "hup": True, "chld": True, "int": True, "death": 0, "main": "__main__",
                    "path0": str(tmp_path), "argv": [str(tmp_path / "seen")], "cwd": str(tmp_path), "mine": "set",
                    "sid": False, "comm": "trainer", "torch": True, "easyckpt": False}, seen
    assert (tmp_path / "seen.exit").read_text() == "ran", "the exit handlers did not run"


def test_a_forked_processs_exit_status_signal_and_timeout_reach_the_test(tmp_path):
    assert zygote.run(_single(tmp_path, "3"), ["torch"], harness.env(), timeout=60).returncode == 3
    assert (tmp_path / "seen.exit").read_text() == "ran"
    log = tmp_path / "log"
    with open(log, "w") as out, open(os.devnull, "rb") as null:
        proc = zygote.popen(_single(tmp_path, "sleep"), ["torch"], harness.env(), null.fileno(), out.fileno(),
                            out.fileno(), session=True)
    deadline = time.monotonic() + 60
    while "to stderr" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads((tmp_path / "seen").read_text())["sid"], "start()'s process is not in a session of its own"
    assert proc.poll() is None and worker_pids(proc, 1) == {0: proc.pid}
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(_single(tmp_path, "sleep"), ["torch"], harness.env(), timeout=2)
    assert time.monotonic() - started < 60, "the timed-out process was not killed"


def test_the_tests_launches_go_to_a_fork_server_only_where_it_starts_them_as_exec_would(tmp_path):
    train = harness.train_cmd(tmp_path, 1, "--iters", "2")
    assert harness.forkable(train) == ["torch"]
    assert harness.forkable(harness.train_cmd(tmp_path, 2)) == ["torch", "torch.distributed.run"]
    assert harness.forkable(train, {"EASYCKPT_FAULTS": "x"}) == ["torch"]
    assert harness.forkable(train, {"HF_HUB_OFFLINE": "1"}) is None        # read by a module the server imports
    assert harness.forkable(harness.train_cmd(tmp_path, 2, warm=False)) is None     # torchrun as users run it
    assert harness.forkable(harness.users_train_cmd(tmp_path, 1)) is None           # python SCRIPT, exec'd
    assert harness.forkable([sys.executable, "-c", "pass"]) is None


def test_a_fork_server_ends_and_leaves_nothing_when_its_pytest_worker_dies(tmp_path):
    starter = tmp_path / "starter.py"
    starter.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(harness.ROOT / "tests")!r})
        import zygote
        path = zygote._server(["json"], dict(os.environ))
        print(zygote._SERVERS[("json",)][0].pid, path, flush=True)
        os._exit(0)         # as a killed worker: no exit handler stops the server
    """))
    out = subprocess.run([sys.executable, str(starter)], env=harness.env(), capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    pid, path = int(out[0]), out[1]
    deadline = time.monotonic() + 30
    while (harness.alive(pid) or os.path.exists(os.path.dirname(path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not harness.alive(pid), "the fork server outlived the process that started it"
    assert not os.path.exists(os.path.dirname(path)), "the fork server left its directory behind"


def _raw(path, body):
    """A request as zygote.popen sends it, with ``body`` as the JSON: the server's first line back, or ''."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, open(os.devnull, "rb") as null:
        conn.settimeout(60)
        conn.connect(path)
        socket.send_fds(conn, [zygote._HEADER.pack(len(body))], [null.fileno()] * 3)
        conn.sendall(body)
        got = b""
        while not got.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                break
            got += chunk
        return got.decode().strip(), conn.recv(64).decode().strip() if got else ""


def test_a_fork_server_refuses_a_bad_request_and_a_child_that_cannot_start_exits_127(tmp_path):
    path = zygote._server(["torch"], harness.env())
    good = {"argv": _single(tmp_path), "env": harness.env(), "cwd": str(tmp_path), "session": False}
    for bad in (b"not json", json.dumps({**good, "argv": [sys.executable, "-c", "pass"]}).encode(),
                json.dumps({**good, "env": {"A": 1}}).encode(), json.dumps({**good, "cwd": "relative"}).encode()):
        assert _raw(path, bad) == ("", ""), bad           # closed without a pid: nothing forked
    pid, status = _raw(path, json.dumps({**good, "cwd": str(tmp_path / "gone")}).encode())
    assert int(pid) > 0 and status == "127", (pid, status)      # the child said why and exited, never served
    assert zygote.run(_single(tmp_path), ["torch"], harness.env(), timeout=60).returncode == 0


def test_a_run_past_its_timeout_fails_with_every_process_stack_and_leaves_no_shared_memory(tmp_path):
    """A test's process that hangs is killed at its timeout, and CI keeps only pytest's output: the failure
    says where each process waited (tests/hangs.py). Two ranks sleep in their third step; their node agent (a
    process of its own session) reports too, in its log; and the slots it can no longer release are unlinked
    (the shm_clean fixture checks /dev/shm)."""
    loss = tmp_path / "loss"
    cmd = harness.train_cmd(tmp_path / "ckpt", 2, "--iters", "4", "--loss-file", str(loss), "--step-sleep", "600")
    assert harness.forkable(cmd) is not None
    with pytest.raises(AssertionError) as failed:
        run(cmd, timeout=45)
    said = str(failed.value)
    assert "did not end within 45s" in said
    started = tmp_path / "loss.rank0"
    if started.exists() and "# start" in started.read_text():   # it had loaded, through its agent: asked too
        assert "easyckpt/agent/agent.py\", line" in said, said[-3000:]
    assert said.count("examples/pytorch/train.py\", line") >= 2, said[-3000:]      # both ranks' stacks


def test_an_execd_run_past_its_timeout_fails_with_its_stacks(tmp_path):
    """The same for a command the fork server does not start (harness._exec_run)."""
    script = tmp_path / "hang.py"
    script.write_text("import threading, time\n"
                      "threading.Thread(target=time.sleep, args=(600,), name='waiter').start()\n"
                      "def waits_here():\n    time.sleep(600)\nwaits_here()\n")
    cmd = [sys.executable, str(script)]
    assert harness.forkable(cmd) is None
    with pytest.raises(AssertionError) as failed:
        run(cmd, timeout=5)
    assert "line 4 in waits_here" in str(failed.value), str(failed.value)
