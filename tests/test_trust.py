"""The threat model (docs/reliability.md rows 17-20) and the Trust issue's failure paths (rows 21-24, 28).

The multi-user tests run as root with a second local user (`nobody`), as CI does, and skip elsewhere.
Each test drives the real trainer (tests/worker_pytorch.py or a small easyckpt script) and the real
agent in separate processes; nothing is mocked.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import (
    SHM,
    TIMEOUT,
    events,
    job_id,
    kill_tree,
    run,
    shm_segments,
    start,
    train_cmd,
    wait_for_iteration,
    wait_no_agent,
)
from inproc import run_worker

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                             reason="needs root and runuser to act as a second local user (nobody); CI runs as root")

HOLDER = textwrap.dedent("""
    import os, sys, time, torch, easyckpt
    save_dir, go = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    easyckpt.initialize_easyckpt(save_dir, save_mem_interval=1, save_storage_interval=1, max_ckpt_num=5)
    easyckpt.load_checkpoint(model, opt)
    for it in (1, 2, 3):
        model(torch.ones(8)).sum().backward(); opt.step()
        easyckpt.save_checkpoint_if_needed(it, model, opt)
    print("READY", flush=True)
    deadline = time.monotonic() + 90
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            sys.exit("nobody created the go file")
        time.sleep(0.05)
    model(torch.ones(8)).sum().backward(); opt.step()
    easyckpt.save_checkpoint_if_needed(4, model, opt)
    print("DONE", easyckpt.finalize_easyckpt(), flush=True)
