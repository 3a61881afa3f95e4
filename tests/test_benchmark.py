"""The benchmark script keeps working: a tiny run of every easyckpt measurement, the limits, torch.save,
DCP and the training loop (the HF and DeepSpeed savers are left to the real runs: minutes of imports).
It checks that every goal gets a verdict and that the script leaves nothing behind; it asserts no speed
(these machines are shared and noisy: the thresholds live in the script's PASS/MISS)."""
from __future__ import annotations

import ast
import json
import sys

from harness import ROOT, run

BENCH = ROOT / "benchmarks" / "bench_checkpoint.py"


def test_a_tiny_benchmark_run_reports_every_goal(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    proc = run([sys.executable, str(BENCH), "--sizes", "0.01", "--repeats", "1", "--loop-max-gb", "0.01",
                "--loop-rounds", "1", "--skip", "hf,deepspeed", "--dir", str(work), "--out", str(out)],
               timeout=300)
    figures = json.loads((out / "checkpoint.json").read_text())
    (result,) = figures["results"]
    ratios = result["ratios"]
    goals = _goal_keys()
    assert set(goals) <= set(ratios), sorted(set(goals) - set(ratios))
    assert all(v == v and v != float("inf") for v in ratios.values()), ratios     # no NaN, no inf
    table = proc.stdout[proc.stdout.index("goal "):]
    assert table.count("PASS") + table.count("MISS") == len(goals), table
    m = result["easyckpt"]["median"]
    assert m["snapshot"] > 0 and m["persist"] > 0 and m["agent_write"] > 0 and m["restore_storage"] > 0
    assert list(work.iterdir()) == [], "the benchmark left files in its --dir"


def _goal_keys():
    """The keys of the script's GOALS table, read without importing it (it needs torch and its own path)."""
    for node in ast.parse(BENCH.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "GOALS":
            return [elt.elts[0].value for elt in node.value.elts]
    raise AssertionError("no GOALS in the benchmark")
