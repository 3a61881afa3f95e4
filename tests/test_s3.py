"""The object-store back-end (easyckpt/storage/s3.py) against a real S3 server: Ceph's RADOS Gateway on
127.0.0.1, started once for this module by scripts/s3-server.sh (Debian's ceph-mon, ceph-osd and radosgw;
.ci/run installs them). No client library is mocked. Without those packages the tests are skipped, saying so.

What is proved here is the storage layer the persist and resume paths are to be built on: objects appear
whole; the commit's conditional create never replaces a committed manifest; a large object is a multipart
upload sent in parallel parts and read back by parallel ranged GETs; an unfinished upload is invisible and
aborted by ``abort_uploads``; deleting a step removes its manifest first and nothing outside its prefix; wrong
credentials, a missing bucket and an unreachable endpoint are refused with what to fix; a throttling store
(503 SlowDown from tests/s3throttle.py's proxy in front of the gateway) is retried a bounded number of times.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
import s3server

from easyckpt.errors import StoreError

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e .[s3])")


# ``store``: an S3Storage on the server and a fresh bucket, (storage, "s3://bucket")
server, store = s3server.fixtures(endpoint_env=False)


def test_objects_appear_whole_and_a_committed_manifest_is_never_replaced(store):
    from easyckpt.errors import AlreadyCommitted
    s, top = store
    manifest = f"{top}/job/step_00000005/easyckpt_manifest.json"
    s.create_exclusive(manifest, b'{"step": 5}')
    with pytest.raises(AlreadyCommitted, match="never replaced"):
        s.create_exclusive(manifest, b'{"step": 5, "other": true}')
    assert s.read(manifest) == b'{"step": 5}'
    s.write_atomic(f"{top}/job/latest", b"step_00000005")
    assert s.read(f"{top}/job/latest", 5, 3) == b"000" and s.read(f"{top}/job/latest", 8) == b"00005"
    assert s.listdir(f"{top}/job") == ["latest", "step_00000005"]
    assert s.is_dir(f"{top}/job/step_00000005") and not s.is_dir(f"{top}/job/step_00000006")
    assert s.exists(manifest) and not s.exists(f"{top}/job/step_00000006/easyckpt_manifest.json")
    with pytest.raises(FileNotFoundError):
        s.read(f"{top}/job/none")
    with pytest.raises(FileNotFoundError):
        s.listdir(f"{top}/nothing")


def test_a_large_object_is_a_parallel_multipart_upload_read_back_by_ranged_gets(store):
    s, top = store
    data = os.urandom(23 << 20)                  # 4 full parts of 5 MiB and a last one of 3 MiB
    path = f"{top}/job/step_00000001/rank_00000.safetensors"
    w = s.open_writer(path)
    view = memoryview(data)
    for i in range(0, len(data), 3 << 20):      # handed over in pieces that do not fall on part boundaries
        w.write(view[i:i + (3 << 20)])
    assert not s.exists(path), "an upload in progress must be invisible"
    w.finish()
    w.sync()
    w.close()
    assert w.size == len(data) and s.size(path) == len(data)
    assert s.read(path) == data
    ranges = [(0, 10), (5 << 20, 1 << 20), (len(data) - 7, 7)]
    assert s.read_ranges(path, ranges) == [data[o:o + n] for o, n in ranges]
    into = bytearray(3 << 20)       # a ranged GET straight into a buffer; at the end, only what the object holds
    assert s.read_into(path, 7 << 20, memoryview(into)) == 3 << 20 and into == data[7 << 20:10 << 20]
    assert s.read_into(path, len(data) - 5, memoryview(into)[:10]) == 5 and into[:5] == data[-5:]
    with pytest.raises(FileExistsError):
        s.open_writer(path)                       # objects are created once


@pytest.mark.parametrize("signed", ["0", "1"])
def test_parts_of_a_mapping_are_sent_from_it_not_copied_and_arrive_whole(store, server, monkeypatch, signed):
    """storage/s3writer.py: what comes through write_mapped (the snapshot's slot) goes into the request bodies
    as views of the mapping, never copied; small writes around it are copied (the caller may reuse them) and
    joined. Each body is read a piece at a time (one sendall each): the objects read back whole, and with the
    body's hash signed the gateway checks that hash over the same pieces."""
    import mmap

    from easyckpt.storage.s3 import S3Storage
    from easyckpt.storage.s3writer import Body
    monkeypatch.setenv("EASYCKPT_S3_SIGN_PAYLOAD", signed)
    s = S3Storage(endpoint_url=server["ENDPOINT"], part_bytes=5 << 20)
    _, top = store
    bodies = []
    s.c._c.meta.events.register("before-send.s3.UploadPart", lambda request, **_: bodies.append(request.body))
    data = os.urandom(23 << 20)
    mm = mmap.mmap(-1, len(data))
    view = memoryview(mm)
    try:
        view[:] = data
        w = s.open_writer(f"{top}/mapped")
        expect = b"head" * 25
        w.write(b"head" * 25)
        step = (3 << 20) + 7                 # pieces that do not fall on part boundaries
        for i in range(0, len(data), step):
            w.write_mapped(view, i, min(i + step, len(data)))
            w.write(b"|")
            expect += data[i:i + step] + b"|"
        for i in range(0, 100_000, 1000):          # small views (many small tensors) join a copied piece
            w.write_mapped(view, i, i + 1000)
            expect += data[i:i + 1000]
        w.finish()
        w.sync()
        w.close()
        assert s.read(f"{top}/mapped") == expect
        assert len(bodies) == 5 and all(isinstance(b, Body) for b in bodies)
        pieces = [p for b in bodies for p in b._pieces]
        from_map = [p for p in pieces if p.obj is mm]
        assert sum(len(p) for p in from_map) == len(data), "every large view of the mapping was sent from it"
        assert sum(len(p) for p in pieces) - len(data) == 100 + 8 + 100_000    # copies: the small writes and views
        # the last part: the end of two large views, a "|" after each, the small views joined to the last one
        assert len(bodies[-1]._pieces) == 4, "the small views were joined, not sent one by one"
        del from_map, pieces
    finally:
        bodies.clear()          # (the event handler keeps the list: its views must go before the mapping)
        view.release()
        mm.close()
    w = s.open_writer(f"{top}/empty")
    w.finish()
    w.sync()
    assert s.read(f"{top}/empty") == b""


def test_a_body_reads_piece_by_piece_and_rewinds_for_a_retry():
    from easyckpt.storage.s3writer import Body
    b = Body([bytearray(b"abc"), memoryview(b"defgh"), bytearray(b"")])
    assert len(b) == 8 and b.tell() == 0
    assert bytes(b.read(1024)) == b"abc" and bytes(b.read()) == b"defgh" and b.read() == b"" and b.tell() == 8
    assert b.seek(4) == 4 and bytes(b.read()) == b"efgh" and b.read() == b""     # from inside a piece
    assert b.seek(1) == 1 and bytes(b.read()) == b"bc" and bytes(b.read()) == b"defgh"
    assert b.seek(0, 2) == 8 and b.seek(-3, 1) == 5 and b.seek(0) == 0
    assert b"".join(iter(lambda: bytes(b.read(1 << 20)), b"")) == b"abcdefgh"
    assert len(Body([])) == 0 and Body([]).read() == b""


def test_a_whole_file_read_has_each_pieces_pages_made_present_by_the_thread_that_fills_it(store, monkeypatch):
    """S3Storage.read_hashed (storage/objectread.py): the bytes and checksum of a file read in several ranged GETs; its buffer's
    pages are made present piece by piece, each in the pool thread that then fills that piece (beside the other
    pieces' transfers), not all at once before the first GET."""
    import threading

    from easyckpt import pages
    from easyckpt.formats import manifest as mf
    from easyckpt.storage import objectread
    s, top = store
    monkeypatch.setattr(objectread, "PIECE", 1 << 20)
    calls, real = [], pages.populate_range

    def recording(mm, start, length):
        calls.append((start, length, threading.current_thread().name))
        return real(mm, start, length)
    monkeypatch.setattr(pages, "populate_range", recording)
    data = os.urandom((4 << 20) + 123)
    s.write_atomic(f"{top}/step/f.bin", data)
    buf, digest = s.read_hashed(f"{top}/step/f.bin", mf.ALGO, None, len(data))
    assert bytes(buf) == data and digest == mf.checksum(data)
    assert sorted((a, n) for a, n, _ in calls) == [(off, min(1 << 20, len(data) - off))
                                                   for off in range(0, len(data), 1 << 20)]
    assert all(name.startswith("easyckpt-s3") for *_, name in calls), calls


def test_the_read_verbs_of_the_storage_protocol_on_a_store(store):
    """Storage's read verbs on S3 (base.py): size, no owner (the bucket's policy), a range into the caller's buffer,
    several ranges at once, a whole file with and without its checksum, each short only at the object's end."""
    from easyckpt.formats import manifest as mf
    from easyckpt.storage.base import Storage, Versioned
    s, top = store
    assert isinstance(s, Storage) and isinstance(s, Versioned) and not s.local
    data = os.urandom((2 << 20) + 5)
    path = f"{top}/verbs/f.bin"
    s.write_atomic(path, data)
    assert s.size(path) == len(data) and s.owner(path) is None
    with pytest.raises(FileNotFoundError):
        s.size(f"{top}/verbs/none.bin")
    view = memoryview(bytearray(10))
    assert s.read_into(path, 7, view) == 10 and bytes(view) == data[7:17]
    assert s.read_into(path, len(data) - 4, view) == 4 and bytes(view[:4]) == data[-4:]
    assert [bytes(b) for b in s.read_ranges(path, [(0, 3), (1 << 20, 9), (len(data) - 2, 5)])] == \
        [data[:3], data[1 << 20:(1 << 20) + 9], data[-2:]]
    buf, digest = s.read_hashed(path, mf.ALGO)
    assert bytes(buf) == data and digest == mf.checksum(data)
    buf, digest = s.read_hashed(path)
    assert bytes(buf) == data and digest is None
    s.check(f"{top}/verbs")


def test_an_unfinished_upload_is_invisible_and_aborted_for_its_prefix(store):
    s, top = store
    path = f"{top}/job/step_00000002/rank_00001.safetensors"
    w = s.open_writer(path)
    w.write(os.urandom(11 << 20))               # two parts sent, the writer then "killed" (never finished)
    for _, f in w._parts:
        f.result()
    assert not s.exists(path)
    bucket = top[len("s3://"):]
    assert [u["Key"] for u in s.c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == \
        ["job/step_00000002/rank_00001.safetensors"]
    assert s.abort_uploads(f"{top}/job/step_00000002") == ["job/step_00000002/rank_00001.safetensors"]
    assert not s.c.list_multipart_uploads(Bucket=bucket).get("Uploads")


def _running(*futures, timeout=30.0):
    """Until each request handed to the store's pool is being sent (not merely queued)."""
    deadline = time.monotonic() + timeout
    while not all(f.running() or f.done() for f in futures):
        assert time.monotonic() < deadline, "a request handed to the pool never started"
        time.sleep(0.001)


def test_a_writer_given_up_has_nothing_in_flight_that_lands_after_its_step_is_cleaned_up(store):
    """A failed persist gives its other files' writers up (close) and its step's prefix is deleted next: when
    close returns, no request of the writer is still in flight. (Before, a small file's PUT sent side by side with
    the file that failed landed after the clean-up: an object left under a step no manifest commits.)"""
    s, top = store
    bucket = top[len("s3://"):]
    step = f"{top}/job/step_00000004"
    small = s.open_writer(f"{step}/model.safetensors")
    small.write(os.urandom((5 << 20) - 1))        # under the store's part size: one PUT, handed over by finish
    small.finish()
    _running(small._put)
    small.close()
    s.delete(step)                                # the failed step's clean-up, at once
    large = s.open_writer(f"{step}/rank_00000.safetensors")
    large.write(os.urandom(41 << 20))             # a multipart upload, its parts sent
    _running(*[f for _, f in large._parts])
    large.close()
    assert not s.c.list_multipart_uploads(Bucket=bucket).get("Uploads"), "close left its upload unaborted"
    time.sleep(1.0)
    left = [o["Key"] for o in s.c.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not left, f"an object landed after its step was cleaned up: {left}"
    with pytest.raises(RuntimeError, match="given up"):
        small.sync()                              # a writer given up never reports its object whole


def test_a_batch_delete_that_keeps_an_object_is_a_store_error_naming_it(store):
    """DeleteObjects answers 200 and lists the keys it did not delete: each is a failure (a prune or a clean-up
    must not log a deleted step that is still there). The gateway refuses one key by a bucket policy."""
    s, top = store
    bucket = top[len("s3://"):]
    for rel in ("step_00000003/rank_00000.safetensors", "step_00000003/locked"):
        s.write_atomic(f"{top}/job/{rel}", b"x")
    s.c.put_bucket_policy(Bucket=bucket, Policy=json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Deny", "Principal": "*", "Action": "s3:DeleteObject",
         "Resource": f"arn:aws:s3:::{bucket}/job/step_00000003/locked"}]}))
    try:
        with pytest.raises(StoreError, match="step_00000003/locked: AccessDenied"):
            s.delete(f"{top}/job/step_00000003")
        with pytest.raises(StoreError, match="step_00000003/locked: AccessDenied"):
            s.delete_files([f"{top}/job/step_00000003/locked"])
    finally:
        s.c.delete_bucket_policy(Bucket=bucket)
    assert s.listdir(f"{top}/job/step_00000003") == ["locked"]


