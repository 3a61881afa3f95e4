"""Multi-process test harness: launch the test trainer (worker_pytorch.py) under torchrun (or alone), kill it
at a chosen iteration, and compare its per-iteration losses with an uninterrupted run.

Every subprocess has a timeout. Agents run in their own session; `wait_no_agent` waits until the
agent of a save dir has exited, and the `shm_clean` fixture (conftest.py) checks /dev/shm afterwards.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import hangs
import zygote

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "worker_pytorch.py"       # the example's training plus the flags only tests need
EXAMPLE = ROOT / "examples" / "pytorch" / "train.py"
TIMEOUT = 120


def env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    e = dict(os.environ)
    # PYTHONFAULTHANDLER: a process that hangs past a test's timeout writes its stacks (tests/hangs.py)
    e.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "EASYCKPT_FAULTS",
              "EASYCKPT_FAULT_AFTER", "EASYCKPT_FAULT_ONCE_DIR"):
        e.pop(k, None)
    e.update(extra or {})
    return e


WARM = ROOT / "tests" / "warm_torchrun.py"
# On a machine with a GPU every process is exec'd, as users start them: a process forked after its parent
# initialized CUDA cannot use it ("Cannot re-initialize CUDA in forked subprocess"), and on an H200 with torch
# 2.11 the fork server's and the warm launcher's imports did (two of tests/test_cuda.py's five tests failed so).
# CI has no GPU: the warm paths keep its time there.
GPU = os.path.exists("/dev/nvidiactl")     # an NVIDIA driver (torch not imported here for it)
# what each script imports anyway, imported once by the warm launcher before it forks the workers
MEGATRON = ["megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
            "easyckpt.megatron"]
PRELOAD = {
    "tests/worker_pytorch.py": ["easyckpt.pytorch"],
    "examples/pytorch/train.py": ["easyckpt.pytorch"],
    "examples/deepspeed/hf_train.py": ["transformers.trainer", "easyckpt.transformers"],
    "examples/megatron/pretrain_gpt.py": MEGATRON,
    "tests/megatron_native_check.py": MEGATRON,
    "tests/megatron_native_save.py": MEGATRON,
}


def launcher(nproc: int, script: Path, warm: bool = True) -> List[str]:
    """The launcher of ``nproc`` ranks of ``script``, standalone. ``warm``: tests/warm_torchrun.py (torchrun's
    workers forked after the launcher imported what the script imports: the default tier went from about 1930
    to 1570 CPU-seconds; with the launcher itself forked from tests/zygote.py, 850-880);
    else torchrun as users run it, each worker an interpreter of its own: the tests of signals to the process
    tree, a killed launcher, DataLoader workers and the user's command line."""
    opts = ["--standalone", f"--nproc_per_node={nproc}"]
    if not warm or GPU:
        return [sys.executable, "-m", "torch.distributed.run", *opts]
    preload = PRELOAD.get(str(Path(script).resolve().relative_to(ROOT)) if Path(script).is_relative_to(ROOT)
                          else "", [])
    return [sys.executable, str(WARM), *([f"--preload={','.join(preload)}"] if preload else []), *opts]


class Exec(list):
    """A command run and start exec, never fork from a server (forkable): ``warm=False``'s, as users run it."""


def train_cmd(save_dir: Path, nproc: int, *args: str, warm: bool = True) -> List[str]:
    base = launcher(nproc, TRAIN, warm) if nproc > 1 else [sys.executable]
    cmd = base + [str(TRAIN), "--save-dir", str(save_dir), *args]
    return cmd if warm else Exec(cmd)


def users_train_cmd(save_dir: Path, nproc: int, *args: str) -> List[str]:
    """train_cmd as users run it: torchrun's workers, or the one process, each an interpreter of its own. For
    the tests whose subject is the process model (signals to the process tree, a killed launcher, DataLoader
    workers) and the example as its README runs it."""
    return train_cmd(save_dir, nproc, *args, warm=False)


def script_cmd(script: Path, nproc: int, *args: str, torchrun: Optional[bool] = None,
               warm: bool = True) -> List[str]:
    base = launcher(nproc, script, warm) if nproc > 1 or torchrun else [sys.executable]
    cmd = base + [str(script), *args]
    return cmd if warm else Exec(cmd)


