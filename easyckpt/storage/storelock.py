"""One job per prefix on an object store (docs/reliability.md promise 8), where no flock exists.

The coordinator's agent holds a lease object ``PREFIX/.easyckpt.lock`` while its job is active, as joblock.py's
flock on a file system: created with the store's conditional create (``If-None-Match: *``), so of two jobs that
start together one wins; it names its holder (job, host, agent pid). The holder renews it every LEASE_S / 4 while
it has work and releases it when it goes idle or exits. Another job is refused while the lease runs, naming the
holder; a lease left by a holder that died (kill -9, a lost node) ends LEASE_S after its last renewal, and the
next job then takes it over. The same job (the same job id: its restarted coordinator) takes its own lease over
at once. An operator tool (``easyckpt prune``) takes it only when no lease runs, whoever's.

Three rules make it hold between hosts whose clocks disagree and jobs that race:

- A lease's age is the store's to tell: the object's Last-Modified against the Date of the same reply, both the
  store's clock. No host's clock is compared with another's (a job whose clock ran a day ahead took over a
  running job's lease, and both committed to one prefix). The host's ``clock`` only paces the renewals and
  fills the body's ``since`` / ``until``, which are for people (and for easyckpt versions that judged by them).
- Every change after the create is a PUT conditional on the version read (``If-Match: ETag``; each body has a
  nonce, so no two writes share an ETag): the renewal, a takeover, the release. Of two jobs taking over one
  ended lease one write succeeds; a holder whose lease was taken over learns it at its next renewal (LeaseLost)
  and must stop committing. The release deletes the lease only while the object is still the version this job
  wrote (read, ETag compared, then deleted: RGW 16 ignores If-Match on DELETE). A running lease cannot be taken
  by another job, so between that read and the delete nobody else's lease can appear; one taken over because
  this holder stalled has another ETag and is left alone.
- The lease is read as untrusted input: a body that is not ours (not JSON, a field missing, of the wrong type,
  a number not finite or out of range, a string too long or unprintable) counts as a running lease of an
  unknown holder until the object is LEASE_S old by the store's clock; its fields are never used.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import socket
import time
from typing import Any, Callable, Dict, Optional, Tuple, Union

from easyckpt.errors import AlreadyCommitted, LeaseLost, ObjectChanged
from easyckpt.storage.base import Storage, Version, Versioned
from easyckpt.storage.joblock import JobLock

LOCK_NAME = ".easyckpt.lock"
LEASE_S = 120.0          # read when used (tests shorten it)
MAX_LEASE_S = 3600.0     # the longest lease a body may declare
_MAX_BYTES = 4096
_MAX_TEXT = 256          # job name, host
_MAX_PID = 1 << 22       # Linux's largest pid_max
_MAX_TIME = 1e11         # seconds since 1970: year 5138


class StoreLock:
    def __init__(self, store: Versioned, save_dir: str, job_id: str, job_name: Optional[str],
                 own_ok: bool = True, clock: Callable[[], float] = time.time):
        self.store, self.path = store, save_dir.rstrip("/") + "/" + LOCK_NAME
        self.job_id, self.job_name, self.own_ok, self.clock = job_id, job_name, own_ok, clock
        self._etag: Optional[str] = None         # the ETag of the lease this job last wrote: held while set
        self._renewed = 0.0                      # clock() then: paces the renewals only
        self.lost: Optional[str] = None          # why the lease was lost (taken over), until it is taken again

    @property
    def held(self) -> bool:
        return self._etag is not None

    def _body(self) -> bytes:
        now = self.clock()
        return json.dumps({"job_id": self.job_id, "job_name": self.job_name, "host": socket.gethostname(),
                           "agent_pid": os.getpid(), "since": now, "until": now + LEASE_S, "lease_s": LEASE_S,
                           "nonce": secrets.token_hex(8)}).encode()

    def _took(self, etag: str) -> None:
        self._etag, self._renewed, self.lost = etag, self.clock(), None

    def acquire(self) -> Optional[str]:
        """None when this job holds the lease now; else a message naming the job that holds it."""
        if self.held:
            try:
                self.refresh()
                return None
            except LeaseLost:
                pass                      # taken over: this job may take it again only as any job may
        lease: Optional[Version] = None
        for _ in range(3):        # again after a lease vanished or changed under us (another job won that race)
            try:
                self._took(self.store.create_version(self.path, self._body()))
                return None
            except AlreadyCommitted:
                pass
            lease = self.store.read_version(self.path, _MAX_BYTES)
            if lease is None:
                continue
            holder, why = _parse(lease.data)
            mine = holder is not None and holder["job_id"] == self.job_id and self.own_ok
            if not mine and _remaining(holder, lease) > 0:
                return _describe(holder, why, lease)
            try:       # ours, or ended: replace exactly the version read, so only one job takes it
                self._took(self.store.put_if_match(self.path, self._body(), lease.etag))
                return None
            except ObjectChanged:
                continue
        if lease is None:
            return f"nobody: the lease {self.path} kept vanishing while this job tried to take it"
        holder, why = _parse(lease.data)
        return _describe(holder, why, lease)

    def refresh(self) -> None:
        """Renew the lease when a quarter of it has passed (the holder calls this while it has work). LeaseLost
        when another job took it over meanwhile (this one did not renew it for LEASE_S, by the store's clock)."""
        if self._etag is None:
            return
        since = self.clock() - self._renewed
        if 0 <= since < LEASE_S / 4:          # (a clock stepped back renews at once rather than never)
            return
        self._write(self._body())

    def release(self) -> None:
        """Delete the lease if it is still the version this job wrote (the module docstring says why that order is
        safe); a lease taken over meanwhile is left to its new holder."""
        if self._etag is None:
            return
        etag, self._etag = self._etag, None
        lease = self.store.read_version(self.path, _MAX_BYTES)
        if lease is not None and lease.etag.strip('"') == etag.strip('"'):
            self.store.delete(self.path)

    def _write(self, body: bytes) -> None:
        assert self._etag is not None
        try:
            self._took(self.store.put_if_match(self.path, body, self._etag))
        except ObjectChanged:
            self._etag = None
            try:
                lease = self.store.read_version(self.path, _MAX_BYTES)
            except OSError:
                lease = None
            if lease is None:
                now = "the lease object is gone (removed by someone else)"
            else:
                holder, why = _parse(lease.data)
                now = f"it is now held by {_describe(holder, why, lease)}"
            self.lost = (f"this job's lease on {self.path} was taken over while it ran (not renewed within "
                         f"{LEASE_S:g} s by the store's clock: an outage, a stalled agent): {now}; this job no "
                         f"longer commits there")
            raise LeaseLost(self.lost) from None


def _parse(data: bytes) -> Tuple[Optional[Dict[str, Any]], str]:
    """The lease's fields if the body is one easyckpt wrote, every field checked; else (None, why not)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:     # (not UTF-8, not JSON, nested thousands deep)
        return None, f"not JSON ({type(exc).__name__})"
    if not isinstance(body, dict):
        return None, "not a JSON object"
    checks: Dict[str, Tuple[Callable[[Any], bool], bool]] = {      # field -> (valid, required)
        "job_id": (lambda v: _text(v, 128) and bool(v), True),
        "job_name": (lambda v: v is None or _text(v, _MAX_TEXT), True),
        "host": (lambda v: _text(v, _MAX_TEXT), True),
        "agent_pid": (lambda v: _integer(v) and 0 < v <= _MAX_PID, True),
        "since": (lambda v: _number(v) and 0 <= v <= _MAX_TIME, True),
        "until": (lambda v: _number(v) and 0 <= v <= _MAX_TIME, True),
        "lease_s": (lambda v: _number(v) and 1 <= v <= MAX_LEASE_S, False),     # absent from older versions'
        "nonce": (lambda v: _text(v, 64), False),
    }
    for field, (valid, required) in checks.items():
        if field not in body:
            if required:
                return None, f"no {field!r}"
        elif not valid(body[field]):
            return None, f"{field}={_shown(body[field])} is not a valid value"
    if not 0 <= body["until"] - body["since"] <= MAX_LEASE_S:
        return None, f"until - since = {body['until'] - body['since']:.6g} s is out of range"
    return body, ""


def _text(v: Any, n: int) -> bool:
    return isinstance(v, str) and len(v) <= n and v.isprintable()


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return (isinstance(v, float) and math.isfinite(v)) or _integer(v)


def _shown(v: Any) -> str:
    text = ascii(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _remaining(holder: Optional[Dict[str, Any]], lease: Version) -> float:
    """Seconds until the lease ends, by the store's clock (0: ended). A lease runs LEASE_S, or the longer lease
    its holder declared, after its last write; whole-second times, so one second more. A store that gives no
    time (no Date header) leaves every lease running: it cannot be judged."""
    if lease.age is None:
        return math.inf
    lease_s = max(LEASE_S, float(holder.get("lease_s", LEASE_S))) if holder is not None else LEASE_S
    return max(0.0, lease_s + 1 - lease.age)


def _describe(holder: Optional[Dict[str, Any]], why: str, lease: Version) -> str:
    left = _remaining(holder, lease)
    runs = ("for as long as the store gives no time (no Date header)" if math.isinf(left)
            else f"{math.ceil(left)} s more unless renewed, by the store's clock")
    if holder is None:
        return (f"job ? (agent pid ? on ?; the lease object is not one easyckpt wrote: {why}; it counts as a running "
                f"lease {runs})")
    return (f"job {holder['job_name'] or holder['job_id']} (agent pid {holder['agent_pid']} on {holder['host']}; "
            f"its lease on the store runs {runs})")


def job_lock(storage: Storage, save_dir: str, job_id: str, job_name: Optional[str],
             own_ok: bool = True) -> Union[JobLock, StoreLock]:
    """One job per save dir (docs/reliability.md promise 8): a flock in a file system's save dir (joblock.py), a
    lease object on a store (``own_ok`` False: taken only when no lease runs, not even this job's own: prune)."""
    if storage.local:
        return JobLock(save_dir, job_id, job_name)
    if not isinstance(storage, Versioned):
        raise TypeError(f"{save_dir}: its store has no conditional writes (Versioned), which the job's lease needs")
    return StoreLock(storage, save_dir, job_id, job_name, own_ok=own_ok)