def test_files_deleted_by_name_go_in_one_request_and_nothing_else_does(store):
    """delete_files (the commit's markers and claim, storage/commit.py): exactly the objects named, in one batch
    request, a missing one no error; a name that is a prefix is refused, never listed and deleted."""
    s, top = store
    for rel in ("a/one", "a/two", "a/three", "a/one.keep"):
        s.write_atomic(f"{top}/{rel}", b"x")
    sent = []
    s.c._c.meta.events.register("before-send.s3.*", lambda request, **_: sent.append(request.method))
    s.delete_files([f"{top}/a/one", f"{top}/a/two", f"{top}/a/never"])
    assert sent == ["POST"] and s.listdir(f"{top}/a") == ["one.keep", "three"]
    with pytest.raises(ValueError, match="not an object's name"):
        s.delete_files([f"{top}/a/"])
    assert s.listdir(f"{top}/a") == ["one.keep", "three"]


def test_deleting_a_step_takes_its_manifest_first_and_nothing_outside_its_prefix(store):
    s, top = store
    for rel in ("step_00000003/easyckpt_manifest.json", "step_00000003/rank_00000.safetensors",
                "step_00000003/sub/part", "step_000000031/keep", "foreign/object"):
        s.write_atomic(f"{top}/job/{rel}", rel.encode())
    deleted = []
    original = s.c.delete_object

    def watch(**kw):
        deleted.append(kw["Key"])
        return original(**kw)
    s.c.delete_object = watch
    try:
        s.delete(f"{top}/job/step_00000003")
    finally:
        s.c.delete_object = original
    assert deleted[0] == "job/step_00000003/easyckpt_manifest.json", deleted
    assert s.listdir(f"{top}/job") == ["foreign", "step_000000031"]
    with pytest.raises(ValueError, match="whole bucket"):
        s.delete(top)


