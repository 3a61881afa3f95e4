"""A save dir other users can write into (a shared scratch directory, mode 1777, as on many clusters): nothing
another local user plants there makes the job delete, skip or quarantine its own steps, write into a file it
did not make, or run beside another job (docs/reliability.md promise 15, rows 52-57). Each test drives the real
trainer (tests/worker_pytorch.py) and the real agent; the planted files come from a second local user
(`nobody`), which needs root (CI runs as root): those tests skip elsewhere, saying why.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import List

import pytest
from harness import (
    TIMEOUT,
    cli,
    events,
    kill_tree,
    run,
    start,
    train_cmd,
    wait_for_iteration,
    wait_no_agent,
)
from inproc import run_worker
from test_trust import AS_ROOT

from easyckpt.formats.layout import NAMINGS

QUICK = 60      # seconds: a refusal comes this fast, far below any timeout of the job's
NAMING = NAMINGS["pytorch"]


def _as_nobody(*cmd: str, timeout: float = 30) -> None:
    subprocess.run(["runuser", "-u", "nobody", "--", *cmd], check=True, timeout=timeout)


def _steps(save: Path) -> List[int]:
    """The committed steps by easyckpt's own naming (harness.committed_steps globs, which a planted twin
    name such as "step_00000010\\n" would match)."""
    out = []
    for name in os.listdir(save):
        step = NAMING.parse(name)
        if step is not None and (save / name / "easyckpt_manifest.json").exists():
            out.append(step)
    return sorted(out)


def _job(save: Path, iters: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = run_worker(train_cmd(save, 1, "--iters", str(iters), "--storage-interval", "5", "--max-ckpt", "3",
                               "--idle-timeout", "1", "--commit-timeout", "60", *args), timeout=TIMEOUT, check=check)
    wait_no_agent(save)
    return out


@AS_ROOT
def test_a_damaged_record_planted_by_another_user_deletes_no_intact_step(shared_dir):
    """Row 52: `nobody` writes the damaged record naming the job's intact committed steps: the next commit
    keeps max_ckpt_num of them, the record is refused naming its owner and left as it is (before: every step
    it named was deleted as "damaged" right after the next commit, one step kept instead of three)."""
    save = shared_dir
    _job(save, 20)
    assert _steps(save) == [10, 15, 20]
    record = save / ".easyckpt-damaged.json"
    planted = json.dumps({f"step_{s:08d}": "bit rot (planted by nobody)" for s in (10, 15, 20)})
    _as_nobody("sh", "-c", f"umask 0; printf '%s' '{planted}' > {record}")
    out = _job(save, 25)
    assert _steps(save) == [15, 20, 25], _steps(save)
    assert record.read_text() == planted and record.stat().st_uid != 0
    deletes = [e for e in events(save / "easyckpt.log") if e["event"] == "delete" and "step_" in e.get("path", "")]
    assert [Path(e["path"]).name for e in deletes][-1:] == ["step_00000010"], deletes
    assert all("planted" not in e.get("reason", "") for e in deletes), deletes
    agent_log = save / f".easyckpt-agent-{socket.gethostname()}.log"     # an agent process's; in-process: out
    said = (agent_log.read_text() if agent_log.exists() else "") + out.stdout + out.stderr
    assert f"refusing {record}: it is owned by uid 65534 (nobody)" in said, said[-3000:]


@AS_ROOT
@pytest.mark.parametrize("how", ["finished", "dead"])
def test_a_strangers_listener_on_the_agents_address_does_not_keep_a_jobs_memory(how):
    """Row 66's probe: a leaving agent keeps a finished job's slots and key only for an agent of the job's own user;
    `nobody` listening on the job's abstract address (its id shows in /dev/shm's names) is none, and they go. So too
    when any easyckpt start reaps a dead job's memory (promise 6): before, any listener kept it there for ever."""
    from easyckpt.ipc import agentsocket, jobkey, reap, shm
    job = "0123456789ab"
    code = ("import socket, time; s = socket.socket(socket.AF_UNIX); "
            f"s.bind({agentsocket.address(job)!r}); s.listen(4); time.sleep(120)")
    holder = subprocess.Popen(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", code],
                              start_new_session=True)
    slot = shm.slot_path(job, 0, 0)
    said: List[str] = []

    class Log:
        def emit(self, event: str, **fields: object) -> None:
            said.append(event)
    try:
        deadline = time.monotonic() + 30
        while not agentsocket.agent_listening(job):
            assert time.monotonic() < deadline and holder.poll() is None, "nobody's listener did not start"
            time.sleep(0.05)
        dead = subprocess.Popen(["true"])
        dead.wait(timeout=30)
        # a slot's header naming its writer (pid at offset 60), a process that is gone
        Path(slot).write_bytes(struct.pack("<8sIIqQQQQIIqII", b"EZCKSLOT", 1, 2, 7, 1, 0, 0, 0, 0, 0, dead.pid, 0, 1)
                               + bytes(4096))
        jobkey.ensure(job)
        assert agentsocket.agent_listening(job) and not agentsocket.agent_listening(job, own=True)
        if how == "finished":
            reap.release_finished_job(job, Log())
            assert said == ["shm_release"]
        else:
            for path in (slot, jobkey.path(job)):
                os.utime(path, (1e9, 1e9))       # quiet for longer than reap.LEFTOVER_SECONDS
            reap.reap_dead_jobs(Log(), keep="feedfeedfeed")
            assert "shm_release" in said
        assert not os.path.exists(slot) and not os.path.exists(jobkey.path(job))
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        shm.unlink_quiet(slot)
        jobkey.remove(job)


