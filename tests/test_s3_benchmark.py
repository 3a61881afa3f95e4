"""benchmarks/bench_s3_checkpoint.py keeps working: a tiny run against the session's real S3 server
(tests/s3server.py) gives every row of the issue's table a finite ratio and leaves no bucket behind. It asserts no
speed (these machines are shared and noisy: the goals are printed beside the ratios, for a person to read)."""
from __future__ import annotations

import math
import re
import sys

import pytest
import s3server
from harness import ROOT, run

from easyckpt.storage.s3 import S3Storage

pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e .[s3])")
pytestmark = pytest.mark.slow      # a whole benchmark run (about a minute): the tiers' other tests cover its paths

BENCH = ROOT / "benchmarks" / "bench_s3_checkpoint.py"
server, bucket = s3server.fixtures()


def test_a_tiny_benchmark_run_gives_every_row_a_ratio_and_drops_its_bucket(server, monkeypatch):
    for k, v in s3server.client_env(server).items():
        monkeypatch.setenv(k, v)
    store = S3Storage(endpoint_url=server["ENDPOINT"])
    before = {b["Name"] for b in store.c.list_buckets()["Buckets"]}
    proc = run([sys.executable, str(BENCH), "--endpoint", server["ENDPOINT"], "--key", server["ACCESS_KEY"],
                "--secret", server["SECRET_KEY"], "--hidden", "20000", "--iters", "6", "--idle-sleep", "0.3"],
               timeout=600)
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"(persist / raw upload, (?:cores free|beside training)|restore / raw ranged GET|"
                     r"stall per save, store/disk|restore local tier / store)\s+([0-9.]+)", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    assert set(rows) == {"persist / raw upload, cores free", "persist / raw upload, beside training",
                         "restore / raw ranged GET", "stall per save, store/disk", "restore local tier / store"}, \
        proc.stdout
    assert all(math.isfinite(v) and v > 0 for v in rows.values()), rows
    assert re.search(r"save -> durable +[0-9.]+ s .*\(no --dcp-python", proc.stdout), proc.stdout
    after = {b["Name"] for b in store.c.list_buckets()["Buckets"]}
    assert after == before, f"the benchmark left buckets behind: {sorted(after - before)}"
