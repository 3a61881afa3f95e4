"""Waits that must end and resources another user must not exhaust (docs/reliability.md rows 35-40): a FIFO,
a device or a symlink planted in /dev/shm or the save dir, a stopped agent, a flood of refused connections.
Each test drives the real trainer (tests/worker_pytorch.py), the real agent and the real `easyckpt` command
in processes. The planted files come from a second local user (`nobody`) where the item is about one, which
needs root (CI runs as root); those tests skip elsewhere, saying why.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import (
    TIMEOUT,
    cli,
    committed_steps,
    events,
    job_id,
    kill_tree,
    last_iteration,
    start,
    train_cmd,
    wait_for_iteration,
    wait_no_agent,
)
from inproc import run_worker
from test_trust import AS_ROOT, HOLDER, _agent_pid, _finish_holder, _holder

from easyckpt.ipc import shm

QUICK = 60      # seconds: a refusal must come this fast, far below any timeout of the job's


def _as_nobody(*cmd: str) -> None:
    subprocess.run(["runuser", "-u", "nobody", "--", *cmd], check=True, timeout=30)


def _planted_fifo(path: str) -> None:
    _as_nobody("mkfifo", "-m", "0666", path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@AS_ROOT
def test_a_fifo_planted_under_a_replica_slot_name_never_blocks_the_agent(tmp_path):
    """Row 35: `nobody` plants a FIFO under a replica slot's name of the job before it starts: the agent's
    status (which lists replicas) opens it without blocking, names it with its owner, and the job trains and
    commits as usual (before: the agent blocked in open(), and every trainer with it)."""
    save = tmp_path / "ckpt"
    fifo = shm.replica_path(job_id(save), 0, 0)
    _planted_fifo(fifo)
    try:
        run_worker(train_cmd(save, 2, "--iters", "10", "--storage-interval", "5", "--commit-timeout", "60",
                      "--idle-timeout", "2"), timeout=TIMEOUT)
        wait_no_agent(save)
    finally:
        _remove(fifo)
    assert committed_steps(save) == [5, 10]
    said = [e["message"] for e in events(save / "easyckpt.log") if "FIFO" in e.get("message", "")]
    assert said and fifo in said[0] and "nobody" in said[0], said


@AS_ROOT
@pytest.mark.parametrize("what", ["key", "slot"])
def test_a_fifo_planted_as_the_key_or_a_slot_stops_the_job_at_once_naming_it(tmp_path, what):
    """Row 36: a FIFO of `nobody` as the job's key file or as rank 0's first slot: every rank stops within
    seconds with a message naming the file, what it is and its owner (before: open() blocked for ever on
    rank 0, and rank 1 failed after 60 s pointing at an agent log that did not exist)."""
    save = tmp_path / "ckpt"
    job = job_id(save)
    fifo = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{job}-key") if what == "key" else shm.slot_path(job, 0, 0)
    _planted_fifo(fifo)
    t0 = time.monotonic()
    try:
        out = run_worker(train_cmd(save, 2, "--iters", "5", "--idle-timeout", "2"), timeout=QUICK, check=False)
    finally:
        _remove(fifo)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and time.monotonic() - t0 < QUICK
    assert f"refusing {fifo}: it is a FIFO (named pipe) owned by uid 65534 (nobody)" in text, text[-3000:]
    wait_no_agent(save)
    # the key rank 1 made before the job stopped (no agent was started to remove it; the next start of any job
    # of this user reaps it as a dead job's)
    _remove(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{job}-key"))


def test_a_stopped_agent_costs_training_only_skipped_persists(tmp_path):
    """Row 37: the agent is stopped (SIGSTOP) for 8 s mid-run: training goes on at its own pace meanwhile
    (at least half the iterations per second it made before; before: every trainer froze until SIGCONT),
    the console says the agent is stopped, and after SIGCONT the job commits its last step."""
    save, loss = tmp_path / "ckpt", tmp_path / "loss"
    proc = start(train_cmd(save, 1, "--iters", "100000", "--storage-interval", "5", "--step-sleep", "0.05",
                           "--loss-file", str(loss)), log=tmp_path / "out")
    agent = None
    try:
        wait_for_iteration(loss, 20, proc)
        t0, i0 = time.monotonic(), last_iteration(loss)
        time.sleep(4)
        before = (last_iteration(loss) - i0) / (time.monotonic() - t0)
        agent = _agent_pid(save)
        os.kill(agent, signal.SIGSTOP)
        t0, i0 = time.monotonic(), last_iteration(loss)
        time.sleep(8)
        stopped = (last_iteration(loss) - i0) / (time.monotonic() - t0)
        os.kill(agent, signal.SIGCONT)
        agent = None
        assert stopped >= 0.5 * before, f"{stopped:.1f} it/s with the agent stopped, {before:.1f} it/s before"
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)          # the agreed step is saved and committed: the agent serves again
        assert proc.wait(timeout=TIMEOUT) == 0, (tmp_path / "out").read_text()[-3000:]
    finally:
        if agent is not None:
            os.kill(agent, signal.SIGCONT)
        if proc.poll() is None:
            kill_tree(proc)
    wait_no_agent(save)
    text = (tmp_path / "out").read_text()
    assert "(it is stopped: SIGSTOP or a debugger)" in text, text[-3000:]
    assert committed_steps(save)[-1] >= last_iteration(loss) - 1, "the SIGTERM step was not committed"


def _committed_job(tmp_path: Path) -> Path:
    save = tmp_path / "ckpt"
    run_worker(train_cmd(save, 1, "--iters", "10", "--storage-interval", "5", "--idle-timeout", "1"), timeout=TIMEOUT)
    wait_no_agent(save)
    return save


@pytest.mark.parametrize("planted", ["manifest", "listed file"])
def test_a_fifo_in_a_step_blocks_neither_the_tools_nor_the_loader(tmp_path, planted):
    """Row 38: step 10's manifest, or a file it lists, is replaced by a FIFO: `easyckpt ls`, `verify` and
    `inspect` finish at once naming it, and the job resumes step 5 (before: each blocked in open())."""
    save = _committed_job(tmp_path)
    target = save / "step_00000010" / ("easyckpt_manifest.json" if planted == "manifest" else "model.safetensors")
    target.unlink()
    os.mkfifo(target)
    assert "FIFO" in cli("verify", save, expect=1, timeout=QUICK).stdout
    cli("ls", save, timeout=QUICK)
    cli("inspect", save, "10", expect=None, timeout=QUICK)
    loss = tmp_path / "loss"
    out = run_worker(train_cmd(save, 1, "--iters", "12", "--storage-interval", "5", "--idle-timeout", "1",
                        "--loss-file", str(loss)), timeout=TIMEOUT)
    wait_no_agent(save)
    assert "resumed step 5" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]


def test_a_device_or_a_link_to_the_root_in_the_save_dir_is_never_read_or_walked(tmp_path):
    """Row 38: checkpoint-5/trainer_state.json is a link to /dev/zero and checkpoint-9 a link to /: `easyckpt
    ls` finishes within seconds and lists neither as a checkpoint (before: it read /dev/zero without end, or
    walked the whole disk)."""
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "trainer_state.json").symlink_to("/dev/zero")
    (out / "checkpoint-7").mkdir()
    (out / "checkpoint-7" / "trainer_state.json").write_text('{"global_step": 7}')
    (out / "checkpoint-9").symlink_to("/")
    listing = cli("ls", out, "--json", timeout=QUICK)
    rows = {r["step"]: r for r in json.loads(listing.stdout)["checkpoints"]}
    assert 9 not in rows and rows[7]["state"] == "plain" and rows[5]["state"] != "plain", rows


REFUSE_LOOP = textwrap.dedent("""
    import socket, sys
    for _ in range(int(sys.argv[2])):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect("\\0" + sys.argv[1])
            s.recv(1)
        except OSError:
            pass
        finally:
            s.close()