def test_wrong_credentials_a_missing_bucket_and_no_endpoint_are_refused_naming_what_to_fix(store, server):
    from botocore.config import Config as BotoConfig

    from easyckpt.errors import ConfigError
    from easyckpt.storage.s3 import S3Storage
    s, top = store
    s.check(top)
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-easyckpt' does not exist"):
        s.check("s3://no-such-bucket-easyckpt/ckpt")
    wrong = S3Storage(endpoint_url=server["ENDPOINT"], c=boto3.client(
        "s3", endpoint_url=server["ENDPOINT"], aws_access_key_id="WRONGKEY", aws_secret_access_key="wrong",
        region_name="us-east-1", config=BotoConfig(retries={"max_attempts": 1})))
    with pytest.raises(ConfigError, match="credentials were refused"):
        wrong.check(top + "/ckpt")
    nowhere = S3Storage(endpoint_url="http://127.0.0.1:9", c=boto3.client(
        "s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
        config=BotoConfig(retries={"max_attempts": 1}, connect_timeout=2)))
    with pytest.raises(ConfigError, match="endpoint does not answer"):
        nowhere.check("s3://bucket/ckpt")


def test_a_bodys_hash_is_signed_only_over_plain_http_to_another_host_and_the_gateway_takes_either(store, server,
                                                                                                    monkeypatch):
    """storage/s3client.client: no per-request CRC32 (the manifest's checksums are checked by every load), and the
    body's SHA-256 signed only where nothing else guards the bytes in transit. What goes on the wire is read from
    botocore's own before-send event; the gateway checks a signed body's hash, so the signed round trip proves
    the hash is the body's."""
    from easyckpt.errors import ConfigError
    from easyckpt.storage.s3 import S3Storage
    from easyckpt.storage.s3client import sign_payload
    assert not sign_payload("https://s3.us-east-1.amazonaws.com")          # TLS guards the bytes
    assert not sign_payload("http://127.0.0.1:7480") and not sign_payload("http://[::1]:9000")
    assert not sign_payload("http://localhost:9000")                      # nothing crosses a network
    assert sign_payload("http://10.0.0.5:7480") and sign_payload("http://rgw.cluster:80")
    _, top = store
    for forced, signed in (("", False), ("1", True), ("0", False)):
        monkeypatch.setenv("EASYCKPT_S3_SIGN_PAYLOAD", forced)
        s = S3Storage(endpoint_url=server["ENDPOINT"], part_bytes=5 << 20)
        sent = []
        s.c._c.meta.events.register("before-send.s3.*", lambda request, **_: sent.append(dict(request.headers)))
        body = os.urandom(1 << 20)
        s.write_atomic(f"{top}/sig{forced}/one", body)
        assert s.read(f"{top}/sig{forced}/one") == body
        put = next(h for h in sent if h.get("Content-Length") == str(len(body)))
        assert not any(k.lower().startswith("x-amz-checksum") for k in put), put
        hashed = put["X-Amz-Content-SHA256"]
        assert (hashed == hashlib.sha256(body).hexdigest().encode()) is signed, (forced, hashed)
        assert signed or hashed == b"UNSIGNED-PAYLOAD"
    monkeypatch.setenv("EASYCKPT_S3_SIGN_PAYLOAD", "yes")
    with pytest.raises(ConfigError, match="EASYCKPT_S3_SIGN_PAYLOAD='yes': expected 1"):
        S3Storage(endpoint_url=server["ENDPOINT"])


