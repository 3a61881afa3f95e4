"""Preemption and failure recovery (RELIABILITY row 3 and the grace deadline), 2 ranks under torchrun.

SIGTERM goes to one rank, to every rank, or to torchrun's process group (torchrun forwards it to its
workers) at seeded random moments. Every run must end with a committed checkpoint of the step the
ranks agreed on, no iteration lost, and a resume whose losses equal an uninterrupted run's.
``EASYCKPT_TEST_SEED`` changes the moments; the slow sweep runs ``EASYCKPT_SIGTERM_SWEEP`` of them
(default 12, what CI runs; EASYCKPT_SIGTERM_SWEEP=51 for the full sweep).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import (
    alive,
    children,
    committed_steps,
    descendants,
    env,
    events,
    is_agent,
    kill_all,
    last_iteration,
    losses,
    run,
    signal_every_process,
    start,
    starts,
    wait_for_iteration,
    wait_no_agent,
    worker_pids,
    worker_reference,
)
from harness import users_train_cmd as train_cmd


N = 30
COMMON = ["--iters", str(N), "--mem-interval", "2", "--storage-interval", "10", "--max-ckpt", "2"]
SEED = int(os.environ.get("EASYCKPT_TEST_SEED", "20261122"))
MODES = ("one rank", "all ranks", "process group")
SWEEP = int(os.environ.get("EASYCKPT_SIGTERM_SWEEP", "12"))


@pytest.fixture
def reference(uninterrupted):   # the cadence does not change training: one run for every such module
    return worker_reference(uninterrupted, 2, "--iters", str(N))


def sigterm_run(workdir: Path, seed: int, mode: str, reference) -> int:
    """One seeded run: SIGTERM at a random moment, checks, resume, checks. Returns the agreed step."""
    workdir.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    at, delay, victim = rnd.randint(2, N - 6), rnd.uniform(0, 0.04), rnd.randint(0, 1)
    ckpt, loss, log = workdir / "ckpt", workdir / "loss", workdir / "audit.jsonl"
    cmd = train_cmd(ckpt, 2, *COMMON, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.04",
                    "--idle-timeout", "5")
    proc = start(cmd, log=workdir / "first.out")
    wait_for_iteration(loss, at, proc)
    time.sleep(delay)
    if mode == "process group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        pids = worker_pids(proc, 2)
        for rank in ([victim] if mode == "one rank" else [0, 1]):
            os.kill(pids[rank], signal.SIGTERM)
    proc.wait(timeout=90)
    what = f"seed {seed}, {mode}, SIGTERM after iteration {at} (+{delay:.3f}s, rank {victim})"
    saves = [e for e in events(log) if e["event"] == "sigterm_save"]
    assert sorted(e["rank"] for e in saves) == [0, 1], f"{what}: {saves}\n{(workdir / 'first.out').read_text()[-3000:]}"
    agreed = saves[0]["step"]
    assert all(e["step"] == agreed for e in saves), f"{what}: ranks saved different steps {saves}"
    assert committed_steps(ckpt)[-1] == agreed, f"{what}: step {agreed} not committed"
    reached = max(last_iteration(loss, r) for r in (0, 1))
    assert reached == agreed, f"{what}: trained to {reached}, saved {agreed}: iterations lost"
    said = (workdir / "first.out").read_text()
    assert said.count(f"easyckpt: SIGTERM: saving step {agreed} on all 2 ranks\n") == 1, f"{what}: {said[-3000:]}"
    assert re.search(rf"^easyckpt: SIGTERM: step {agreed} committed \d+\.\d\d s after this rank reached it; "
                     rf"exiting$", said, re.M), f"{what}: {said[-3000:]}"
    run(cmd)
    assert starts(loss)[-1] == agreed, f"{what}: resumed from {starts(loss)[-1]}, not {agreed}"
    for rank in (0, 1):
        got = losses(loss, rank)
        assert sorted(got) == list(range(1, N + 1)), f"{what}: rank {rank} iterations {sorted(got)}"
        assert [i for i in got if got[i] != reference[rank][i]] == [], f"{what}: rank {rank} losses differ"
    wait_no_agent(ckpt)
    return agreed


# one rank signalled is the case that needs the agreement; all ranks and the whole process group (what
# torchrun does; the launcher test sends it too) are -m slow
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m != "one rank" else m for m in MODES])
def test_sigterm_saves_the_agreed_step_and_loses_nothing(tmp_path, reference, mode):
    sigterm_run(tmp_path, SEED + MODES.index(mode), mode, reference)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_sigterm_at_random_moments(tmp_path, reference):
    """EASYCKPT_SIGTERM_SWEEP seeded moments, the modes in turn: 12 by default (CI), 51 for the full sweep."""
    assert SWEEP >= 1, f"EASYCKPT_SIGTERM_SWEEP={SWEEP}: run at least one moment"
    agreed = []
    for i in range(SWEEP):
        mode = MODES[i % 3]
        agreed.append(sigterm_run(tmp_path / f"run{i}", SEED * 100 + i, mode, reference))
    print(f"agreed steps: {agreed}")


@pytest.fixture(scope="module")
def reference_with_loader(tmp_path_factory):
    # the same batches as the workers make, loaded in the trainer: fewer processes on a small box
    d = tmp_path_factory.mktemp("reference_loader")
    run(train_cmd(d / "ckpt", 2, *COMMON, "--workers", "0", "--loss-file", str(d / "loss")))
    wait_no_agent(d / "ckpt")
    return {r: losses(d / "loss", r) for r in (0, 1)}


# fork is Linux's default start method (Megatron's, the Trainer's); spawn and forkserver are -m slow
@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow),
                                          pytest.param("forkserver", marks=pytest.mark.slow)])
def test_sigterm_to_every_process_with_dataloader_workers_saves_the_agreed_step(tmp_path, reference_with_loader,
                                                                                start_method):
    """RELIABILITY row 27: a scheduler's cancel signals every process of the job at once — torchrun, both
    trainers, their two DataLoader workers each, the node agent. The workers must leave SIGTERM to their
    trainer (else the trainer dies of 'DataLoader worker (pid …) is killed by signal: Terminated' before
    any save); the ranks agree on a step, commit it, exit, and the workers go with their trainers."""
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmd = train_cmd(ckpt, 2, *COMMON, "--workers", "2", "--worker-start", start_method, "--loss-file", str(loss),
                    "--log-file", str(log), "--step-sleep", "0.04", "--idle-timeout", "5")
    proc = start(cmd, log=tmp_path / "first.out")
    wait_for_iteration(loss, 8, proc)
    wait_for_iteration(loss, 8, proc, rank=1)
    kids = children()
    trainers = [p for p in kids.get(proc.pid, []) if not is_agent(p)]
    loaders = {t: [p for p in descendants(t, kids) if p != t and not is_agent(p)] for t in trainers}
    assert len(trainers) == 2 and all(len(v) >= 2 for v in loaders.values()), f"trainers and workers: {loaders}"
    signalled = signal_every_process(proc, signal.SIGTERM)
    proc.wait(timeout=120)
    out = (tmp_path / "first.out").read_text()
    what = f"{start_method} workers, SIGTERM to {len(signalled)} processes\n{out[-3000:]}"
    assert "killed by signal" not in out and "exited unexpectedly" not in out, what
    saves = [e for e in events(log) if e["event"] == "sigterm_save"]
    assert sorted(e["rank"] for e in saves) == [0, 1] and all(e["exit"] for e in saves), f"{saves}\n{what}"
    agreed = saves[0]["step"]
    assert all(e["step"] == agreed for e in saves), f"ranks saved different steps {saves}"
    assert committed_steps(ckpt)[-1] == agreed, f"step {agreed} not committed: {committed_steps(ckpt)}"
    assert max(last_iteration(loss, r) for r in (0, 1)) == agreed, "iterations trained past the saved step"
    deadline = time.monotonic() + 30
    while [p for v in loaders.values() for p in v if alive(p)]:
        assert time.monotonic() < deadline, f"DataLoader workers outlived their trainers: {loaders}"
        time.sleep(0.05)
    wait_no_agent(ckpt)
    run(cmd)
    assert starts(loss)[-1] == agreed, f"resumed from {starts(loss)[-1]}, not {agreed}"
    for rank in (0, 1):
        got = losses(loss, rank)
        assert sorted(got) == list(range(1, N + 1)), f"rank {rank} iterations {sorted(got)}"
        assert [i for i in got if got[i] != reference_with_loader[rank][i]] == [], f"rank {rank} losses differ"
    wait_no_agent(ckpt)


def test_a_process_forked_from_the_trainer_dies_of_sigterm_and_takes_no_checkpoint(tmp_path):
    """A helper the trainer forks (a multiprocessing.Pool worker) and ends with SIGTERM, as Pool.terminate()
    does, must die of it as it would without easyckpt — not run the inherited handler (the helper would
    live on and the Pool would wait forever), nor wake the trainer's watcher through the wakeup socket they
    share (the trainer would take an on-demand checkpoint and exit)."""
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    run(train_cmd(ckpt, 1, "--iters", "12", "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05",
                  "--inject", "4:fork-term", "--idle-timeout", "2"))
    assert last_iteration(loss) == 12
    assert not [e for e in events(log) if e["event"] in ("sigterm", "sigterm_save")], "the helper's SIGTERM was taken for the trainer's"
    wait_no_agent(ckpt)


def test_a_step_that_outlasts_the_deadline_gets_the_agents_fallback_checkpoint(tmp_path):
    """Iteration 9 takes 12 s; SIGTERM arrives during it with a 3 s grace deadline. The agent commits the
    newest snapshot (step 8, save_mem_interval 2) before the step ends; then the trainers reach their safe
    point, agree on step 9, save it and exit. ``easyckpt status`` reports all of it meanwhile."""
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmd = train_cmd(ckpt, 2, "--iters", "20", "--mem-interval", "2", "--storage-interval", "10", "--loss-file",
                    str(loss), "--log-file", str(log), "--slow-step", "9:12", "--grace", "3", "--idle-timeout", "5")
    proc = start(cmd, log=tmp_path / "out")
    wait_for_iteration(loss, 8, proc)
    time.sleep(0.5)                     # both ranks are inside iteration 9 now
    for pid in worker_pids(proc, 2).values():
        os.kill(pid, signal.SIGTERM)
    signalled = time.time()
    deadline = time.monotonic() + 10
    while 8 not in committed_steps(ckpt):
        assert time.monotonic() < deadline, f"no fallback checkpoint within 10s: {events(log)[-5:]}"
        time.sleep(0.05)
    committed_after = time.time() - signalled
    status = subprocess.run([sys.executable, "-m", "easyckpt.cli", "status", str(ckpt), "--json"], env=env(),
                            capture_output=True, text=True, timeout=60)
    assert proc.poll() is None, "the trainers should still be inside their long step"
    proc.wait(timeout=60)
    assert committed_after < 3 + 1.5, f"fallback committed {committed_after:.1f}s after SIGTERM (deadline 3s)"
    report = json.loads(status.stdout)
    assert report["agent"]["sigterm"]["fallback_done"] and report["agent"]["connected"] == [0, 1]
    assert {(s["rank"], s["step"]) for s in report["snapshots"] if s["complete"]} >= {(0, 8), (1, 8)}
    assert report["newest_committed"]["step"] == 8
    evs = events(log)
    fallback = [e for e in evs if e["event"] == "deadline_fallback"]
    assert fallback and fallback[0]["step"] == 8
    assert sorted((e["rank"], e["step"]) for e in evs if e["event"] == "sigterm_save") == [(0, 9), (1, 9)]
    assert committed_steps(ckpt)[-2:] == [8, 9]
    wait_no_agent(ckpt)


def test_the_agent_abandons_a_write_it_cannot_finish_within_the_deadline(tmp_path):
    """The trainers are killed; the agent persists their newest snapshot on slow storage (5 s per file)
    and then gets SIGTERM with a 2 s grace deadline: it removes its staging dir and exits in time; no
    step directory appears half-written."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    cmd = train_cmd(ckpt, 1, "--iters", "200", "--storage-interval", "100", "--log-file", str(log),
                    "--loss-file", str(tmp_path / "loss"), "--step-sleep", "0.02", "--grace", "2",
                    "--idle-timeout", "60")
    proc = start(cmd, {"EASYCKPT_FAULTS": "agent.persist_file=sleep:5"}, log=tmp_path / "out")
    wait_for_iteration(tmp_path / "loss", 5, proc)
    agent = next(e["pid"] for e in events(log) if e["event"] == "agent_start")
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not any(e["event"] == "persist_after_death" for e in events(log)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(agent, signal.SIGTERM)
    t0 = time.monotonic()
    wait_no_agent(ckpt, timeout=10)
    assert time.monotonic() - t0 < 2 + 1.0, "the agent outlived its grace deadline"
    assert [e for e in events(log) if e["event"] == "deadline_exit"]
    assert committed_steps(ckpt) == [] and not list(ckpt.glob("step_*")) and not list(ckpt.glob(".easyckpt-staging-*"))


def test_the_agent_finishes_a_write_that_fits_and_leaves_at_once(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    cmd = train_cmd(ckpt, 1, "--iters", "200", "--storage-interval", "100", "--log-file", str(log),
                    "--loss-file", str(tmp_path / "loss"), "--step-sleep", "0.02", "--grace", "20",
                    "--idle-timeout", "60")
    proc = start(cmd, {"EASYCKPT_FAULTS": "agent.persist_file=sleep:1"}, log=tmp_path / "out")
    # iteration 6's loss is written after step 5's snapshot completed (a loss is written before its save)
    wait_for_iteration(tmp_path / "loss", 6, proc)
    agent = next(e["pid"] for e in events(log) if e["event"] == "agent_start")
    proc.kill()
    proc.wait(timeout=30)
    os.kill(agent, signal.SIGTERM)
    wait_no_agent(ckpt, timeout=15)       # not the 60 s idle timeout: the node is going down
    steps = committed_steps(ckpt)
    assert len(steps) == 1 and steps[0] >= 5 and not list(ckpt.glob(".easyckpt-staging-*"))


def test_easyckpt_run_survives_three_crashes_and_a_sigterm(tmp_path, reference):
    """An exception on rank 1, kill -9 of rank 0, os._exit on rank 1, then SIGTERM to rank 0: the launcher
    restarts each time (from memory), and the last attempt reaches iteration N with the reference losses."""
    ckpt, loss, once = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "once"
    once.mkdir()
    cmd = [sys.executable, "-m", "easyckpt.cli", "run", "--max-restarts", "3", "--backoff", "0.2", "--",
           *train_cmd(ckpt, 2, *COMMON, "--loss-file", str(loss), "--step-sleep", "0.03", "--idle-timeout", "20",
                      "--inject", "6@1:raise,12:kill,17@1:exit,23:term", "--once-dir", str(once))]
    out = run(cmd, timeout=300)
    summary = out.stderr[out.stderr.index("attempt(s)"):]
    assert "5 attempt(s), 4 restart(s)" in out.stderr, out.stderr[-3000:]
    kinds = [line.split()[1] for line in summary.splitlines()[2:7]]
    assert kinds == ["crash", "crash", "crash", "preemption", "success"], summary
    assert "(memory," in summary
    for rank in (0, 1):
        got = losses(loss, rank)
        assert sorted(got) == list(range(1, N + 1))
        assert got[N] == reference[rank][N] and got == reference[rank]
    wait_no_agent(ckpt)


@pytest.mark.slow    # the supervisor's restart path runs in the test above; this is its limit (CI time)
def test_easyckpt_run_gives_up_after_max_restarts(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "easyckpt.cli", "run", "--max-restarts", "1", "--backoff", "0", "--",
           *train_cmd(ckpt, 1, "--iters", "10", "--crash-at", "3", "--idle-timeout", "1")]
    out = run(cmd, check=False)
    assert out.returncode == 1 and "--max-restarts 1 used up" in out.stderr
    assert "2 attempt(s), 1 restart(s)" in out.stderr
    wait_no_agent(ckpt)


def test_a_sigkilled_launcher_is_said_once_and_its_orphaned_ranks_train_on(tmp_path):
    """SIGKILL to torchrun alone: its workers, re-parented, lose the store it held. They say so in one line
    (rank 0) and train on to the end, committing; no "SIGTERM agreement" warning at every poll of a store that
    cannot answer (before: 250 lines of TCPStore backtraces and warnings in 20 s)."""
    save, loss, out = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "out"
    proc = start(train_cmd(save, 2, "--iters", "40", "--step-sleep", "0.1", "--loss-file", str(loss),
                           "--storage-interval", "10", "--idle-timeout", "5"), log=out)
    workers = []
    try:
        wait_for_iteration(loss, 5, proc)
        workers = list(worker_pids(proc, 2).values())
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 120
        while any(alive(p) for p in workers):
            assert time.monotonic() < deadline, "the orphaned ranks did not finish"
            time.sleep(0.2)
    finally:
        kill_all(workers, signal.SIGKILL)
    said = out.read_text()
    assert said.count("that holds the ranks' store is gone: SIGTERM agreement is off") == 1, said[-3000:]
    assert "SIGTERM agreement:" not in said, said[-3000:]
    assert said.count("TCPStore.cpp") <= 2, said[-3000:]      # torch's own, once per rank at the moment of the kill
    assert last_iteration(loss) == 40 and 40 in committed_steps(save)
    wait_no_agent(save)