""")


@AS_ROOT
def test_refused_connections_are_counted_not_logged_one_line_each(tmp_path):
    """Row 39: `nobody` connects to the agent 1500 times: the audit log holds a few lines for them (the first
    ones whole, then one summary with the count), not 1500 (before: one line each, as root, in the save dir:
    a loop filled a small save dir and every later step failed with ENOSPC)."""
    proc, save, go, out = _holder(tmp_path)
    try:
        res = subprocess.run(["runuser", "-u", "nobody", "--", "python3", "-c", REFUSE_LOOP,
                              f"easyckpt-agent-{job_id(save)}", "1500"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    finally:
        _finish_holder(proc, save, go, out)
    refused = [e for e in events(save / "easyckpt.log") if e["event"] == "refused"]
    assert len(refused) <= 15, len(refused)
    assert sum(e.get("count", 1) for e in refused) == 1500
    assert all("uid 65534" in e["message"] for e in refused)


@AS_ROOT
def test_a_staging_dir_planted_mid_run_is_refused_and_no_committed_step_belongs_to_another_user(shared_dir):
    """Row 40: in a shared sticky save dir, `nobody` creates the staging directories of steps 10 and 15 mid-run
    (mode 0777): those two steps fail at once, named with the owner, later steps commit, and no committed
    step is owned by `nobody` (before: the agent reused the planted directories and committed them, so `nobody`
    could rewrite a file and re-seal the manifest). A step re-owned after its commit is refused by the loader."""
    save, loss = shared_dir, shared_dir.parent / "loss"
    job = job_id(save)
    proc = start(train_cmd(save, 1, "--iters", "25", "--storage-interval", "5", "--step-sleep", "0.1",
                           "--loss-file", str(loss)), log=save.parent / "out")
    try:
        wait_for_iteration(loss, 6, proc)
        for step in (10, 15):
            _as_nobody("mkdir", "-m", "0777", str(save / f".easyckpt-staging-{job}-step_{step:08d}"))
        assert proc.wait(timeout=TIMEOUT) == 0, (save.parent / "out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    wait_no_agent(save)
    steps = committed_steps(save)
    assert 10 not in steps and 15 not in steps and 25 in steps, steps
    owners = {p.stat().st_uid for s in steps for p in [save / f"step_{s:08d}", *(save / f"step_{s:08d}").rglob("*")]}
    assert owners == {0}, owners
    log = events(save / "easyckpt.log")
    assert any("owned by uid 65534" in e.get("message", "") + e.get("error", "") for e in log), \
        [e for e in log if e["event"] in ("error", "persist_failed")]
    # a committed step re-owned by another user (as if re-sealed by it) is refused by the loader, not deleted
    newest = save / "step_00000025"
    subprocess.run(["chown", "-R", "nobody", str(newest)], check=True, timeout=30)
    out = run_worker(train_cmd(save, 1, "--iters", "26", "--storage-interval", "5", "--idle-timeout", "1",
                        "--loss-file", str(loss)), timeout=TIMEOUT)
    wait_no_agent(save)
    text = out.stdout + out.stderr
    assert "step 25" in text and "untrusted" in text and "resumed step 20" in text, text[-3000:]
    assert newest.exists()


# test_trust's holder, which opens the agent's peer port where it would say READY (as the trainers of a multi-node
# job open it, engine/link/peers.py) and prints it
PEER_HOLDER = HOLDER.replace('print("READY", flush=True)\n', textwrap.dedent("""
    from easyckpt.formats import protocol
    from easyckpt.formats.replies import ListenReply
    from easyckpt.pytorch import _default
    reply = _default.current.engine.client.request(protocol.Listen(addr="127.0.0.1"), ListenReply, 30)
    print("PORT", reply.port, flush=True)
