"""One job per prefix on an object store (docs/reliability.md promise 8), where no flock exists.

The coordinator's agent holds a lease object ``PREFIX/.easyckpt.lock`` while its job is active, as joblock.py's
flock on a file system: created with the store's conditional create (``If-None-Match: *``), so of two jobs that
start together one wins; it names its holder (job, host, agent pid) and when the lease ends. The holder renews it
every LEASE_S / 4 while it has work and deletes it when it goes idle or exits. Another job is refused while the
lease runs, naming the holder; a lease left by a holder that died (kill -9, a lost node) ends LEASE_S after its
last renewal, and the next job then takes it over. The same job (the same job id: its restarted coordinator) takes
its own lease over at once. An operator tool (``easyckpt prune``) takes it only when no lease runs, whoever's.

The lease is read as untrusted input: a body that is not ours (not JSON, a field of the wrong type) counts as a
running lease of an unknown holder until the object is LEASE_S old.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Dict, Optional

from easyckpt.errors import AlreadyCommitted
from easyckpt.storage.s3 import S3Storage

LOCK_NAME = ".easyckpt.lock"
LEASE_S = 120.0
_MAX_BYTES = 4096


class StoreLock:
    def __init__(self, store: S3Storage, save_dir: str, job_id: str, job_name: Optional[str],
                 own_ok: bool = True, clock: Callable[[], float] = time.time):
        self.store, self.path = store, save_dir.rstrip("/") + "/" + LOCK_NAME
        self.job_id, self.job_name, self.own_ok, self.clock = job_id, job_name, own_ok, clock
        self._renewed: Optional[float] = None

    @property
    def held(self) -> bool:
        return self._renewed is not None

    def _body(self) -> bytes:
        now = self.clock()
        return json.dumps({"job_id": self.job_id, "job_name": self.job_name, "host": socket.gethostname(),
                           "agent_pid": os.getpid(), "since": now, "until": now + LEASE_S}).encode()

    def acquire(self) -> Optional[str]:
        """None when this job holds the lease now; else a message naming the job that holds it."""
        if self.held:
            self.refresh()
            return None
        for _ in range(2):        # once more after removing an ended lease (another job may win that race)
            try:
                self.store.create_exclusive(self.path, self._body())
                self._renewed = self.clock()
                return None
            except AlreadyCommitted:
                pass
            holder = self._holder()
            mine = holder.get("job_id") == self.job_id and self.own_ok
            if mine:
                self.store.write_atomic(self.path, self._body())
                self._renewed = self.clock()
                return None
            if self.clock() < holder["until"]:
                return _describe(holder, self.clock())
            self.store.delete(self.path)        # ended: its holder died LEASE_S ago or more
        return _describe(self._holder(), self.clock())

    def _holder(self) -> Dict[str, Any]:
        """The lease's fields as far as they are well-formed; "until" always a number."""
        try:
            data = json.loads(self.store.read(self.path, 0, _MAX_BYTES))
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict):
            data = {}
        until = data.get("until")
        if not isinstance(until, (int, float)) or isinstance(until, bool):
            until = self.store.mtime(self.path) + LEASE_S       # not ours: a running lease until it is old
        out: Dict[str, Any] = {k: data[k] for k in ("job_id", "job_name", "host", "agent_pid")
                               if isinstance(data.get(k), (str, int)) and not isinstance(data.get(k), bool)}
        out["until"] = float(until)
        return out

    def refresh(self) -> None:
        """Renew the lease when a quarter of it has passed (the holder calls this while it has work)."""
        if self._renewed is not None and self.clock() - self._renewed >= LEASE_S / 4:
            self.store.write_atomic(self.path, self._body())
            self._renewed = self.clock()

    def release(self) -> None:
        if self._renewed is not None:
            self._renewed = None
            self.store.delete(self.path)


def _describe(holder: Dict[str, Any], now: float) -> str:
    return (f"job {holder.get('job_name') or holder.get('job_id', '?')} (agent pid {holder.get('agent_pid', '?')} "
            f"on {holder.get('host', '?')}; its lease on the store runs {max(0, round(holder['until'] - now))} "
            f"s more unless renewed)")