def forkable(cmd: Sequence[str], extra_env: Optional[Dict[str, str]] = None) -> Optional[List[str]]:
    """The modules a fork server (tests/zygote.py) imports before it starts ``cmd`` (``python SCRIPT ARGS``:
    one of PRELOAD's scripts, or the warm launcher), or None where ``cmd`` runs as an exec'd process: another
    command, or an environment of its own beyond EASYCKPT_* (third-party modules read theirs at import, in
    the server). The server never imports easyckpt (its modules read EASYCKPT_* at import). EASYCKPT_TEST_EXEC=1
    turns it off: every process exec'd, as before."""
    args = list(map(str, cmd))
    if GPU or os.environ.get("EASYCKPT_TEST_EXEC") == "1" or isinstance(cmd, Exec) or len(args) < 2 \
            or args[0] != sys.executable:
        return None
    if any(not k.startswith("EASYCKPT_") for k in (extra_env or {})):
        return None
    if args[1] == str(WARM):
        wanted = [m for a in args[2:] if a.startswith("--preload=") for m in a.split("=", 1)[1].split(",")]
        wanted.append("torch.distributed.run")
    else:
        script = Path(args[1])
        rel = str(script.relative_to(ROOT)) if script.is_absolute() and script.is_relative_to(ROOT) else None
        if rel not in PRELOAD:
            return None
        wanted = PRELOAD[rel]
    return ["torch", *sorted({m for m in wanted if m.split(".")[0] != "easyckpt"})]


def run(cmd: Sequence[str], extra_env: Optional[Dict[str, str]] = None, timeout: float = TIMEOUT,
        check: bool = True) -> subprocess.CompletedProcess:
    modules = forkable(cmd, extra_env)
    aborted = hangs.Aborted(cmd, _jobs_of(cmd))
    try:
        if modules is not None:
            proc = zygote.run(cmd, modules, env(extra_env), timeout, aborted.abort)
        else:
            proc = _exec_run(cmd, env(extra_env), timeout, aborted)
    except subprocess.TimeoutExpired as e:
        aborted.clean()
        # what the processes said before they were killed, their stacks last: the only clue to where they hung
        said = [t.decode(errors="replace") if isinstance(t, bytes) else (t or "") for t in (e.output, e.stderr)]
        raise AssertionError(f"{cmd} did not end within {timeout}s; its threads' stacks (SIGABRT) are at the end"
                             f"\nstdout:\n{said[0][-4000:]}\nstderr:\n{said[1][-24000:]}"
                             f"{hangs.agent_logs(cmd)}") from e
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-6000:]}")
    return proc


def _jobs_of(cmd: Sequence[str]) -> List[str]:
    """The job id of the save dir ``cmd`` names (``--save-dir``, ``--job-name``), if it names one."""
    args = list(map(str, cmd))
    named = {k: args[i + 1] for i, k in enumerate(args[:-1]) if k in ("--save-dir", "--job-name")}
    return [job_id(named["--save-dir"], named.get("--job-name"))] if "--save-dir" in named else []


