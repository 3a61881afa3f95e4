"""The benchmark script keeps working: a tiny run of every easyckpt measurement, the limits, torch.save,
DCP and the training loop (the HF and DeepSpeed savers are left to the real runs: minutes of imports).
It checks that every goal gets a verdict and that the script leaves nothing behind; it asserts no speed
(these machines are shared and noisy: the thresholds live in the script's PASS/MISS)."""
from __future__ import annotations

import ast
import json
import sys

import pytest
from harness import ROOT, run, wait_no_agent

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


PEER = ROOT / "benchmarks" / "bench_peer.py"
WORKER = ROOT / "benchmarks" / "peer_worker.py"


def test_the_head_to_head_worker_measures_easyckpt_on_two_ranks(tmp_path):
    """easyckpt's side of bench_peer.py (DLRover's needs its own venv, which CI does not build): two ranks
    under torchrun, each its own shard, every figure measured and the durable step committed."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
         "--framework", "easyckpt", "--gb", "0.01", "--dir", str(ckpt), "--out", str(out), "--saves", "2"],
        timeout=300)
    for rank in (0, 1):
        fig = json.loads((out / f"easyckpt-rank{rank}.json").read_text())
        assert fig["rank"] == rank and fig["world"] == 2 and len(fig["saves"]) == 2
        assert 0 < fig["durable_blocking"] <= fig["durable"] and fig["first_save"] > 0 and fig["steady_save"] > 0
        assert fig["first_total"] == fig["first_iteration"] + fig["first_save"]
        assert 0.009e9 < fig["state_bytes"] < 0.011e9
    step = ckpt / "step_00000004"          # 2 + saves: the durable one
    names = set(p.name for p in step.iterdir())
    assert {"model_rank00000.safetensors", "model_rank00001.safetensors", "optim_rank00001.safetensors"} <= names
    wait_no_agent(ckpt)


def test_the_head_to_head_without_dlrovers_venv_says_how_to_make_it(tmp_path):
    proc = run([sys.executable, str(PEER), "--dlrover-python", str(tmp_path / "none" / "python")],
               timeout=60, check=False)
    assert proc.returncode == 2 and "bash benchmarks/setup_dlrover.sh" in proc.stderr, proc.stderr


def test_the_head_to_head_judges_growth_per_gb_and_skips_what_does_not_fit():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_peer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cells = [{"ranks": 1, "gb": gb, "easyckpt": {"durable": sec}} for gb, sec in ((0.5, 9.0), (1, 1.0), (2, 2.0), (4, 5.2))]
    per_gb, spread = bench_peer.growth(cells, 1, "easyckpt", "durable")
    assert per_gb == pytest.approx([1.0, 1.0, 1.3]) and spread == pytest.approx(1.3)   # from 1 GB on
    assert bench_peer.growth(cells, 2, "easyckpt", "durable") is None
    assert bench_peer.needs(2, 4) > 2 * bench_peer.needs(1, 4) - 1 and bench_peer.needs(1, 8) > 24 * 10**9
