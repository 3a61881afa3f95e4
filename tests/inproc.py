"""The engine and the real Agent in this interpreter (easyckpt/_testing/): a job of N ranks as threads,
each with a Checkpointer over the seams, one LocalAgent for the node. For tests of the engine's and the
agent's logic; the real-process tests (torchrun, kill -9, SIGTERM) stay where a framework's or the
operating system's behaviour is what is tested."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, List, TypeVar

import torch

from easyckpt._testing.local_agent import LocalAgent
from easyckpt._testing.ranks import ThreadGroup, run_ranks
from easyckpt.config import Config
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