""")


def _holder(tmp_path: Path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    save = tmp_path / "ckpt"
    go = tmp_path / "go"
    out = tmp_path / "holder.out"
    proc = start([sys.executable, str(script), str(save), str(go)], log=out)
    deadline = time.monotonic() + TIMEOUT
    while "READY" not in (out.read_text() if out.exists() else ""):
        assert proc.poll() is None, out.read_text()
        assert time.monotonic() < deadline, "the holder did not get ready"
        time.sleep(0.05)
    return proc, save, go, out


def _finish_holder(proc, save: Path, go: Path, out: Path) -> None:
    go.touch()
    assert proc.wait(timeout=TIMEOUT) == 0, out.read_text()[-3000:]
    assert "DONE 4" in out.read_text(), out.read_text()[-3000:]
    wait_no_agent(save)
    assert (save / "step_00000004" / "easyckpt_manifest.json").exists(), "the job could not commit after the probes"


def _agent_pid(save: Path) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"easyckpt.agent" in cmd and str(save).encode() in cmd:
                return int(entry)
    raise AssertionError(f"no agent of {save} runs")


ATTACK = textwrap.dedent("""
    import json, socket, sys
    address, forged = "\\0" + sys.argv[1], sys.argv[2]
    got = []
    for payload in (b'{"op": "status"}\\n', b'not json at all\\n', b'{"op": "bye", "rank": 0}\\n',
                    b'{"op": "hello", "rank": 0, "world_size": 64, "local_rank": 0, "pid": 1}\\n',
                    json.dumps({"op": "persist", "rank": 7, "slot": 0, "generation": 1, "step": 999999}).encode() + b"\\n",
                    json.dumps({"op": "status", "key": forged}).encode() + b"\\n"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect(address)
            s.sendall(payload)
            got.append(s.recv(65536).decode(errors="replace"))
        except OSError as exc:
            got.append(f"error {type(exc).__name__}")
        finally:
            s.close()
    print(json.dumps(got))
""")


@AS_ROOT
def test_another_local_user_cannot_command_the_agent(tmp_path):
    """Row 17: `nobody` connects to the agent's (public) abstract address and sends status, garbage, bye, a
    forged hello and persist: it gets nothing, the agent lives on, nothing is written, and the job commits."""
    proc, save, go, out = _holder(tmp_path)
    try:
        agent = _agent_pid(save)
        res = subprocess.run(["runuser", "-u", "nobody", "--", "python3", "-c", ATTACK,
                              f"easyckpt-agent-{job_id(save)}", "0" * 64],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        replies = json.loads(res.stdout)
        assert not any("agent_pid" in r or "job_id" in r for r in replies), replies
        assert all(r in ("", "error ConnectionResetError", "error BrokenPipeError") for r in replies), replies
        assert os.kill(agent, 0) is None, "the agent died"
        assert not (save / "step_00999999").exists()
    finally:
        _finish_holder(proc, save, go, out)
    refused = [e for e in events(save / "easyckpt.log") if e["event"] == "refused"]
    assert refused and all("uid 65534" in e["message"] for e in refused), refused


def test_the_jobs_own_user_without_the_key_gets_an_error_and_the_agent_lives_on(tmp_path):
    """Row 17 for the job's own user: without the job's key nothing is obeyed; with it, a malformed message,
    a bye before hello and a hello with another world size are refused with a reason, and the job still
    commits."""
    proc, save, go, out = _holder(tmp_path)
    key = (SHM / f"easyckpt-{job_id(save)}-key").read_text()
    address = f"\0easyckpt-agent-{job_id(save)}"

    def exchange(*lines: bytes):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(address)
        replies = []
        try:
            for line in lines:
                s.sendall(line + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                replies.append(json.loads(data) if data else None)
        finally:
            s.close()
        return replies

    try:
        no_key, = exchange(b'{"op": "status"}')
        assert no_key["ok"] is False and "key" in no_key["error"]
        bad = exchange(json.dumps({"op": "status", "key": key}).encode(), b"]]] not json", b'{"op": "bye", "rank": 0}',
                       b'{"op": "persist", "rank": "0", "slot": 5}',
                       json.dumps({"op": "hello", "rank": 3, "world_size": 64, "local_rank": 0, "pid": 1}).encode())
        status, garbage, bye, persist, hello = bad
        assert status["ok"] and status["connected"] == [0] and status["world_size"] == 1
        assert not garbage["ok"] and "not JSON" in garbage["error"]
        assert not bye["ok"] and "before hello" in bye["error"]
        assert not persist["ok"] and "rank" in persist["error"]
        assert not hello["ok"] and "world_size=64" in hello["error"] and "world_size=1" in hello["error"]
    finally:
        _finish_holder(proc, save, go, out)
    assert "was refused" in out.read_text() and "world_size=64" in out.read_text(), \
        "the running trainer was not told that the agent refused a trainer of another world size"


def _planted_run(tmp_path: Path, plant) -> subprocess.CompletedProcess:
    save = tmp_path / "ckpt"
    jid = job_id(save)
    planted = [SHM / f"easyckpt-{jid}-r00000-s{i}" for i in (0, 1)]
    try:
        plant(planted)
        return run_worker(train_cmd(save, 1, "--iters", "3", "--storage-interval", "1"), check=False, timeout=TIMEOUT)
    finally:
        for p in planted:
            if os.path.lexists(p):
                p.unlink()
        wait_no_agent(save)
        for p in SHM.glob(f"easyckpt-{jid}-*"):
            p.unlink(missing_ok=True)


@AS_ROOT
def test_slots_planted_by_another_user_are_refused_and_never_read(tmp_path):
    """Row 18: `nobody` plants a 0666 slot claiming step 999999 with a pickled skeleton that would create a
    marker file, and a symlink slot pointing at a root-only file: the trainer refuses both with a message
    naming the owner, reads nothing, runs nothing and overwrites nothing."""
    marker = tmp_path / "pwned"
    precious = tmp_path / "precious"
    precious.write_bytes(b"root only")
    precious.chmod(0o600)
    evil = ("cos\nsystem\n(S'touch " + str(marker) + "'\ntR.").encode()
    meta = json.dumps({"files": [{"relpath": "x.pt", "persist": True, "fmt": "torch", "start": 4096, "end": 4096,
                                  "tensors": []}], "step": 999999,
                       "skeletons": {"x.pt": {"__pickle": evil.decode("latin1")}}}).encode()

    def plant(paths):
        code = textwrap.dedent(f"""
            import os, struct, zlib
            meta = {meta!r}
            hdr = struct.pack("<8sIIqQQQQIIqII", b"EZCKSLOT", 1, 2, 999999, 1, len(meta), 4096, 0, 1, zlib.crc32(meta),
                              1, 0, 1)
            raw = hdr[:12] + hdr[16:]
            hdr += struct.pack("<I", zlib.crc32(raw))
            with open({str(paths[0])!r}, "wb") as f:
                f.write(hdr.ljust(4096, b"\\0") + meta.ljust(4096, b"\\0"))
            os.chmod({str(paths[0])!r}, 0o666)
            os.symlink({str(precious)!r}, {str(paths[1])!r})
        """)
        subprocess.run(["runuser", "-u", "nobody", "--", "python3", "-c", code], check=True, timeout=60)

    res = _planted_run(tmp_path, plant)
    assert res.returncode != 0, "the trainer used a slot another user planted"
    assert "owned by uid 65534" in res.stderr or "is a symlink" in res.stderr, res.stderr[-3000:]
    assert not marker.exists(), "code from a planted slot ran"
    assert precious.read_bytes() == b"root only"
    assert not (tmp_path / "ckpt" / "step_00999999").exists()


@AS_ROOT
def test_a_symlinked_lock_file_or_audit_log_in_the_save_dir_is_never_followed(tmp_path):
    """Row 19: the save dir's lock file and audit log are symlinks to root-only files
    (planted by another user who could write the dir): the targets stay untouched and the error says why."""
    save = tmp_path / "ckpt"
    save.mkdir()
    targets = {name: tmp_path / f"target-{i}" for i, name in enumerate((".easyckpt.lock", "easyckpt.log"))}
    for name, target in targets.items():
        target.write_bytes(b"precious " + name.encode())
        target.chmod(0o600)
        os.symlink(target, save / name)
    res = run_worker(train_cmd(save, 1, "--iters", "2", "--storage-interval", "1"), check=False)
    assert res.returncode != 0 and "symlink" in res.stderr, res.stderr[-3000:]
    (save / "easyckpt.log").unlink()
    res = run_worker(train_cmd(save, 1, "--iters", "2", "--storage-interval", "1"), check=False)
    assert res.returncode != 0 and "symlink" in res.stderr, res.stderr[-3000:]
    wait_no_agent(save)
    for name, target in targets.items():
        assert target.read_bytes() == b"precious " + name.encode(), f"{name}'s target was written"


def test_a_slot_whose_file_names_leave_the_step_is_refused_by_the_agent(tmp_path):
    """Row 20 at the agent: a snapshot whose file names are absolute or climb out with '..' is refused;
    nothing is written outside the staging directory."""
    import torch

    from easyckpt.agent.stepwriter import persist_slot
    from easyckpt.engine.save.snapshot import ShardSpec, Snapshotter
    from easyckpt.formats.slotmeta import BadSlotMeta
    from easyckpt.ipc import shm

    for bad in ("../../escape.safetensors", str(tmp_path / "abs.safetensors")):
        snap = Snapshotter("feedfaceca11", 0, 1)
        try:
            res = snap.snapshot(1, [ShardSpec(bad, {"w": torch.ones(4)})], persist=True)
            staging = tmp_path / "stage" / "a" / "b"
            with pytest.raises(BadSlotMeta):
                persist_slot(shm.slot_path("feedfaceca11", 0, res.slot), res.generation, str(staging), 0)
        finally:
            snap.close(unlink=True)
    assert not (tmp_path / "escape.safetensors").exists() and not (tmp_path / "abs.safetensors").exists()
    assert not list((tmp_path / "stage").rglob("*.safetensors")) if (tmp_path / "stage").exists() else True


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_object_in_a_torch_shard_runs_neither_in_the_agent_nor_on_load(tmp_path):
    """Promises 7 and 9: a torch.save shard holding an object whose unpickling would run code is written by
    the agent's code without unpickling it, and refused both when restored from memory and from storage."""
    import torch

    from easyckpt.agent.stepwriter import persist_slot
    from easyckpt.engine.save.snapshot import ShardSpec, Snapshotter, read_snapshot
    from easyckpt.engine.shards.safeload import safe_torch_load
    from easyckpt.ipc import shm

    marker = tmp_path / "pwned"
    snap = Snapshotter("feedfaceca12", 0, 1)
    try:
        res = snap.snapshot(3, [ShardSpec("model.pt", {"w": torch.ones(4), "evil": _Evil(str(marker))}, fmt="torch")],
                            persist=True)
        staging = tmp_path / "staging"
        persist_slot(shm.slot_path("feedfaceca12", 0, res.slot), res.generation, str(staging), 0)
        assert not marker.exists(), "the agent's persist ran code from the slot"
        with pytest.raises(Exception, match="posix.system|os.system|allow-list"):
            read_snapshot("feedfaceca12", 0, res.slot, 3)
        with pytest.raises(ValueError, match="allow-list"):
            safe_torch_load((staging / "model.pt").read_bytes())
        assert not marker.exists(), "loading ran code from the checkpoint"
        assert torch.load(staging / "model.pt", weights_only=False)["w"].tolist() == [1.0] * 4  # a valid torch file
        assert marker.exists()   # proof that the object was really in the file, with weights_only=False only
    finally:
        snap.close(unlink=True)


def test_a_killed_agent_holding_both_slots_is_replaced_and_nothing_waits_for_it(tmp_path):
    """Row 21: the agent is killed while both slots are reserved (its persist is slow): the trainer notices
    within seconds, starts a new agent, snapshots and persists go on, and finalize does not wait
    commit_timeout (600 s here, beyond this test's timeout)."""
    save = tmp_path / "ckpt"
    loss = tmp_path / "loss"
    env = {"EASYCKPT_FAULTS": "agent.before_persist=sleep:4", "EASYCKPT_FAULT_ONCE_DIR": str(tmp_path)}
    proc = start(train_cmd(save, 1, "--iters", "40", "--storage-interval", "1", "--step-sleep", "0.05",
                           "--loss-file", str(loss)), extra_env=env, log=tmp_path / "out")
    try:
        wait_for_iteration(loss, 4, proc)
        time.sleep(0.3)           # the first persist sleeps 4 s: both slots are reserved by now
        os.kill(_agent_pid(save), signal.SIGKILL)
        assert proc.wait(timeout=TIMEOUT) == 0, (tmp_path / "out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    wait_no_agent(save)
    log = events(save / "easyckpt.log")
    starts = [i for i, e in enumerate(log) if e["event"] == "agent_start"]
    assert len(starts) >= 2, "no new agent was started"
    assert any(e["event"] == "warning" and "is gone" in e.get("message", "") for e in log), \
        "the trainer did not say that the agent was gone"
    assert [e for e in log[starts[1]:] if e["event"] == "persist" and e["reason"] == "interval"], \
        "nothing was persisted at the storage interval after the agent was replaced"
    assert json.loads((save / "step_00000040" / "easyckpt_manifest.json").read_text())["step"] == 40


def test_a_shard_that_failed_on_one_rank_is_rewritten_on_every_rank_after_the_trainers_die(tmp_path):
    """Row 22: rank 1's shard of step 5 fails (ENOSPC) while rank 0's is written; then every trainer is
    killed: the step fails at once, and the agent's after-death persist rewrites both ranks' shards of
    the newest complete snapshot (step 5) instead of waiting for a shard that was deleted."""
    save = tmp_path / "ckpt"
    loss = tmp_path / "loss"
    env = {"EASYCKPT_FAULTS": "agent.persist_file@1=enospc", "EASYCKPT_FAULT_ONCE_DIR": str(tmp_path)}
    proc = start(train_cmd(save, 2, "--iters", "40", "--mem-interval", "5", "--storage-interval", "5",
                           "--step-sleep", "0.1", "--loss-file", str(loss), "--commit-timeout", "600",
                           "--idle-timeout", "3"),
                 extra_env=env, log=tmp_path / "out")
    try:
        wait_for_iteration(loss, 7, proc)
    finally:
        kill_tree(proc)
    deadline = time.monotonic() + 60
    manifest = save / "step_00000005" / "easyckpt_manifest.json"
    while not manifest.exists():
        assert time.monotonic() < deadline, f"step 5 was not persisted after the trainers died: " \
                                            f"{[e for e in events(save / 'easyckpt.log') if e['event'] in ('error', 'persist', 'abandon')]}"
        time.sleep(0.1)
    assert {"rank_00000.safetensors", "rank_00001.safetensors"} <= set(json.loads(manifest.read_text())["files"])
    wait_no_agent(save, timeout=60)
    for p in SHM.glob(f"easyckpt-{job_id(save)}-*"):
        p.unlink(missing_ok=True)


def test_an_agent_whose_last_step_failed_leaves_within_its_idle_timeout_not_commit_timeout(tmp_path):
    """Row 22, its end: rank 0's shard fails every time (ENOSPC), rank 1's fits. The final step fails, the
    trainers exit with the error, the agent's after-death persist fails again on rank 0 (rank 1's shard, written
    after, fails with it): the agent leaves within its idle timeout, saying why, and gives the directory back
    (before: rank 1's late shard left the step pending for commit_timeout, and the agent, holding the job lock,
    lived on about 11 minutes)."""
    save = tmp_path / "ckpt"
    out = run_worker(train_cmd(save, 2, "--iters", "4", "--storage-interval", "5", "--commit-timeout", "600",
                        "--idle-timeout", "2"), extra_env={"EASYCKPT_FAULTS": "agent.persist_file@0=enospc"},
              check=False)
    assert out.returncode != 0 and "No space left on device" in out.stdout + out.stderr
    t0 = time.monotonic()
    wait_no_agent(save, timeout=60)
    assert time.monotonic() - t0 < 60
    log = events(save / "easyckpt.log")
    idle = [e for e in log if e["event"] == "idle_exit"]
    assert idle and "nothing is left to persist" in idle[-1]["message"], idle
    assert any("No space left on device" in e.get("message", "") + e.get("error", "") for e in log if e["event"] == "error")
    assert not list(save.glob(".easyckpt-staging-*")), "a failed step's staging was left"
    for p in SHM.glob(f"easyckpt-{job_id(save)}-*"):     # the dead trainers' slots, kept for a restart
        p.unlink(missing_ok=True)


def test_a_new_run_in_the_dir_of_a_crashed_run_whose_agent_lives_commits_its_own_steps(tmp_path):
    """Row 23: run 1 is killed at iteration 12 (its agent persists 12 after the death and lives on); run 2
    starts from scratch in the same directory: its steps 5 and 10 are committed with its own state, never
    dropped as superseded by the old run's 12."""
    save = tmp_path / "ckpt"
    loss = tmp_path / "loss"
    audit = save / "easyckpt.log"     # named, so that the test reads the same log whatever the default
    proc = start(train_cmd(save, 1, "--iters", "40", "--storage-interval", "5", "--step-sleep", "0.05",
                           "--loss-file", str(loss), "--log-file", str(audit)), log=tmp_path / "out1")
    try:
        wait_for_iteration(loss, 12, proc)
        time.sleep(0.2)
    finally:
        kill_tree(proc)
    # the agent persists the old run's newest snapshot after its death, and lives on. The kill lands a few
    # steps after 12: when the newest snapshot is an interval step (15), the run itself had it persisted
    # and nothing is left for the agent to do after the death; any other step is persisted after it
    deadline = time.monotonic() + 60
    while True:
        log = events(audit)
        newest = max(e["step"] for e in log if e["event"] in ("snapshot", "commit"))
        died = [e["step"] for e in log if e["event"] == "persist_after_death"]
        if (died or newest % 5 == 0) and (save / f"step_{newest:08d}" / "easyckpt_manifest.json").exists():
            break
        assert time.monotonic() < deadline, f"the old run's newest snapshot (step {newest}) was not persisted"
        time.sleep(0.05)
    assert newest > 10 and (newest % 5 == 0 or died[-1] == newest)
    started = time.time()
    (tmp_path / "dump").mkdir()
    run(train_cmd(save, 1, "--iters", "10", "--storage-interval", "5", "--no-resume", "--seed", "99",
                  "--dump-dir", str(tmp_path / "dump"), "--log-file", str(audit)))
    wait_no_agent(save)
    log = events(audit)
    assert not [e for e in log if e["event"] == "abandon" and "superseded" in e.get("message", "")]
    import torch
    from safetensors.torch import load_file
    for step in (5, 10):
        man = json.loads((save / f"step_{step:08d}" / "easyckpt_manifest.json").read_text())
        assert man["created"] >= started, f"step {step} still holds the old run's commit"
        saved = load_file(str(save / f"step_{step:08d}" / "model.safetensors"))
        dumped = torch.load(tmp_path / "dump" / f"model_{step}.pt", weights_only=True)
        assert dumped and all(torch.equal(saved[k], v) for k, v in dumped.items()), \
            f"step {step} does not hold the new run's weights"


def test_retention_never_keeps_a_damaged_checkpoint_in_place_of_a_verified_one(tmp_path):
    """Row 24: step 12 (the newest) is damaged; the resumed run falls back to 10 and commits 15: with
    max_ckpt_num=2, the verified 10 stays and the damaged 12 goes."""
    save = tmp_path / "ckpt"
    run_worker(train_cmd(save, 1, "--iters", "12", "--storage-interval", "5", "--max-ckpt", "2"))
    wait_no_agent(save)
    assert sorted(p.name for p in save.glob("step_*")) == ["step_00000010", "step_00000012"]
    shard = save / "step_00000012" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    run_worker(train_cmd(save, 1, "--iters", "15", "--storage-interval", "5", "--max-ckpt", "2"))
    wait_no_agent(save)
    assert sorted(p.name for p in save.glob("step_*")) == ["step_00000010", "step_00000015"]
    deletes = [e for e in events(save / "easyckpt.log") if e["event"] == "delete" and "step_00000012" in e["path"]]
    assert deletes and "damaged" in deletes[-1]["reason"]


def test_skipped_snapshots_under_back_pressure_are_said_once_an_episode_per_rank_with_a_summary(tmp_path):
    """Row 28: persisting is slower than snapshots: the first skip that breaks the loss bound says on the rank's
    console what a crash would now lose, against save_mem_interval; the next skips go to the audit log only
    (issue 51: two lines a step flooded the console); the rank's next snapshot ends the episode with one line:
    how many were skipped since when, the worst loss, how long the slots stayed busy against the training time of
    save_storage_interval iterations. Every skip is in the audit log, and the summaries count them all."""
    save = tmp_path / "ckpt"
    env = {"EASYCKPT_FAULTS": "agent.before_persist=sleep:1.5", "EASYCKPT_FAULT_AFTER": "agent.before_persist:1"}
    res = run_worker(train_cmd(save, 2, "--iters", "24", "--storage-interval", "1", "--step-sleep", "0.05"),
                     extra_env=env, timeout=180)
    wait_no_agent(save)
    skips = [e for e in events(save / "easyckpt.log") if e["event"] == "skip"]
    for rank in (0, 1):
        said = [line for line in res.stderr.splitlines() if f"rank {rank}: snapshot of step" in line]
        ended = [line for line in res.stderr.splitlines() if f"rank {rank}: snapshots resumed" in line]
        assert said and len(said) == len(ended), res.stderr[-3000:]
        assert all("a crash now would lose" in line and "save_mem_interval=1" in line for line in said), said
        mine = [e for e in skips if e["rank"] == rank]
        assert len(mine) > len(said), "the skips were not in the audit log, or the scenario did not happen"
        for line in ended:
            m = re.search(r"snapshots resumed at step (\d+): (\d+) skipped since step (\d+) \(a crash would have "
                          r"lost up to (\d+) iterations\) while both slots were being persisted for [0-9.]+ s, "
                          r"against [0-9.]+ s of training per save_storage_interval=1", line)
            assert m, line
            end, n, first, worst = map(int, m.groups())
            within = [e for e in mine if first <= e["step"] <= end]     # a step skipped, then taken by finalize
            assert n == len(within) and worst == max(e["behind"] for e in within), (line, within)


def test_an_agent_nobody_says_hello_to_leaves_within_seconds(tmp_path):
    """Smaller item 17: an agent whose trainer died before its hello does not linger for a minute."""
    from easyckpt.config import Config
    from easyckpt.ipc import jobkey

    cfg = Config(save_dir=str(tmp_path / "ckpt"))
    (tmp_path / "ckpt").mkdir()
    jobkey.ensure(cfg.job_id)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "easyckpt.agent", json.dumps(cfg.to_json())],
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert proc.wait(timeout=30) == 0
    finally:
        jobkey.remove(cfg.job_id)
    assert not [s for s in shm_segments() if cfg.job_id in s]


def test_a_step_that_cannot_commit_fails_at_once_and_later_steps_still_commit(tmp_path):
    """Item 10/14: a foreign directory already holds step 5's name: committing 5 fails at once (said on the
    console), later steps commit, and finalize never waits commit_timeout (600 s, beyond this test's timeout)."""
    save = tmp_path / "ckpt"
    foreign = save / "step_00000005"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("someone else's")
    res = run_worker(train_cmd(save, 1, "--iters", "10", "--storage-interval", "5", "--step-sleep", "0.05"))
    wait_no_agent(save, timeout=30)
    assert (foreign / "notes.txt").read_text() == "someone else's" and sorted(os.listdir(foreign)) == ["notes.txt"]
    assert json.loads((save / "step_00000010" / "easyckpt_manifest.json").read_text())["step"] == 10
    assert "step 5 was not committed" in res.stderr and "not an easyckpt checkpoint" in res.stderr, res.stderr[-3000:]
    # said once, as a sentence (not the audit record's dict), and step 10's commit is said too
    assert re.search(r"^easyckpt: step 5 was not committed: .*not an easyckpt checkpoint.*; training goes on and "
                     r"later steps are still saved$", res.stderr, re.M), res.stderr[-3000:]
    assert res.stderr.count("step 5 was not committed") == 1 and "{'" not in res.stderr, res.stderr[-3000:]
    assert re.search(r"^easyckpt: step_00000010 committed \(", res.stderr, re.M), res.stderr[-3000:]


def test_a_step_that_fails_after_the_last_snapshot_is_still_said_at_finalize(tmp_path):
    """The same failure, known only after the trainer's last status check (a slow persist: every snapshot
    through step 10 is taken before step 5's commit fails): finalize says it on the console."""
    save = tmp_path / "ckpt"
    foreign = save / "step_00000005"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("someone else's")
    env = {"EASYCKPT_FAULTS": "agent.before_persist=sleep:0.8"}
    res = run_worker(train_cmd(save, 1, "--iters", "10", "--storage-interval", "5", "--step-sleep", "0.05"), extra_env=env)
    wait_no_agent(save, timeout=30)
    assert (foreign / "notes.txt").read_text() == "someone else's"
    assert "step 5 was not committed" in res.stderr, res.stderr[-3000:]


def test_the_audit_log_is_on_by_default_inside_the_save_dir_and_can_be_turned_off(tmp_path):
    """Item 8: with no log_file_path every save, commit and delete is recorded in SAVE_DIR/easyckpt.log;
    log_file_path=False turns it off."""
    save = tmp_path / "ckpt"
    run_worker(train_cmd(save, 1, "--iters", "10", "--storage-interval", "5", "--max-ckpt", "1"))
    wait_no_agent(save)
    kinds = {e["event"] for e in events(save / "easyckpt.log")}
    assert {"snapshot", "persist", "commit", "delete"} <= kinds, kinds
    off = tmp_path / "off"
    script = tmp_path / "off.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, easyckpt
        model = torch.nn.Linear(4, 4)
        easyckpt.initialize_easyckpt(sys.argv[1], save_storage_interval=1, log_file_path=False)
        easyckpt.load_checkpoint(model)
        easyckpt.save_checkpoint_if_needed(1, model)
        easyckpt.finalize_easyckpt()
    """))
    run([sys.executable, str(script), str(off)])
    wait_no_agent(off)
    assert (off / "step_00000001").is_dir() and not (off / "easyckpt.log").exists()


def test_any_easyckpt_start_reaps_only_this_users_dead_jobs(tmp_path):
    """Item 17: a dead job's segments go at the next easyckpt start of any job (not only of that job's own
    agent), and only those of this user: another user's file is never touched."""
    from easyckpt.ipc.reap import reap_dead_jobs
    from easyckpt.storage.auditlog import AuditLog

    dead = subprocess.Popen(["true"])
    dead.wait()
    header = struct.pack("<8sIIqQQQQIIqII", b"EZCKSLOT", 1, 2, 7, 1, 0, 0, 0, 0, 0, dead.pid, 0, 1)
    mine = SHM / "easyckpt-0123456789ac-r00000-s0"
    mine.write_bytes(header + bytes(4096))
    key = SHM / "easyckpt-0123456789ac-key"
    key.write_text("0" * 64)
    theirs = SHM / "easyckpt-0123456789ad-r00000-s0"
    theirs.write_bytes(header + bytes(4096))
    try:
        if os.geteuid() == 0:
            os.chown(theirs, 65534, 65534)
        for p in (mine, key, theirs):
            os.utime(p, (1e9, 1e9))
        reap_dead_jobs(AuditLog(None, "test"), keep="feedfeedfeed")
        assert not mine.exists() and not key.exists(), "a dead job's segment or key survived"
        if os.geteuid() == 0:
            assert theirs.exists(), "another user's file was removed"
    finally:
        for p in (mine, key, theirs):
            if p.exists():
                p.unlink()