def test_one_job_per_prefix_a_lease_object_taken_with_a_conditional_create(store, monkeypatch):
    """storage/storelock.py: of two jobs one holds the lease and the other is refused naming it; the holder's
    restart takes its own lease over; a lease whose holder died ends LEASE_S after its last renewal, by the store's
    clock; an operator tool takes none while one runs; a released lease is taken at once; a body that is not ours
    counts as a running lease until it is old."""
    from easyckpt.storage import storelock
    from easyckpt.storage.storelock import StoreLock
    s, top = store
    monkeypatch.setattr(storelock, "LEASE_S", 4.0)      # leases that end within seconds of the store's clock
    now = [1000.0]          # the hosts' clock paces the renewals only
    a = StoreLock(s, f"{top}/job", "aaaaaaaaaaaa", "a", clock=lambda: now[0])
    b = StoreLock(s, f"{top}/job", "bbbbbbbbbbbb", "b", clock=lambda: now[0])
    assert a.acquire() is None and a.held
    refused = b.acquire()
    assert refused is not None and refused.startswith("job a (agent pid") and not b.held
    restarted = StoreLock(s, f"{top}/job", "aaaaaaaaaaaa", "a", clock=lambda: now[0])
    assert restarted.acquire() is None                    # a's restart
    assert StoreLock(s, f"{top}/job", "aaaaaaaaaaaa", None, own_ok=False, clock=lambda: now[0]).acquire() \
        is not None                                           # `easyckpt prune` while the job runs: refused
    time.sleep(3)
    now[0] += 3
    restarted.refresh()                                   # renewed: b is still refused after the first lease
    time.sleep(2.5)
    assert b.acquire() is not None
    time.sleep(storelock.LEASE_S + 1.5)                   # a died without releasing: its lease ended
    assert b.acquire() is None and b.held
    b.release()
    assert not s.exists(f"{top}/job/.easyckpt.lock")
    c = StoreLock(s, f"{top}/job", "cccccccccccc", "c")
    s.write_atomic(f"{top}/job/.easyckpt.lock", b"\xff not json")
    assert "job ?" in (c.acquire() or "")                 # planted garbage: a running lease of someone unknown


