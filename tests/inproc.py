"""The engine and the real Agent in this interpreter (easyckpt/_testing/): a job of N ranks as threads,
each with a Checkpointer over the seams, one LocalAgent for the node. For tests of the engine's and the
agent's logic; the real-process tests (torchrun, kill -9, SIGTERM) stay where a framework's or the
operating system's behaviour is what is tested."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import subprocess
import threading
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TypeVar

import harness
import torch

from easyckpt._testing.local_agent import LocalAgent
from easyckpt._testing.ranks import ThreadGroup, groups, run_ranks
from easyckpt.config import Config, validate
from easyckpt.engine.checkpointer import Checkpointer
from easyckpt.pytorch import PytorchState

T = TypeVar("T")


@contextlib.contextmanager
def node(cfg: Config) -> Iterator[LocalAgent]:
    """One node's agent for the job ``cfg``; closed (slots and key released) at the end whatever happened."""
    local = LocalAgent(cfg)
    try:
        yield local
    finally:
        local.close()


def ranks(cfg: Config, local: LocalAgent, world_size: int, body: Callable[[Checkpointer, ThreadGroup], T],
          timeout: float = 120.0) -> List[T]:
    """``body(ckpt, group)`` for each rank, each on its thread with its own Checkpointer."""
    def one(group: ThreadGroup) -> T:
        ckpt = Checkpointer(cfg, group=group, link=local.link(group.rank, world_size))
        return body(ckpt, group)
    return run_ranks(world_size, one, timeout)


_SEEDING = threading.Lock()     # ranks are threads: torch's global generator is shared between them


def model_and_optimizer(seed: int = 0) -> Any:
    with _SEEDING:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def state(ckpt: Checkpointer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> PytorchState:
    return PytorchState(ckpt, model, optimizer, None, step, None)


def run_steps(ckpt: Checkpointer, last: int, finalize: bool = True) -> Optional[int]:
    """A rank's loop: steps 1..``last``, each handed to ``ckpt.save``; then ``finalize`` (its committed step),
    unless not ``finalize`` (a rank that dies: no bye)."""
    model, opt = model_and_optimizer()
    for step in range(1, last + 1):
        train_step(model, opt, step)
        ckpt.save(step, state(ckpt, model, opt, step), optimizer=opt)
    return ckpt.finalize() if finalize else None


# ---- the test worker (tests/worker_pytorch.py) in this interpreter -------------------------------------

# what an in-process run cannot do: end its own process (kill -9, os._exit, SIGTERM to itself), or run as
# two ranks under torchrun; those stay real processes (harness.run)
_PROCESS_ONLY = re.compile(r"(^|,)\d+(@\d+)?:(kill|exit|term|fork-term)\b")


def in_process(cmd: Sequence[str], extra_env: Optional[Dict[str, str]] = None) -> bool:
    """Whether ``cmd`` (harness.train_cmd) can run in this interpreter: one rank, no DataLoader workers,
    nothing that ends the process (an --inject that kills or exits), and no environment of its own (the
    EASYCKPT_* variables are read when a module is imported, and fault points assume the agent is a process
    of its own: its persists run beside training, not in it)."""
    args = list(map(str, cmd))
    if "torch.distributed.run" in args or not args[1].endswith("worker_pytorch.py") or "--workers" in args:
        return False
    inject = args[args.index("--inject") + 1] if "--inject" in args else ""
    return not _PROCESS_ONLY.search(inject) and not extra_env


def run_worker(cmd: Sequence[str], extra_env: Optional[Dict[str, str]] = None, check: bool = True,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """harness.run(cmd) for a one-rank worker command, run by the example's own main in this interpreter, its
    Checkpointer over an in-process agent (easyckpt/_testing/): the same stdout, stderr, save directory and
    audit log, without starting an interpreter, torch and an agent process per run. Commands it cannot run
    here (in_process) go to harness.run."""
    if not in_process(cmd, extra_env):
        return harness.run(cmd, extra_env=extra_env, timeout=timeout, check=check)
    import worker_pytorch
    from worker_pytorch import train as example

    import easyckpt.pytorch

    default = easyckpt.pytorch._default
    agents: List[LocalAgent] = []

    def make(cfg: Config) -> Checkpointer:
        cfg = validate(cfg)
        local = LocalAgent(cfg)
        agents.append(local)
        return Checkpointer(cfg, group=groups(1)[0], link=local.link(0, 1))

    saved_env = {k: os.environ.get(k) for k in (extra_env or {})}
    os.environ.update(extra_env or {})
    out, err = io.StringIO(), io.StringIO()
    code = 0
    default.make = make
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), fresh_console():
            try:
                code = example.main([str(a) for a in cmd[2:]], p=worker_pytorch.parser(),
                                    make_hooks=worker_pytorch.TestHooks)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # noqa: BLE001 - as a process would: the traceback on stderr, exit status 1
                traceback.print_exc()
                code = 1
            finally:
                _end(default, agents)
    finally:
        default.make = Checkpointer
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    proc = subprocess.CompletedProcess(list(map(str, cmd)), code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{cmd} exited {code}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


@contextlib.contextmanager
def fresh_console() -> Iterator[None]:
    """easyckpt's console (easyckpt/console.py) as a new process has it: no handler, no level, propagating, rank
    0; put back as it was at the end. Its state is the process's, and in-process jobs' ranks are threads of this
    interpreter: the first of them to start fixed the handler's ``[rank N]`` prefix (or stdout, for Megatron) for
    every later run in the same pytest worker. conftest.py gives each test one; run_worker each run."""
    from easyckpt import console
    saved = (console.logger.handlers[:], console.logger.level, console.logger.propagate, console._rank)
    console.logger.handlers.clear()
    console.logger.setLevel(logging.NOTSET)
    console.logger.propagate = True
    console._rank = 0
    try:
        yield
    finally:
        console.logger.handlers[:] = saved[0]
        console.logger.setLevel(saved[1])
        console.logger.propagate = saved[2]
        console._rank = saved[3]


def _end(default: Any, agents: List[LocalAgent]) -> None:
    """The process ends: a trainer that did not finalize is a trainer that died (its connection closes without
    bye, so the agent persists what it left, as it would); the agent then leaves."""
    ckpt = default.current
    default.current = None
    if ckpt is not None:
        engine = ckpt.engine
        if engine.preempt is not None:
            engine.preempt.uninstall()
        engine.settle()
        engine.client.close()
        engine.snapshotter.close(unlink=False)
        engine.log.close()
    for local in agents:
        local.close()