@AS_ROOT
@pytest.mark.parametrize("name", ["easyckpt.log", "easyckpt-history.log",
                                  f".easyckpt-agent-{socket.gethostname()}.log"])
def test_a_log_planted_by_another_user_is_refused_at_start_never_appended_to(shared_dir, name):
    """Row 53: `nobody` plants the audit log or the agent's log (mode 0666) in the shared save dir before the
    job: the job stops at once naming the file and its owner, and writes nothing into it (before: the job
    appended its events to it, and `nobody` could then remove every "delete" line)."""
    save = shared_dir
    log = save / name
    _as_nobody("sh", "-c", f"umask 0; printf 'planted\\n' > {log}")
    t0 = time.monotonic()
    out = _job(save, 5, check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and time.monotonic() - t0 < QUICK
    assert f"refusing {log}: it is owned by uid 65534 (nobody) with mode -rw-rw-rw-" in text, text[-3000:]
    assert log.read_text() == "planted\n"
    assert _steps(save) == []


@AS_ROOT
def test_a_stranger_cannot_hold_the_jobs_lock_and_is_named_when_it_does(shared_dir):
    """Row 54: the job's lock file is 0600, so another local user cannot open it to flock it (before: 0644, and
    `nobody` holding it blocked the relaunch, which named the job itself as the holder). A lock file an earlier
    version left 0644 that `nobody` holds: the relaunch is refused naming nobody's process and command; a
    lock file `nobody` made is refused at start, naming its owner."""
    save = shared_dir
    lock = save / ".easyckpt.lock"
    _job(save, 5)
    assert lock.stat().st_mode & 0o777 == 0o600
    tried = subprocess.run(["runuser", "-u", "nobody", "--", "flock", "-x", "-n", str(lock), "-c", "true"],
                           capture_output=True, text=True, timeout=30)
    assert tried.returncode != 0 and "Permission denied" in tried.stderr, tried
    os.chmod(lock, 0o644)      # as easyckpt made it before
    holder = subprocess.Popen(["runuser", "-u", "nobody", "--", "flock", "-x", "-n", str(lock), "-c", "sleep 120"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while str(lock.stat().st_ino) not in Path("/proc/locks").read_text():
            assert holder.poll() is None and time.monotonic() < deadline, "nobody's flock did not take the lock"
            time.sleep(0.05)
        out = _job(save, 10, check=False)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    # runuser is reaped, but flock's child (the sleep) holding the lock's descriptor may not have exited yet: a
    # relaunch then found the lock still held by it (seen once in the default tier)
    deadline = time.monotonic() + 30
    while str(lock.stat().st_ino) in Path("/proc/locks").read_text():
        assert time.monotonic() < deadline, "nobody's flock was killed but still holds the lock after 30 s"
        time.sleep(0.05)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "user uid 65534 (nobody): 'flock -x -n" in text and "another program holds it" in text, text[-3000:]
    _job(save, 10)        # the stranger gone, the relaunch runs, and the lock is the job user's alone again
    assert _steps(save) == [5, 10] and lock.stat().st_mode & 0o777 == 0o600
    os.unlink(lock)
    _as_nobody("touch", str(lock))
    out = _job(save, 15, check=False)
    assert out.returncode != 0
    assert f"refusing {lock}: it is owned by uid 65534 (nobody)" in out.stdout + out.stderr
    assert _steps(save) == [5, 10]


@AS_ROOT
def test_planted_twin_and_future_step_names_never_outrank_the_jobs_own_steps(shared_dir):
    """Row 55: `nobody` plants copies of the job's step under names that only look like its steps
    ("step_00000010\\n", full-width digits) and as a far-future `step_99999990`, while the job's newest snapshot
    is in memory (its trainer killed): the relaunch, even with on_no_valid_checkpoint="start_fresh", resumes that
    snapshot from memory, passes over the twins (no step names) and the future step (another user's: untrusted),
    quarantines nothing and leaves the planted copies alone (before: the future step sent the resume to an older
    step in storage; the twins were taken for the job's steps, "untrusted", and a fresh start set the job's own
    intact steps aside)."""
    save = shared_dir
    loss = save.parent / "loss"
    proc = start(train_cmd(save, 1, "--iters", "100000", "--storage-interval", "5", "--step-sleep", "0.05",
                           "--idle-timeout", "30", "--loss-file", str(loss)), log=save.parent / "out")
    try:
        wait_for_iteration(loss, 17, proc)
        kill_tree(proc)         # the trainer only: its agent and the snapshot in memory outlive it
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    own = _steps(save)
    copied = save / f"step_{own[-1]:08d}"     # the newest: retention never takes it
    planted = [f"step_{own[-1]:08d}\n", "step_" + "".join(chr(0xFF10 + int(c)) for c in f"{own[-1]:08d}"),
               "step_99999990"]
    for name in planted:
        _as_nobody("cp", "-r", str(copied), str(save / name))
    # the future step's manifest says it is that step (a manifest is plain JSON: anyone can write one)
    manifest = save / "step_99999990" / "easyckpt_manifest.json"
    data = json.loads(manifest.read_text())
    data["step"] = 99999990
    _as_nobody("sh", "-c", f"printf '%s' '{json.dumps(data)}' > {manifest}")
    out = run(train_cmd(save, 1, "--iters", "30", "--storage-interval", "5", "--idle-timeout", "1",
                        "--start-fresh", "--loss-file", str(loss)), timeout=TIMEOUT, check=False)
    wait_no_agent(save)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    resumed = [line for line in text.splitlines() if "easyckpt: resumed step" in line]
    assert len(resumed) == 1 and "from memory" in resumed[0], text[-3000:]
    assert int(resumed[0].split("resumed step ")[1].split()[0]) >= own[-1], (resumed, own)
    assert 30 in _steps(save), _steps(save)
    assert all((save / name).is_dir() for name in planted), os.listdir(save)
    assert not [n for n in os.listdir(save) if n.startswith("quarantined-")], os.listdir(save)


@AS_ROOT
@pytest.mark.parametrize("name", ["latest", ".easyckpt.lock", "easyckpt.log", "easyckpt-history.log",
                                  f".easyckpt-agent-{socket.gethostname()}.log"])
def test_a_directory_where_a_file_belongs_is_refused_at_start_naming_it(shared_dir, name):
    """Row 56: `nobody` makes a directory under the tracker's, the lock's or a log's name: the job stops at
    once naming it, what it is and its owner (before: every commit was said failed and nothing pruned under a
    `latest` directory; two jobs ran at once beside a `.easyckpt.lock` directory; a log's gave a bare
    IsADirectoryError)."""
    save = shared_dir
    _as_nobody("mkdir", str(save / name))
    t0 = time.monotonic()
    out = _job(save, 5, check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and time.monotonic() - t0 < QUICK
    assert f"refusing {save / name}: it is a directory owned by uid 65534 (nobody)" in text, text[-3000:]
    assert _steps(save) == []


@AS_ROOT
def test_a_tracker_that_cannot_be_written_mid_run_fails_no_commit_and_retention_runs(shared_dir):
    """Row 56: the tracker replaced by `nobody`'s directory mid-run: every later step is still said committed
    (it is), retention keeps max_ckpt_num, and the job finishes (before: "was not committed: IsADirectoryError"
    for each, nothing pruned, finalize failed)."""
    save, loss = shared_dir, shared_dir.parent / "loss"
    proc = start(train_cmd(save, 1, "--iters", "30", "--storage-interval", "5", "--max-ckpt", "2",
                           "--step-sleep", "0.1", "--idle-timeout", "1", "--loss-file", str(loss)),
                 log=save.parent / "out")
    try:
        wait_for_iteration(loss, 7, proc)
        deadline = time.monotonic() + TIMEOUT
        while not (save / "latest").is_file():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        os.unlink(save / "latest")
        _as_nobody("mkdir", str(save / "latest"))
        assert proc.wait(timeout=TIMEOUT) == 0, (save.parent / "out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    wait_no_agent(save)
    assert _steps(save) == [25, 30], _steps(save)
    log = events(save / "easyckpt.log")
    assert not [e for e in log if "was not committed" in e.get("message", "")], log[-5:]
    assert [e for e in log if e["event"] == "warning" and "tracker" in e.get("message", "")]


@AS_ROOT
def test_a_save_dir_replaced_under_a_running_job_is_noticed_and_still_guarded(shared_dir):
    """Row 57: the save dir is moved away and made again under a running job: the agent notices within
    seconds, says so on rank 0's console, takes the job's lock in the new directory and writes its audit log
    there, so a second job started in it is refused and the first job's later commits and deletes are
    recorded where an operator reads them (before: the second job ran beside the first, and the first job's
    events went to the unlinked log)."""
    save = shared_dir
    old = save.parent / "ckpt.old"
    loss, out1 = save.parent / "loss", save.parent / "out1"
    proc = start(train_cmd(save, 1, "--iters", "100000", "--storage-interval", "5", "--step-sleep", "0.05",
                           "--max-ckpt", "2", "--idle-timeout", "1", "--loss-file", str(loss)), log=out1)
    try:
        wait_for_iteration(loss, 12, proc)
        os.rename(save, old)
        save.mkdir()
        os.chmod(save, 0o1777)
        deadline = time.monotonic() + QUICK
        while not (save / "easyckpt.log").exists() or not (save / ".easyckpt.lock").exists():
            assert time.monotonic() < deadline, "the agent did not notice its save dir replaced"
            time.sleep(0.1)
        second = run(train_cmd(save, 1, "--iters", "5", "--job-name", "second", "--idle-timeout", "1"),
                     timeout=TIMEOUT, check=False)
        assert second.returncode != 0, second.stdout[-2000:] + second.stderr[-2000:]
        assert "is in use by job" in second.stdout + second.stderr, second.stderr[-3000:]
        status = cli("status", save, expect=None).stdout          # the operator's view says it too
        assert f"said: the directory {save} was replaced under the running job" in status, status
        wait_for_iteration(loss, 40, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    wait_no_agent(save, log=old / "easyckpt.log")
    wait_no_agent(save, job_name="second")
    said = out1.read_text()
    assert "was replaced under the running job" in said and "the job's lock is taken there again" in said, said[-3000:]
    new_events = events(save / "easyckpt.log")
    assert any(e["event"] == "commit" for e in new_events), new_events[-5:]
    assert any(e["event"] == "delete" for e in new_events), new_events[-5:]
    assert len(_steps(save)) == 2, _steps(save)


def test_a_guessable_replica_secret_file_is_refused_and_whitespace_is_said(tmp_path):
    """Item 9 of the probe: a secret file of one repeated byte was accepted; one of spaces said "holds 0 bytes"."""
    from easyckpt.engine.link.peers import secret_from_file
    from easyckpt.errors import ConfigError
    path = tmp_path / "secret"
    for text, said in (("a" * 16, "only 1 distinct"), (" " * 40, "besides leading and trailing whitespace")):
        path.write_text(text)
        os.chmod(path, 0o600)
        with pytest.raises(ConfigError, match=said):
            secret_from_file(str(path), "0123456789ab")
    path.write_text("9f86d081884c7d659a2feaa0c55ad015")
    assert len(secret_from_file(str(path), "0123456789ab")) == 64


def test_inspect_calls_a_bin_file_pickled_only_from_its_header(tmp_path):
    """Item 9 of the probe: `inspect` labelled every .bin file "a pickled ... TrainingArguments" from its name."""
    from easyckpt.cli.contents import _binary
    (tmp_path / "raw.bin").write_bytes(b"\x00\x01raw bytes")
    (tmp_path / "p.bin").write_bytes(b"\x80\x04\x95")
    (tmp_path / "training_args.bin").write_bytes(b"PK\x03\x04rest")
    assert _binary(str(tmp_path), "raw.bin").startswith("neither a pickle nor a torch.save archive")
    assert _binary(str(tmp_path), "p.bin").startswith("a pickled Python object")
    assert "TrainingArguments" in _binary(str(tmp_path), "training_args.bin")


@AS_ROOT
def test_easyckpt_ls_never_names_as_the_pick_a_step_the_loader_refuses(shared_dir):
    """Item 9 of the probe: `easyckpt ls` said "the loader would pick step 10" of a step another user owned,
    which the loader refuses as untrusted; now it marks the step untrusted and picks the one the loader takes."""
    save = shared_dir
    _job(save, 10)
    subprocess.run(["chown", "-R", "nobody", str(save / "step_00000010")], check=True, timeout=30)
    out = cli("ls", str(save)).stdout
    assert "* the loader would pick step 5 " in out, out
    assert "untrusted: step_00000010 is owned by uid 65534 (nobody)" in out, out