# a lease a job wrote, as easyckpt writes them (its own fields differ per test)
def _lease(**fields) -> bytes:
    body = {"job_id": "dddddddddddd", "job_name": "d", "host": "node7", "agent_pid": 7, "since": time.time(),
            "until": time.time() + 120}
    body.update(fields)
    return json.dumps(body).encode()


def test_a_lease_with_a_field_not_finite_or_of_the_wrong_type_is_a_running_lease_of_an_unknown_holder(
        store, monkeypatch):
    """issue 49 item 8: a lease object with "until": 1e400 crash-looped every agent (OverflowError: cannot convert
    float infinity to integer), and one with NaN or -1e400 was taken over at once although it had just been
    written. Every field is checked: a body with any bad field counts as a running lease of an unknown holder
    (its fields never shown as if they were a job's) until the object is LEASE_S old by the store's clock, then
    it is taken over."""
    from easyckpt.storage import storelock
    from easyckpt.storage.storelock import StoreLock
    s, top = store
    monkeypatch.setattr(storelock, "LEASE_S", 2.0)
    bodies = {"inf": b'{"job_id": "dddddddddddd", "job_name": "d", "host": "h", "agent_pid": 7, "since": 1000, '
                     b'"until": 1e400}',
              "nan": _lease(until=float("nan")), "minus-inf": _lease(until=float("-inf")),
              "text": _lease(until="soon"), "pid-inf": _lease(agent_pid=float("inf")),
              "pid-huge": _lease(agent_pid=2**80), "id-number": _lease(job_id=5),
              "id-newline": _lease(job_id="dddd\nrank 0"), "name-long": _lease(job_name="x" * 5000),
              "since-after-until": _lease(since=time.time() + 10**6), "nested": b"[" * 4000}
    for name, body in bodies.items():
        s.write_atomic(f"{top}/{name}/.easyckpt.lock", body)
    t0 = time.monotonic()
    for name in bodies:
        lock = StoreLock(s, f"{top}/{name}", "cccccccccccc", "c")
        refused = lock.acquire()
        assert refused is not None and refused.startswith("job ? (agent pid ? on ?; the lease object is not one "
                                                          "easyckpt wrote"), (name, refused)
        assert "counts as a running lease" in refused and not lock.held, (name, refused)
    assert time.monotonic() - t0 < 1.5, "the checks above took too long to prove the leases still ran"
    time.sleep(storelock.LEASE_S + 1.5)                   # old by the store's clock: ended, whatever it says
    for name in bodies:
        lock = StoreLock(s, f"{top}/{name}", "cccccccccccc", "c")
        assert lock.acquire() is None and lock.held, name
        assert json.loads(s.read(f"{top}/{name}/.easyckpt.lock"))["job_id"] == "cccccccccccc"