def _exec_run(cmd: Sequence[str], environ: Dict[str, str], timeout: float, aborted: hangs.Aborted
              ) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True, timeout=timeout), but on timeout the process tree is
    asked for its stacks (tests/hangs.py) before it is killed."""
    with subprocess.Popen(list(cmd), env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            aborted.abort(proc.pid)
            try:
                out, err = proc.communicate(timeout=zygote.SETTLE)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(cmd: Sequence[str], extra_env: Optional[Dict[str, str]] = None, log: Optional[Path] = None) -> Any:
    """``cmd`` started in a session of its own, its output in ``log``: a subprocess.Popen, or a zygote.Forked
    (the same methods) where a fork server starts it (forkable)."""
    modules = forkable(cmd, extra_env)
    if modules is None:
        out = open(log, "w") if log else subprocess.DEVNULL
        return subprocess.Popen(list(cmd), env=env(extra_env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    with open(log if log else os.devnull, "w") as out, open(os.devnull, "rb") as null:
        return zygote.popen(cmd, modules, env(extra_env), null.fileno(), out.fileno(), out.fileno(), session=True)


def _children() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _is_agent(pid: int) -> bool:
    try:
        return b"easyckpt.agent" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """kill -9 the launcher and every trainer below it at once (torchrun puts its workers in sessions
    of their own, so a process-group kill would miss them); the node agent is spared, as a node
    agent outside the failed processes would be."""
    kids = _children()
    todo, victims = [proc.pid], []
    while todo:
        pid = todo.pop()
        if _is_agent(pid):
            continue
        victims.append(pid)
        todo.extend(kids.get(pid, []))
    for pid in victims:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


kill_group = kill_tree


children, is_agent = _children, _is_agent


def descendants(root: int, kids: Optional[Dict[int, List[int]]] = None) -> List[int]:
    """``root`` and every process below it, whatever session or group it put itself in (torchrun's
    trainers, their DataLoader workers, a forkserver, the node agent a trainer started)."""
    kids, out, todo = kids if kids is not None else _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def signal_every_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> List[int]:
    """What a scheduler does on cancel or preemption (Slurm's scancel, a node drain): ``sig`` to every
    process of the job at once, from outside it. Returns the pids signalled."""
    return kill_all(descendants(proc.pid), sig)


def kill_all(pids: List[int], sig: int) -> List[int]:
    """``sig`` to each of ``pids``; one already gone is no error. Returns ``pids``."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def losses(prefix: Path, rank: int = 0) -> Dict[int, str]:
    """iteration -> loss (hex); a later line for the same iteration (a redone one) wins."""
    out: Dict[int, str] = {}
    path = Path(f"{prefix}.rank{rank}")
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            it, val = line.split()
            out[int(it)] = val
    return out


def starts(prefix: Path, rank: int = 0) -> List[int]:
    path = Path(f"{prefix}.rank{rank}")
    return [int(l.split()[2]) for l in path.read_text().splitlines() if l.startswith("# start")]


def last_iteration(prefix: Path, rank: int = 0) -> int:
    path = Path(f"{prefix}.rank{rank}")
    if not path.exists():
        return 0
    its = [int(l.split()[0]) for l in path.read_text().splitlines() if l and not l.startswith("#")]
    return its[-1] if its else 0


def wait_for_iteration(prefix: Path, it: int, proc: subprocess.Popen, timeout: float = TIMEOUT,
                       rank: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while last_iteration(prefix, rank) < it:
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before iteration {it}")
        if time.monotonic() > deadline:
            raise AssertionError(f"iteration {it} not reached within {timeout}s")
        time.sleep(0.01)


def agent_alive(job_id: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(f"\0easyckpt-agent-{job_id}")
        return True
    except OSError:
        return False
    finally:
        s.close()


def job_id(save_dir: Any, job_name: Optional[str] = None) -> str:
    from easyckpt.config import Config
    return Config(save_dir=str(save_dir), job_name=job_name).job_id


def wait_no_agent(save_dir: Any, timeout: float = 60, job_name: Optional[str] = None,
                  log: Optional[Path] = None) -> None:
    """``save_dir``: a Path, or an s3:// URL (a str; its audit log is then ``log``, in the job's local_dir)."""
    jid = job_id(save_dir, job_name)
    log = log if log is not None else Path(save_dir) / "easyckpt.log"
    deadline = time.monotonic() + timeout
    while agent_alive(jid):
        if time.monotonic() > deadline:
            raise AssertionError(f"the agent of {save_dir} did not exit within {timeout}s")
        time.sleep(0.05)
    # the agent closes its socket first, then releases the job's shared memory and logs agent_exit: wait for
    # its processes to end too, so a test's own clean-up never races the agent's (bounded: a pid from another
    # namespace may name a live stranger). The audit log may be elsewhere (--log-file): the agents whose command
    # line names this save dir count too
    pids = set(_agent_pids(log, jid)) | set(_agents_of(str(save_dir)))
    end = min(deadline, time.monotonic() + 10)
    while time.monotonic() < end and any(_running(pid) for pid in pids):
        time.sleep(0.05)


def _agent_pids(log: Path, jid: str) -> List[int]:
    host = socket.gethostname()
    pids = []
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:      # a line being written
            continue
        if ev.get("event") == "agent_start" and ev.get("job_id") == jid and ev.get("host") == host:
            pids.append(int(ev["pid"]))
    return pids


def _agents_of(save_dir: str) -> List[int]:
    """The agent processes whose configuration (their command line) names ``save_dir``."""
    return hangs.agents_naming([save_dir])


def _running(pid: int) -> bool:
    """An agent process still running (a zombie has done its work; a reused pid is someone else)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"easyckpt" in f.read()
    except (OSError, IndexError):
        return False


def events(log: Path) -> List[dict]:
    return [json.loads(l) for l in log.read_text().splitlines() if l.strip()] if log.exists() else []


def growing_events(log: Path) -> List[dict]:
    """events() of a log still being written: a last line not yet whole is left for the next read."""
    lines = log.read_text().split("\n") if log.exists() else []
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def assert_prepared(log: Path, nproc: int, estimated: bool = True) -> None:
    """Each rank reserved its snapshot slots at its first load, for its adapter's estimate of the state
    (the "prepare" event), and its first snapshot then fitted them: the estimate covers that snapshot's
    bytes (within the slots' 1 MiB of metadata room) and is not far above it. ``estimated=False``: the
    adapter could not estimate yet, and the event says so."""
    evs = events(log)
    for rank in range(nproc):
        prep = next((e for e in evs if e["event"] == "prepare" and e.get("rank") == rank), None)
        snap = next((e for e in evs if e["event"] == "snapshot" and e.get("rank") == rank), None)
        assert prep is not None and snap is not None, f"rank {rank}: no prepare or no snapshot event in {log}"
        assert evs.index(prep) < evs.index(snap), f"rank {rank}: the slots were prepared after the first snapshot"
        if not estimated:
            assert prep.get("skipped"), prep
            continue
        assert "skipped" not in prep, prep
        assert snap["bytes"] - (1 << 20) <= prep["bytes"] <= 1.25 * snap["bytes"] + (1 << 20), (prep, snap)


# EASYCKPT_SHM_DIR lets two test runs (or two pytest-xdist workers) on one machine keep out of each other's
# segments; tests name the directory through SHM, never /dev/shm itself
SHM = Path(os.environ.get("EASYCKPT_SHM_DIR", "/dev/shm"))


def shm_segments() -> List[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith("easyckpt-"))


def interrupted_runs(cmd: Sequence[str], loss: Path, workdir: Path, interrupts: Sequence[tuple],
                     timeout: float = 300, rank: int = 0) -> subprocess.CompletedProcess:
    """Launch ``cmd``; at each (iteration, signal) interrupt it once the loss file shows that iteration
    (SIGKILL: every trainer at once, the agent spared; SIGTERM: to the launcher, which forwards it to its
    workers; neither lets the trainers save), relaunch the same command; finally run it to the end (its
    output is returned; the interrupted runs' are in ``workdir/interrupted<i>.out``)."""
    for i, (at, sig) in enumerate(interrupts):
        proc = start(cmd, log=workdir / f"interrupted{i}.out")
        try:
            wait_for_iteration(loss, at, proc, timeout, rank)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{(workdir / f'interrupted{i}.out').read_text()[-4000:]}") from None
        if sig == signal.SIGKILL:
            kill_tree(proc)
        else:
            proc.send_signal(sig)
            proc.wait(timeout=120)
    return run(cmd, timeout=timeout)


def assert_console(workdir: Path, last: subprocess.CompletedProcess, resumed: Sequence[int], save_dir: Path,
                   dir_name: Callable[[int], str], nproc: int) -> None:
    """What rank 0 said (once for the job, as the frameworks' print_rank_0 / log_dist(ranks=[0])) in
    interrupted_runs' kill -9 then SIGTERM: the run relaunched after kill -9 resumed ``resumed[0]`` from
    memory and saved ``resumed[1]`` on SIGTERM (its commit line before the one saying it exits); the last
    run resumed that from storage."""
    said = (workdir / "interrupted1.out").read_text()
    assert said.count("easyckpt: resumed step") == 1 and \
        f"easyckpt: resumed step {resumed[0]} from memory (the snapshot that outlived the last run): " in said, said
    agreed = resumed[1]
    on_all = f" on all {nproc} ranks" if nproc > 1 else ""
    assert f"easyckpt: SIGTERM: saving step {agreed}{on_all}\n" in said, said
    committed = re.search(rf"^easyckpt: {dir_name(agreed)} committed \(\d+(\.\d)? [KM]iB, written in \d+\.\d\d s\)$",
                          said, re.M)
    sigterm = re.search(rf"^easyckpt: SIGTERM: step {agreed} committed \d+\.\d\d s after this rank reached it; "
                        rf"exiting$", said, re.M)
    assert committed and sigterm and committed.start() < sigterm.start(), said
    said = last.stdout + last.stderr
    assert said.count("easyckpt: resumed step") == 1 and \
        f"easyckpt: resumed step {agreed} from storage ({save_dir / dir_name(agreed)}, verified): " in said, said
    assert "easyckpt [rank " not in said and not re.search(r"^(error|warning|skip) \{'", said, re.M), said[-3000:]


def assert_losses_equal(got: Dict[int, str], reference: Dict[int, str], n: int, what: str = "") -> None:
    assert sorted(got) == list(range(1, n + 1)), f"{what}: iterations {sorted(got)}, expected 1..{n}"
    diff = [i for i in got if got[i] != reference[i]]
    assert not diff, f"{what}: losses differ from the uninterrupted run at iterations {diff}"


def assert_losses_close(got: Dict[int, str], reference: Dict[int, str], iterations, rel: float) -> None:
    """For runs on different rank counts, which agree only up to the rounding of their reductions."""
    for i in iterations:
        x, y = float.fromhex(got[i]), float.fromhex(reference[i])
        assert abs(x - y) <= rel * abs(y), f"iteration {i}: {x} vs {y} (uninterrupted run)"


def killed_then_resumed(first: Sequence[str], then: Sequence[str], save_dir: Path, loss: Path, workdir: Path,
                        kill_at: int, timeout: float = 300, said: Optional[List[str]] = None) -> int:
    """Run ``first`` until its loss file shows ``kill_at``, kill -9 it, let its agent persist the newest
    state and leave, then run ``then`` (e.g. on another number of ranks) to the end. Returns the
    iteration ``then`` resumed from; ``said``, if given, gets what ``then`` printed (stdout, then stderr)."""
    proc = start(first, log=workdir / "first.out")
    wait_for_iteration(loss, kill_at, proc, timeout)
    kill_tree(proc)
    wait_no_agent(save_dir, timeout=90)
    done = run(then, timeout=timeout)
    if said is not None:
        said.append(done.stdout + done.stderr)
    return starts(loss)[-1]


def wait_for_snapshots(log: Path, step: int, nranks: int, proc: Any, timeout: float = TIMEOUT) -> None:
    """Until every one of ``nranks`` ranks logged a snapshot of ``step`` or a later one in ``log`` (``proc``: a
    Popen, or anything with its ``poll``, whose exit ends the wait)."""
    deadline = time.monotonic() + timeout
    while {e["rank"] for e in growing_events(log) if e["event"] == "snapshot" and e["step"] >= step} \
            != set(range(nranks)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"not every rank snapshotted step {step} or later (exited: {proc.poll()}): "
                                 f"{[e for e in growing_events(log) if e['event'] == 'snapshot'][-2 * nranks:]}")
        time.sleep(0.01)


def killed_then_restarted(first: Sequence[str], then: Sequence[str], loss: Path, workdir: Path, kill_at: int,
                          log: Path, nranks: int, timeout: float = 300, watch: int = 0) -> Tuple[int, str]:
    """Run ``first`` (``nranks`` ranks, auditing to ``log``) until rank ``watch``'s loss file (the last pipeline
    stage's, with pipeline parallelism) shows ``kill_at`` and every rank
    logged a snapshot of that step or a later one, kill -9 it, and run ``then`` (e.g. on another number of ranks) to
    the end at once, while the agent still holds the killed run's snapshots. Returns the iteration ``then`` resumed
    from and what it printed (stdout, then stderr).

    Why the wait for the snapshots: the loss is written before the step's snapshot, so a kill at the loss alone
    lands in that snapshot's copy on some rank, and a rank whose other slot is held by a persist then has no whole
    step in memory (found in CI on a loaded machine: the restart rightly resumed from storage)."""
    proc = start(first, log=workdir / "first.out")
    wait_for_iteration(loss, kill_at, proc, timeout, rank=watch)
    wait_for_snapshots(log, kill_at, nranks, proc, timeout)
    kill_tree(proc)
    done = run(then, timeout=timeout)
    return starts(loss)[-1], done.stdout + done.stderr


def why_not_memory(said: str, log: Path) -> List[str]:
    """What a restart printed about memory, and the agent's idle exits: why a step did not come from memory."""
    return [line for line in said.splitlines() if "memory" in line] + \
        [e["message"] for e in events(log) if e["event"] == "idle_exit"]


def worker_reference(uninterrupted: Callable[..., Any], nproc: int, *args: str) -> Dict[int, Dict[int, str]]:
    """rank -> losses of an uninterrupted run of the test worker with ``args`` (no save dir or loss file among
    them), run once per session and shared by every test that asks for the same (conftest.uninterrupted)."""
    def produce(d: Path) -> Dict[int, Dict[int, str]]:
        import inproc
        inproc.run_worker(train_cmd(d / "ckpt", nproc, *args, "--loss-file", str(d / "loss")))
        wait_no_agent(d / "ckpt")
        got = {rank: losses(d / "loss", rank) for rank in range(nproc)}
        if "--iters" in args:       # every rank trained every iteration
            n = int(args[args.index("--iters") + 1])
            assert all(sorted(v) == list(range(1, n + 1)) for v in got.values()), {r: len(v) for r, v in got.items()}
        return got
    return uninterrupted(("worker", nproc, *args), produce)


def trainer_rank(pid: int) -> Optional[int]:
    """The rank of trainer ``pid`` (0 for one run without torchrun); None for a launcher, an agent, or a
    process gone. A worker of tests/warm_torchrun.py is named ``rankN`` (its environ is the launcher's)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if b"easyckpt.agent" in cmdline:
        return None
    if b"warm_torchrun" in cmdline or b"zygote" in cmdline:    # forked: its name says (tests/zygote.py)
        if re.fullmatch(r"rank\d+", comm):
            return int(comm[4:])
        return 0 if comm == "trainer" else None
    if b"torch.distributed.run" in cmdline:
        return None
    ranks = [e[5:] for e in environ if e.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else 0


def worker_pids(proc: subprocess.Popen, n: int, timeout: float = 60) -> Dict[int, int]:
    """rank -> pid of the trainers below ``proc`` (torchrun's workers, or ``proc`` itself), by their RANK."""
    deadline = time.monotonic() + timeout
    while True:
        kids, found, todo = _children(), {}, [proc.pid]
        while todo:
            pid = todo.pop()
            todo.extend(kids.get(pid, []))
            rank = trainer_rank(pid)
            if rank is not None:
                found[rank] = pid
        if len(found) >= n:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"found trainers {found}, expected {n}")
        time.sleep(0.05)


def committed_steps(save_dir: Path, pattern: str = "step_*") -> List[int]:
    out = []
    for p in sorted(save_dir.glob(pattern)):
        man = p / "easyckpt_manifest.json"
        if man.exists():
            out.append(json.loads(man.read_text())["step"])
    return sorted(out)


def cli(*args: str, expect: Optional[int] = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    """``easyckpt ARGS`` through ``easyckpt.cli.main(argv)`` in this process, its stdout and stderr captured;
    its exit status must be ``expect`` (None: any). ``easyckpt run`` (which hands the terminal to a training
    command) and the entry point itself run as processes: cli_process."""
    if args and str(args[0]) == "run":
        return cli_process(*args, expect=expect, timeout=timeout)
    import contextlib
    import io

    from easyckpt.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:       # argparse: --version, --help, a usage error
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    proc = subprocess.CompletedProcess(["easyckpt", *map(str, args)], code, out.getvalue(), err.getvalue())
    return _expect(proc, args, expect)


def cli_process(*args: str, expect: Optional[int] = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    """``easyckpt ARGS`` as a user runs it (``python -m easyckpt.cli`` in a subprocess)."""
    proc = subprocess.run([sys.executable, "-m", "easyckpt.cli", *map(str, args)], env=env(), capture_output=True,
                          text=True, timeout=timeout)
    return _expect(proc, args, expect)


def _expect(proc: subprocess.CompletedProcess, args: Sequence[Any], expect: Optional[int]
            ) -> subprocess.CompletedProcess:
    if expect is not None and proc.returncode != expect:
        raise AssertionError(f"easyckpt {' '.join(map(str, args))} exited {proc.returncode}, expected {expect}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def cli_json(*args: str, expect: Optional[int] = 0) -> Any:
    return json.loads(cli(*args, "--json", expect=expect).stdout)