"""))
assert PEER_HOLDER != HOLDER

GARBAGE_LOOP = textwrap.dedent("""
    import socket, sys
    for i in range(int(sys.argv[2])):
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
        try:
            s.sendall(b"garbage %06d " % i + b"z" * 300 + b"\\n")
            while s.recv(65536):
                pass
        except OSError:
            pass
        finally:
            s.close()
""")


def test_a_flood_of_garbage_on_the_agents_peer_port_adds_a_few_log_lines_not_one_each(tmp_path):
    """Issue 49 item 7b: 2000 connections to the real agent's peer port, each sending a different line of
    garbage: the audit log and the agent log gain a few lines (the first refusal of the kind, with at most
    16 escaped bytes of what was sent), not 2000, and both logs stay under their size cap (here 64 KiB)
    while the job still commits (before: one line each, in both logs, quoting 80 bytes of the sender's)."""
    script, save, go, out = tmp_path / "holder.py", tmp_path / "ckpt", tmp_path / "go", tmp_path / "holder.out"
    script.write_text(PEER_HOLDER)
    cap = 64 << 10
    proc = start([sys.executable, str(script), str(save), str(go)], log=out,
                 extra_env={"EASYCKPT_MAX_LOG_BYTES": str(cap)})
    n = 2000
    try:
        deadline = time.monotonic() + TIMEOUT
        while "PORT" not in (out.read_text() if out.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.05)
        port = out.read_text().split("PORT", 1)[1].split()[0]
        agent_log = next(save.glob(".easyckpt-agent-*.log"))
        before = agent_log.stat().st_size
        res = subprocess.run([sys.executable, "-c", GARBAGE_LOOP, port, str(n)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        grown = agent_log.stat().st_size - before
    finally:
        _finish_holder(proc, save, go, out)
    said = [m for m in (e.get("message", "") for e in events(save / "easyckpt.log"))
            if "refused" in m and "replica" in m]
    assert 1 <= len(said) <= 5, (len(said), said[:3])
    assert "not JSON: b'garbage 000000 z'…" in said[0] and all(len(m) < 300 for m in said), said
    assert grown < 2000, f"the agent log grew by {grown} bytes for {n} refused connections"
    assert agent_log.read_text().count("not JSON") <= 5
    for log in (save / "easyckpt.log", agent_log):
        assert log.stat().st_size <= cap + 4096, (log, log.stat().st_size)