def test_a_job_whose_clock_is_a_day_off_cannot_take_over_a_running_lease(store):
    """issue 49 item 8: a second job whose clock was one day ahead took over a RUNNING job's lease (it compared
    its own clock with the holder's "until"), and both committed to one prefix. A lease's age is the store's to
    tell (Last-Modified against the Date of the same reply): a job a day ahead, or a holder a day behind,
    changes nothing."""
    from easyckpt.storage.storelock import StoreLock
    s, top = store
    day = 86400.0
    a = StoreLock(s, f"{top}/job", "aaaaaaaaaaaa", "a", clock=lambda: time.time() - day)    # the holder: behind
    assert a.acquire() is None
    for offset in (day, 0.0, -day):
        b = StoreLock(s, f"{top}/job", "bbbbbbbbbbbb", "b", clock=lambda: time.time() + offset)
        refused = b.acquire()
        assert refused is not None and refused.startswith("job a (agent pid") and not b.held, (offset, refused)
    assert json.loads(s.read(f"{top}/job/.easyckpt.lock"))["job_id"] == "aaaaaaaaaaaa"
    a.refresh()
    assert a.held


def test_two_jobs_taking_over_one_ended_lease_at_once_only_one_holds_it(store, monkeypatch):
    """Both read the ended lease before either writes (an interleaving forced here): the takeover is a PUT
    conditional on the version read (If-Match: its ETag), so the second write is refused and that job is refused
    naming the first. (Before: each deleted the lease it read and created its own; the second deleted the
    first's new lease, and both held it.)"""
    import threading

    from easyckpt.storage import storelock
    from easyckpt.storage.s3 import S3Storage
    from easyckpt.storage.storelock import StoreLock
    s, top = store
    monkeypatch.setattr(storelock, "LEASE_S", 2.0)
    s.write_atomic(f"{top}/job/.easyckpt.lock", _lease(since=time.time() - 1000, until=time.time() - 900))
    time.sleep(storelock.LEASE_S + 1.5)                  # its holder died: the lease ended
    both_read, first_done = threading.Barrier(2, timeout=60), threading.Event()
    outcome = {}

    def race(job: str, first: bool) -> None:
        racer = S3Storage(endpoint_url=s.endpoint_url)      # a client of its own, as another job's
        real, reads = racer.c.get_object, []

        def get_object(**kw):
            reply = real(**kw)
            reads.append(kw)
            if len(reads) == 1:          # the lease read: both have it before either writes, then one writes first
                both_read.wait()
                if not first:
                    assert first_done.wait(60)
            return reply
        racer.c.get_object = get_object
        lock = StoreLock(racer, f"{top}/job", job * 12, job)
        try:
            outcome[job] = (lock.acquire(), lock.held)
        finally:
            if first:
                first_done.set()

    threads = [threading.Thread(target=race, args=(job, job == "a"), daemon=True) for job in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and set(outcome) == {"a", "b"}, outcome
    assert outcome["a"] == (None, True), outcome
    assert outcome["b"][1] is False and outcome["b"][0].startswith("job a (agent pid"), outcome
    assert json.loads(s.read(f"{top}/job/.easyckpt.lock"))["job_id"] == "a" * 12


def test_a_holder_whose_lease_was_taken_over_learns_it_at_its_next_renewal_and_commits_no_more(store, tmp_path,
                                                                                                   monkeypatch):
    """A holder that did not renew for LEASE_S (an outage, a stalled agent) lost its lease to another job. Its
    next renewal, a PUT conditional on the version it last wrote, is refused: it no longer holds the lease, says
    which job does, and the agent's commits are refused naming why. (Before: the renewal wrote over the other
    job's lease, which flipped between the two jobs, both committing to one prefix.)"""
    from easyckpt.agent.jobdir import JobDir
    from easyckpt.config import Config
    from easyckpt.storage import storelock
    from easyckpt.storage.auditlog import AuditLog
    from easyckpt.storage.storelock import StoreLock
    s, top = store
    monkeypatch.setattr(storelock, "LEASE_S", 2.0)
    cfg = Config(save_dir=f"{top}/job", local_dir=str(tmp_path), endpoint_url=s.endpoint_url)
    jobdir = JobDir(cfg, AuditLog(None, "agent"))
    now = [1000.0]
    a = jobdir.lock()
    a.clock = lambda: now[0]
    assert a.acquire() is None and a.held
    time.sleep(storelock.LEASE_S + 1.5)                   # a stalls: no renewal
    b = StoreLock(s, f"{top}/job", "bbbbbbbbbbbb", "b")
    assert b.acquire() is None and b.held
    now[0] += storelock.LEASE_S                           # a's renewal is due
    try:
        a.refresh()
        lost = None
    except Exception as exc:  # noqa: BLE001 - what it raises is checked below
        lost = exc
    assert not a.held and type(lost).__name__ == "LeaseLost", lost
    assert "was taken over" in str(lost) and "held by job b (agent pid" in str(lost), lost
    assert json.loads(s.read(f"{top}/job/.easyckpt.lock"))["job_id"] == "bbbbbbbbbbbb"    # b's, untouched
    with pytest.raises(Exception, match="step 7 was not committed: this job's lease .* was taken over"):
        jobdir.commit(7, 1)
    a.release()                                           # no longer held: writes nothing
    assert json.loads(s.read(f"{top}/job/.easyckpt.lock"))["job_id"] == "bbbbbbbbbbbb"
    assert b.acquire() is None and b.held                 # b renews its own lease


def test_a_step_set_aside_is_copied_whole_manifest_last_then_removed(store):
    s, top = store
    src, dst = f"{top}/job/step_00000003", f"{top}/job/quarantined-step_00000003-1"
    files = {"easyckpt_manifest.json": b'{"step": 3}', "model.safetensors": os.urandom(6 << 20), "sub/x.pt": b"x"}
    for rel, data in files.items():
        s.write_atomic(f"{src}/{rel}", data)
    copied = []
    original = s.c.copy
    s.c.copy = lambda **kw: (copied.append(kw["Key"]), original(**kw))[1]    # the order of the copies, seen
    try:
        s.set_aside(src, dst)
    finally:
        del s.c.copy
    assert copied[-1].endswith("/easyckpt_manifest.json") and len(copied) == 3
    assert not s.is_dir(src) and {rel: s.read(f"{dst}/{rel}") for rel in files} == files
    s.write_atomic(f"{src}/model.safetensors", b"again")
    with pytest.raises(FileExistsError):
        s.set_aside(src, dst)                  # never onto a name that is taken
    assert s.read(f"{src}/model.safetensors") == b"again"


def test_a_hung_gateway_is_a_store_error_naming_the_request_and_the_store_serves_again_after(store, server):
    """A gateway that takes connections and never answers (frozen with SIGSTOP: a hang, a partition): a request
    of a client that tries once times out as a StoreError naming the request, which the agent's loop survives
    as an outage. (A timeout's exception carries ``response=None``; reading the store's error code from it
    raised AttributeError, which killed the agent at its next lease request, and every agent after it.)"""
    from easyckpt.errors import StoreError
    from easyckpt.storage.s3 import S3Storage
    from easyckpt.storage.s3client import Patience
    s, top = store
    quick = S3Storage(endpoint_url=server["ENDPOINT"], patience=Patience(attempts=1, connect_timeout=2,
                                                                         read_timeout=2))
    s3server.gateway(server, "pause")
    try:
        with pytest.raises(StoreError, match=r"put_object s3://.*/lease: ReadTimeoutError"):
            quick.create_exclusive(f"{top}/lease", b"ours")
    finally:
        s3server.gateway(server, "resume")
    quick.write_atomic(f"{top}/after", b"served")
    assert s.read(f"{top}/after") == b"served"


def test_a_marker_the_agent_wrote_is_seen_at_once_not_after_the_next_poll(store, tmp_path, monkeypatch):
    """On a store the agent's loop reads a step's markers at most every POLL_S (each read is a LIST and GETs). A
    persist's result makes the next read go to the store again: the answer of the previous poll lacked the marker
    just written, and the step then committed a tick later (up to 0.25 s more from save to durable)."""
    from types import SimpleNamespace

    from easyckpt.agent import jobdir as jobdir_module
    from easyckpt.agent.jobdir import JobDir
    from easyckpt.config import Config
    from easyckpt.storage.auditlog import AuditLog
    s, top = store
    # the loop's clock stands still: every read below is within POLL_S of the first, however loaded the machine
    monkeypatch.setattr(jobdir_module, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    cfg = Config(save_dir=f"{top}/job", local_dir=str(tmp_path), endpoint_url=s.endpoint_url)
    jobdir = JobDir(cfg, AuditLog(None, "agent"))
    jobdir.begin(7)
    assert jobdir.shards(7) == set()
    jobdir.write_marker(7, 0, {}, {})
    assert jobdir.shards(7) == set()          # within POLL_S: the last poll's answer
    jobdir.marker_written(7)
    assert jobdir.shards(7) == {0}            # read again


def test_a_throttling_store_is_retried_with_backoff_and_one_that_keeps_throttling_fails_naming_it(store, server):
    """503 SlowDown (the store's throttling answer), from a proxy in front of the real gateway (tests/s3throttle.py):
    a few refused requests are retried and the objects arrive whole, a multipart upload's parts too; a store that
    keeps refusing fails the request after the client's bounded attempts (5), naming SlowDown."""
    from s3throttle import ThrottlingProxy

    from easyckpt.storage.s3 import S3Storage
    from easyckpt.storage.s3client import Patience
    _, top = store
    with ThrottlingProxy(server["ENDPOINT"]) as proxy:
        s = S3Storage(endpoint_url=proxy.url, part_bytes=5 << 20, parallel=2)
        proxy.refuse(3)
        s.write_atomic(f"{top}/job/small", b"x" * 1000)
        assert proxy.refused == 3 and s.read(f"{top}/job/small") == b"x" * 1000
        data = os.urandom(12 << 20)             # three parts
        proxy.refuse(2)
        w = s.open_writer(f"{top}/job/large")
        w.write(memoryview(data))
        w.finish()
        w.sync()
        w.close()
        assert proxy.refused == 5 and s.read(f"{top}/job/large") == data
        proxy.refuse(1000)
        fresh = S3Storage(endpoint_url=proxy.url, patience=Patience(attempts=5))   # new connections only
        with pytest.raises(OSError, match="SlowDown"):
            fresh.read(f"{top}/job/small")
        assert proxy.refused == 5 + 5, proxy.refused


def test_sizes_of_a_step_on_a_store_come_from_one_listing_not_a_request_per_file(store, server, monkeypatch):
    """issue 49 item 9: a manifest of 30,000 files made `easyckpt ls` take 46 s on a store, one HEAD per file.
    check_sizes (what `ls` and the loader's cheap check run) lists the step's prefix once; a missing or
    truncated object is still named."""
    from easyckpt.formats import manifest as mf
    from easyckpt.storage import stepfiles
    s, top = store
    monkeypatch.setenv("AWS_ENDPOINT_URL", server["ENDPOINT"])     # the store stepfiles resolves from the URL
    step = f"{top}/step_00000001"
    files = {f"part-{i:03d}.bin": mf.FileEntry(size=i + 1) for i in range(60)}
    for rel, entry in files.items():
        s.write_atomic(f"{step}/{rel}", b"x" * entry.size)
    man = mf.build(1, "0123456789ab", "pytorch", 1, files)
    heads = []
    monkeypatch.setattr(type(s), "size", lambda self, path: heads.append(path) or 0)
    assert stepfiles.check_sizes(step, man) == [] and heads == []
    s.delete_files([f"{step}/part-007.bin"])
    s.write_atomic(f"{step}/part-009.bin", b"x")
    problems = stepfiles.check_sizes(step, man)
    assert len(problems) == 2 and "part-007.bin: missing" in problems and "part-009.bin" in problems[1], problems
