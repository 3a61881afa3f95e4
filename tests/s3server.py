"""A real S3 server for the object-store tests: Ceph's RADOS Gateway on 127.0.0.1, started by
scripts/s3-server.sh (Debian's ceph-mon, ceph-osd and radosgw; .ci/run installs them), one per test session
(conftest.py's s3_gateway: started by the first module that needs it, shared by the others, each test on a bucket
of its own), on ports of its own per pytest-xdist worker. Without those packages a module's tests are skipped,
saying so; a server that does not start fails them."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "scripts" / "s3-server.sh"


@contextmanager
def running(where: Path, port: int, mon_port: int) -> Iterator[Dict[str, str]]:
    """A gateway on ``port`` (its monitor on ``mon_port`` and the next): ENDPOINT, ACCESS_KEY, SECRET_KEY."""
    missing = [b for b in ("ceph-mon", "ceph-osd", "radosgw") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"no S3 server here: {', '.join(missing)} not installed "
                    f"(apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw)")
    env = dict(os.environ, S3_PORT=str(port), S3_MON_PORT=str(mon_port))
    started = subprocess.run(["bash", str(SERVER), "start", str(where)], capture_output=True, text=True,
                             timeout=300, env=env)
    if started.returncode != 0:
        pytest.fail(f"the S3 server did not start:\n{started.stderr[-4000:]}")
    values = dict(line.split("=", 1) for line in started.stdout.split())
    values.update(DIR=str(where), PORT=str(port), MON_PORT=str(mon_port))
    try:
        yield values
    finally:
        subprocess.run(["bash", str(SERVER), "stop", str(where)], capture_output=True, timeout=120, env=env)


def client_env(server: Dict[str, str]) -> Dict[str, str]:
    """The environment that points boto3 (and so easyckpt) at the server."""
    return {"AWS_ACCESS_KEY_ID": server["ACCESS_KEY"], "AWS_SECRET_ACCESS_KEY": server["SECRET_KEY"],
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": server["ENDPOINT"]}


@contextmanager
def new_bucket(server: Dict[str, str], part_bytes: int = 5 << 20,
               parallel: int = 4) -> Iterator[Tuple[object, str]]:
    """A fresh bucket, emptied and removed afterwards: (an S3Storage on the server, "s3://bucket"). The caller
    has set client_env's credentials (monkeypatch)."""
    from easyckpt._testing.buckets import drop_bucket
    from easyckpt.storage.s3 import S3Storage
    storage = S3Storage(endpoint_url=server["ENDPOINT"], part_bytes=part_bytes, parallel=parallel)
    name = f"t-{uuid.uuid4().hex[:12]}"
    storage.c.create_bucket(Bucket=name)
    try:
        yield storage, f"s3://{name}"
    finally:
        drop_bucket(storage, name)


def gateway(server: Dict[str, str], verb: str) -> None:
    """Stop or start the gateway alone ("stop" / "start"): the store goes away and comes back, its objects kept;
    or freeze and thaw it ("pause" / "resume"): connections are taken and never answered, as by a hung gateway."""
    env = dict(os.environ, S3_PORT=server["PORT"], S3_MON_PORT=server["MON_PORT"])
    done = subprocess.run(["bash", str(SERVER), f"gateway-{verb}", server["DIR"]], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, f"gateway-{verb} failed:\n{done.stderr[-3000:]}"


def bucket_quota(server: Dict[str, str], bucket: str, max_bytes: Optional[int]) -> None:
    """The gateway's own quota on ``bucket`` (radosgw-admin): at most ``max_bytes`` stored; None lifts it. A put
    that would go over is refused (QuotaExceeded), as a full bucket or an account out of quota refuses it."""
    conf = str(Path(server["DIR"]) / "ceph.conf")
    if max_bytes is None:
        steps = [["quota", "disable", "--quota-scope=bucket", f"--bucket={bucket}"]]
    else:
        steps = [["quota", "set", "--quota-scope=bucket", f"--bucket={bucket}", f"--max-size={max_bytes}"],
                 ["quota", "enable", "--quota-scope=bucket", f"--bucket={bucket}"]]
    for args in steps:
        done = subprocess.run(["radosgw-admin", "-c", conf, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"radosgw-admin {' '.join(args)}: {done.stderr[-2000:]}"


def ports() -> Tuple[int, int]:
    """The gateway's port and its monitor's (that and the next) for this session: below the ephemeral range,
    apart for each pytest-xdist worker (gw0, gw1, ...) so that workers' servers never meet."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker[2:].isdigit() else 0
    return 7481 + 2 * n, 27210 + 10 * n


def fixtures(endpoint_env: bool = True):
    """A test module's two fixtures: ``server`` (the session's gateway, conftest.s3_gateway) and ``bucket``
    (the client's environment set, a fresh bucket: (an S3Storage, "s3://bucket")). In the module:
    ``server, bucket = s3server.fixtures()``. Without ``endpoint_env`` the endpoint is left out of the
    environment (the storage layer's own tests give it by ``resolve.set_endpoint``)."""

    @pytest.fixture(scope="module")
    def server(s3_gateway):
        return s3_gateway

    @pytest.fixture
    def bucket(server, monkeypatch):
        for k, v in client_env(server).items():
            monkeypatch.setenv(k, v)
        if not endpoint_env:
            monkeypatch.delenv("AWS_ENDPOINT_URL")
        with new_bucket(server) as made:
            yield made

    return server, bucket