def test_the_agent_imports_neither_torch_nor_pickle(tmp_path):
    """The agent assembles framework-native torch.save files from bytes the trainer prepared: a fresh
    interpreter that imports the agent has loaded neither torch nor an unpickler."""
    code = ("import sys, easyckpt.agent.__main__; "
            "bad = [m for m in ('torch', 'pickle', '_pickle') if m in sys.modules]; "
            "assert not bad, bad")
    run([sys.executable, "-c", code])


@AS_ROOT
def test_a_trainer_never_talks_to_another_users_process_on_its_agents_address(tmp_path):
    """Row 17 the other way round: `nobody` binds the job's agent address first (the name is predictable):
    the trainer refuses to send it anything, the job's key included, and says whose process holds it."""
    save = tmp_path / "ckpt"
    ready = SHM / f"squat-{os.getpid()}"
    code = textwrap.dedent(f"""
        import socket, time, os
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0easyckpt-agent-{job_id(save)}")
        s.listen(8)
        s.settimeout(60)
        open({str(ready)!r}, "w").close()
        got = b""
        try:
            while True:
                c, _ = s.accept()
                c.settimeout(1)
                try:
                    got += c.recv(65536)
                except OSError:
                    pass
                c.close()
                if got:
                    print("GOT", got, flush=True)
        except OSError:
            pass
    """)
    squatter = subprocess.Popen(["runuser", "-u", "nobody", "--", "python3", "-c", code], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and squatter.poll() is None, "the squatter did not start"
            time.sleep(0.05)
        res = run(train_cmd(save, 1, "--iters", "2", "--storage-interval", "1"), check=False)
        assert res.returncode != 0 and "uid 65534" in res.stderr, res.stderr[-3000:]
    finally:
        ready.unlink(missing_ok=True)
        for p in SHM.glob(f"easyckpt-{job_id(save)}-*"):
            p.unlink(missing_ok=True)
        os.killpg(squatter.pid, signal.SIGKILL)
        out, _ = squatter.communicate(timeout=30)
    assert "GOT" not in out, f"the trainer sent the squatter something: {out}"
