"""How long a job waits for its node agent at the first load: from starting the agent until it answers
the first rank's hello (the AgentClient's spawn, connect and hello), for fresh jobs, on an idle machine
and with every core busy (the trainers import their framework while the agent starts).

    .venv/bin/python benchmarks/agent_start.py [--runs 5]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from easyckpt.config import Config  # noqa: E402
from easyckpt.engine.link.client import AgentClient  # noqa: E402
from easyckpt.ipc import agentsocket  # noqa: E402
from easyckpt.storage.auditlog import AuditLog  # noqa: E402


def _spin(stop: "multiprocessing.synchronize.Event") -> None:
    while not stop.is_set():
        sum(range(10000))


def ready_seconds(work: str, n: int) -> List[float]:
    out = []
    os.makedirs(work, exist_ok=True)
    for i in range(n):
        save = os.path.join(work, f"job{i}")
        os.makedirs(save)
        cfg = Config(save_dir=save, agent_idle_timeout=1, log_file_path=os.path.join(work, f"job{i}.log"))
        t0 = time.perf_counter()
        client = AgentClient(cfg, 0, 0, 1, AuditLog(cfg.log_file_path, "rank0"))
        out.append(time.perf_counter() - t0)
        client.close()
        deadline = time.monotonic() + 30
        while agentsocket.agent_listening(cfg.job_id) and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


def measure(work: str, runs: int) -> Dict[str, List[float]]:
    res = {"idle": ready_seconds(os.path.join(work, "idle"), runs)}
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 1)]
    for h in hogs:
        h.start()
    try:
        res["busy"] = ready_seconds(os.path.join(work, "busy"), runs)
    finally:
        stop.set()
        for h in hogs:
            h.join()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="ezck-agent-")
    try:
        res = measure(work, args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for k, v in res.items():
        print(f"agent ready (hello answered after start), {k:>4}: median {sorted(v)[len(v) // 2]:.3f} s "
              f"(runs: {', '.join(f'{x:.3f}' for x in v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
