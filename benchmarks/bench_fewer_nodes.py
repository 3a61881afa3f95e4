"""A job restarted on fewer nodes (issue 53): resharded from the surviving nodes' memory against from storage, in
one run.

    sudo .venv/bin/python benchmarks/bench_fewer_nodes.py [--rounds 2] [--hidden 100000] [--out FILE]

Each round runs both routes, in alternating order, on 4 simulated nodes × 1 rank (tests/nodes.py; DDP, the
example's MLP: 216 bytes per unit of --hidden with AdamW), save_mem_interval=2, save_storage_interval=10:

memory   replication_factor 2 (node i's replicas on node i + 1): node 3 is killed once it replicated step 12
         and step 10 is committed, the job relaunched on nodes 0-2 (world size 4 -> 3) and resumes from memory
         (resharded.py)
storage  the same, but node 0's replicas of node 3's rank are deleted before the relaunch: that rank is then in
         no node's memory, so the job resumes from the newest committed step, with the save dir's pages evicted
         from the page cache first (a cold read, as on a restart that lands on other hosts)

Per route: seconds from the relaunch until all three ranks trained a new iteration, the slowest rank's load
(the audit log's ``load`` seconds), the bytes read from storage by all ranks, the bytes moved between nodes,
and the iterations lost (rank 3's last iteration before the kill - the step resumed). Prints the ratios memory /
storage and writes the figures as JSON (--out). Needs root, like the multi-node tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import bench_replicas as br  # noqa: E402  (the simulated jobs' helpers)
import nodes  # noqa: E402
from common import evict  # noqa: E402
from harness import committed_steps, events, last_iteration, starts  # noqa: E402

TIMEOUT = 300


def one_route(route: str, hidden: int, work: Path) -> Dict[str, Any]:
    d = work / route
    ckpt, loss, log = d / "ckpt", d / "loss", d / "audit.jsonl"
    args = br.job_args(loss, log, hidden, iters=24, mem=2, storage=10, factor=2, step_sleep=0.05)
    with br.cluster(4, d) as c:
        runs = c.launch(ckpt, 1, *args, tag="first")
        procs = [r.proc for r in runs]
        br.wait_until("iteration 14", lambda: last_iteration(loss, 3) >= 14, TIMEOUT, procs)
        br.wait_until("a replica of step 12", lambda: (br.newest_replica(log, "node3") or 0) >= 12, TIMEOUT, procs)
        br.wait_until("step 10 committed", lambda: 10 in committed_steps(ckpt), TIMEOUT, procs)
        runs[3].kill()
        reached = last_iteration(loss, 3)
        for r in runs[:3]:
            assert r.wait_command(120) != 0, "the survivors' trainers should fail when node 3 is lost"
        if route == "storage":
            gone = runs[0].enter(["sh", "-c", "rm -f /dev/shm/easyckpt-*-r00003-p*"], d / "forget.out")
            assert gone.wait(timeout=30) == 0
            os.sync()
            evict(str(ckpt))
        cmds = c.train_cmds(ckpt, 1, *args, only=3)
        t0 = time.time()
        again = [runs[i].enter(cmds[i], c.log("fewer", i)) for i in range(3)]
        trained = br.wait_until("all three ranks training again",
                                lambda: all(br.new_iteration(loss, r) for r in range(3)), TIMEOUT, again, 0.005)
        rcs = [p.wait(timeout=TIMEOUT) for p in again]
        assert rcs == [0, 0, 0], "\n".join(c.log("fewer", i).read_text()[-2500:] for i in range(3))
        c.wait(runs[:3], 60)
    resumed = starts(loss, 0)[-1]
    loads = [e for e in events(log) if e["event"] == "load" and e["step"] == resumed]
    sources = sorted({e["source"] for e in loads})
    assert sources == (["resharded"] if route == "memory" else ["storage"]), (route, sources)
    return {"route": route, "relaunch_to_training_s": trained - t0, "slowest_load_s": max(e["seconds"] for e in loads),
            "storage_bytes": sum(e["bytes"] for e in loads if e["source"] in ("storage", "adopted")),
            "moved_bytes": sum(e.get("moved", 0) for e in loads), "resumed": resumed, "lost": reached - resumed,
            "sources": sources}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=100000)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    why = nodes.unavailable()
    if why:
        print(f"cannot run: {why}")
        return 2
    import tempfile
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fewer-") as tmp:
        for i in range(a.rounds):
            for route in (("memory", "storage") if i % 2 == 0 else ("storage", "memory")):
                row = one_route(route, a.hidden, Path(tmp) / f"round{i}")
                row["round"] = i
                rows.append(row)
                print(f"round {i} {route:7}: relaunch -> training {row['relaunch_to_training_s']:.2f} s, slowest load "
                      f"{row['slowest_load_s']:.3f} s, read from storage {row['storage_bytes'] / 1e6:.1f} MB, moved "
                      f"{row['moved_bytes'] / 1e6:.1f} MB, resumed step {row['resumed']} ({row['lost']} iterations "
                      f"lost)", flush=True)
    report = summary(rows, a.hidden)
    print(report)
    if a.out:
        Path(a.out).write_text(json.dumps({"hidden": a.hidden, "rows": rows}, indent=1) + "\n")
    return 0


def summary(rows: List[Dict[str, Any]], hidden: int) -> str:
    def med(route: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["route"] == route)

    pairs: List[Tuple[str, str]] = [("relaunch_to_training_s", "relaunch -> all ranks training (s)"),
                                    ("slowest_load_s", "the slowest rank's load (s)")]
    lines = [f"4 -> 3 nodes, {hidden * 216 / 1e6:.1f} MB per rank, medians of {len(rows) // 2} round(s):",
             f"{'figure':40} {'memory':>10} {'storage':>10} {'memory/storage':>15}"]
    for key, words in pairs:
        m, s = med("memory", key), med("storage", key)
        lines.append(f"{words:40} {m:10.3f} {s:10.3f} {m / s:15.3f}")
    lines.append(f"{'bytes read from storage (MB)':40} {med('memory', 'storage_bytes') / 1e6:10.1f} "
                 f"{med('storage', 'storage_bytes') / 1e6:10.1f}")
    lines.append(f"{'bytes moved between nodes (MB)':40} {med('memory', 'moved_bytes') / 1e6:10.1f} "
                 f"{med('storage', 'moved_bytes') / 1e6:10.1f}")
    lines.append(f"{'iterations lost':40} {med('memory', 'lost'):10.1f} {med('storage', 'lost'):10.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
