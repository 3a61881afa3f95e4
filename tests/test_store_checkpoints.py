"""Checkpoints in an object store (save_dir="s3://", "gs://" or "az://bucket/prefix"), end to end against a real
server of each (tests/stores.py: Ceph's RADOS Gateway, fake-gcs-server, Azurite, on 127.0.0.1), every case run on
the three stores (a case skips a store only where its emulator cannot do what the case needs, saying why): the
real training loop under torchrun (2 ranks, gloo), the real
node agent persisting from shared memory to the store, the real loader resuming from it. Nothing is mocked.

- a job killed with kill -9 resumes from the store with the losses of an uninterrupted run; retention keeps
  max_ckpt_num steps there and leaves foreign objects under the prefix alone;
- an agent killed in the middle of a multipart upload leaves no visible step; the job's next agent aborts the
  upload and deletes the step's objects, and the job then commits again;
- the store stopped for 30 s mid-run, then started again: training never stops, each step that could not be
  persisted meanwhile is said on rank 0's console, persisting resumes when the store is back and the run ends
  with its last step committed;
- a full bucket (the gateway's quota): each step that does not fit fails cleanly, said on the console, leaving
  nothing behind; older steps are unharmed and not pruned; training goes on, and commits again once there is room;
- wrong credentials are refused at initialisation, before the first iteration, naming what to fix;
- a fresh start (on_no_valid_checkpoint="start_fresh") over steps in the store that no rank can restore sets them
  aside whole under quarantine names (copied in the store, then removed), and the new run commits its own;
- the local tier (save_local_interval) beside the store: after a reboot (the agent and the trainers killed at
  once, the node's shared memory gone), the job resumes from the tier's step, newer than the store's, with the
  losses of an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import stores
from harness import (
    TRAIN,
    SHM,
    assert_losses_equal,
    cli,
    events,
    job_id,
    kill_tree,
    losses,
    run,
    script_cmd,
    start,
    starts,
    train_cmd,
    wait_for_iteration,
    wait_no_agent,
)

FAST = ["--idle-timeout", "1"]


server, bucket = stores.fixtures()     # each store's session server (params s3, gcs, azure), a bucket per test


@pytest.fixture(autouse=True)
def _client_installed(server):
    if server.name == "s3":
        pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e .[s3])")


def _cmd(url: str, local: Path, nproc: int, *args: str):
    # train_cmd's save dir is a path; an s3:// URL goes through as the string it is
    return train_cmd(url, nproc, "--local-dir", str(local), *FAST, *args)   # type: ignore[arg-type]


def _keys(store, url: str):
    return sorted(name for name, _ in store.files(url))


def _committed(keys):
    return sorted(int(k.split("/")[0].split("_")[1]) for k in keys
                  if k.startswith("step_") and k.endswith("/easyckpt_manifest.json"))


def test_a_job_killed_with_kill_9_resumes_from_the_store_with_an_uninterrupted_runs_losses(bucket, tmp_path):
    store, top = bucket
    url, local = f"{top}/run", tmp_path / "local"
    ref = tmp_path / "ref"
    run(train_cmd(tmp_path / "ref-ckpt", 2, "--iters", "16", "--storage-interval", "4", "--loss-file", str(ref),
                  *FAST))
    wait_no_agent(tmp_path / "ref-ckpt")
    # foreign objects under the prefix: a note, and a step-named prefix with no manifest and no claim of ours
    store.write_atomic(f"{url}/NOTES.txt", b"not easyckpt's")
    store.write_atomic(f"{url}/step_00000002/theirs.bin", b"someone else's half-written step")

    loss = tmp_path / "loss"
    proc = start(_cmd(url, local, 2, "--iters", "14", "--storage-interval", "4", "--max-ckpt", "2",
                      "--loss-file", str(loss), "--step-sleep", "0.2"), log=tmp_path / "first.out")
    wait_for_iteration(loss, 9, proc)
    kill_tree(proc)                        # the trainers die; the agent persists their newest snapshot and leaves
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    first = _committed(_keys(store, url))
    assert first and max(first) >= 8, first

    second = run(_cmd(url, local, 2, "--iters", "14", "--storage-interval", "4", "--max-ckpt", "2",
                      "--loss-file", str(loss)))
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    resumed = starts(loss)[-1]
    assert resumed == max(first), (resumed, first)
    assert f"resumed step {resumed} from storage ({url}/step_{resumed:08d}" in second.stdout + second.stderr
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref, rank), 14, f"rank {rank}")

    keys = _keys(store, url)
    assert _committed(keys) == [12, 14], keys            # max_ckpt_num=2, pruned in the store
    assert "NOTES.txt" in keys and "step_00000002/theirs.bin" in keys, keys     # foreign: untouched
    assert not [k for k in keys if ".easyckpt-" in k], keys      # no claim or marker left behind
    deletes = [e for e in events(local / "easyckpt.log") if e["event"] == "delete"]
    assert deletes and all(e["path"].startswith(f"{url}/step_0000") for e in deletes), deletes

    # a damaged object of the newest step: `easyckpt verify` names it, the loader falls back to step 12
    victim = f"{url}/step_00000014/model.safetensors"
    data = bytearray(store.read(victim))
    data[-1] ^= 0xFF
    store.write_atomic(victim, bytes(data))
    verdict = cli("verify", url, expect=None)
    assert verdict.returncode != 0 and "step 14: DAMAGED" in verdict.stdout + verdict.stderr, verdict.stdout
    assert "model.safetensors" in verdict.stdout + verdict.stderr
    third = run(_cmd(url, local, 2, "--iters", "16", "--storage-interval", "4", "--max-ckpt", "2",
                     "--loss-file", str(loss)))
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    assert starts(loss)[-1] == 12, (third.stdout + third.stderr)[-3000:]
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref, rank), 16, f"rank {rank} after the fallback")
    # retention (max_ckpt_num=2) keeps the two newest verified steps; the damaged one goes, said why, only then
    assert _committed(_keys(store, url)) == [12, 16]
    gone = [e for e in events(local / "easyckpt.log") if e["event"] == "delete" and e["path"].endswith("step_00000014")]
    assert len(gone) == 1 and gone[0]["reason"].startswith("damaged"), gone


def _dcp_step(store, step: str):
    """A step in the store with a DCP data file of three items (two chunks of "w", an object), a .metadata and a
    file DCP's reader never opens; its manifest (not written: the copy is given it) and the data file's bytes."""
    from easyckpt.formats import manifest as mf
    parts = [b"a" * 1000, b"b" * 3000, b"c" * 500]
    ids = [["w", [0, 0], [2, 4]], ["w", [2, 0], [2, 4]], ["rng", None, None]]
    data, items, at = b"".join(parts), [], 0
    for part, ident in zip(parts, ids):
        items.append([at, len(part), mf.checksum(part), ident])
        at += len(part)
    listed = {"__0_0.distcp": data, ".metadata": b"md", "rank_00000.safetensors": b"r" * 700}
    for rel, blob in listed.items():
        store.write_atomic(f"{step}/{rel}", blob)
    files = {rel: {"size": len(blob), "checksum": mf.checksum(blob), "format": "raw"} for rel, blob in listed.items()}
    files["__0_0.distcp"].update(format="dcp", items=items)
    return mf.validate(mf.build(10, "job", "pytorch", 1, mf.parse_files(files)).to_json()), data


def _damage(store, url: str, at: int, data: bytes) -> None:
    damaged = bytearray(data)
    damaged[at] ^= 0xFF
    store.write_atomic(url, bytes(damaged))


def test_a_readers_copy_of_a_step_in_the_store_holds_only_the_items_asked_for_each_checked(bucket, tmp_path):
    """engine/scratch.py's local copy for a reader that opens paths, in-process against the real store: a DCP data
    file holds the items the load asks for at their offsets (the rest a hole), the files the reader does not
    open are not fetched, what the loader already fetched and checked is not fetched again, and a damaged item
    asked for fails the copy, naming it, with nothing left behind."""
    from easyckpt.engine import scratch
    from easyckpt.engine.load.dcp import boxes_of, reader_files, wanted_items
    from easyckpt.engine.load.reads import Fetched
    from easyckpt.errors import CheckpointError
    store, top = bucket
    step = f"{top}/job/step_00000010"
    man, data = _dcp_step(store, step)
    asked = wanted_items(boxes_of([("w", [3, 0], [1, 4])]), set())        # the second chunk only
    fetched: list = []
    here = scratch.local_copy(step, man, str(tmp_path / "copy"), asked, reader_files(), fetched.append)
    copy = tmp_path / "copy" / "__0_0.distcp"
    assert copy.read_bytes() == bytes(1000) + data[1000:4000] + bytes(500) and sum(fetched) == 3000 + 2
    assert (tmp_path / "copy" / ".metadata").read_bytes() == b"md"
    assert not (tmp_path / "copy" / "rank_00000.safetensors").exists()
    scratch.remove(here)

    # what the load fetched and checked (reads.Fetched: an item, a whole file) is written from memory, not fetched
    for kept in (Fetched(files={".metadata": b"md"}, items={"__0_0.distcp": {1: bytearray(data[1000:4000])}}),
                 Fetched(files={"__0_0.distcp": data})):
        fetched.clear()
        here = scratch.local_copy(step, man, str(tmp_path / "copy"), asked, reader_files(), fetched.append, kept)
        assert copy.read_bytes() == bytes(1000) + data[1000:4000] + bytes(500)
        assert (tmp_path / "copy" / ".metadata").read_bytes() == b"md"
        assert sum(fetched) + kept.reused == 3002 and kept.reused >= 3000, (fetched, kept.reused)
        assert not kept.files and not kept.items          # taken by the copy: memory given back
        scratch.remove(here)

    _damage(store, f"{step}/__0_0.distcp", 1500, data)
    with pytest.raises(CheckpointError, match=r"item 1 \(w, bytes 1000\.\.4000\).*corrupted"):
        scratch.local_copy(step, man, str(tmp_path / "copy"), asked, reader_files())
    assert not (tmp_path / "copy").exists()


def test_a_copy_that_fails_on_one_rank_fails_every_rank_before_any_reader_starts(bucket, tmp_path):
    """Checkpointer.staging, two ranks in this interpreter (tests/inproc.py: the real agent, thread-backed
    collectives): rank 1 asks for a damaged item, rank 0 for a sound one. The reader's load is a collective, so
    rank 0 must not start it alone: both get the error, naming rank 1 and the item; no copy is left."""
    from inproc import node, ranks

    from easyckpt.config import Config
    from easyckpt.engine.load.dcp import boxes_of, reader_files, wanted_items
    from easyckpt.engine.load.sources import Loaded
    from easyckpt.errors import CheckpointError
    store, top = bucket
    step = f"{top}/job/step_00000010"
    man, data = _dcp_step(store, step)
    _damage(store, f"{step}/__0_0.distcp", 1500, data)                   # inside item 1
    (tmp_path / "local").mkdir()
    cfg = Config(save_dir=f"{top}/job", local_dir=str(tmp_path / "local"), save_storage_interval=100)

    def body(ckpt, group):
        stage = ckpt.staging(Loaded(10, "storage", step, {}, 0, 0.0, man))
        asked = wanted_items(boxes_of([("w", [2 * group.rank, 0], [1, 4])]), set())
        try:
            with stage(asked, reader_files()) as here:
                return f"copied to {here}"
        except CheckpointError as exc:
            return str(exc)
        finally:
            ckpt.finalize(persist=False)

    with node(cfg) as local:
        said = ranks(cfg, local, 2, body)
    assert all("failed on rank 1" in s and "item 1 (w, bytes 1000..4000)" in s for s in said), said
    assert not [p.name for p in (tmp_path / "local").iterdir() if "restore" in p.name]


def test_fsdp2_killed_resumes_from_the_store_each_rank_fetching_its_own_shards_and_on_one_rank(bucket, tmp_path):
    """FSDP2 (the plain-PyTorch adapter, DCP's layout) on 2 ranks with its steps in the store: kill -9, the agent
    gone with its snapshots, then a resume from the store with the losses of an uninterrupted run. DCP's reader
    opens paths: each rank's local copy holds only the items its shards read (the audit log's ``staged``). The
    last step then resumes on one rank with the weights the run ended with (DCP reshards)."""
    import torch
    store, top = bucket
    url, local = f"{top}/fsdp", tmp_path / "local"
    common = ["--fsdp", "--hidden", "1024", "--iters", "16", "--storage-interval", "4"]   # shards, not overheads
    ref = tmp_path / "ref"
    run(train_cmd(tmp_path / "ref-ckpt", 2, *common, "--loss-file", str(ref), *FAST), timeout=300)
    wait_no_agent(tmp_path / "ref-ckpt")
    loss, final = tmp_path / "loss", tmp_path / "final.pt"
    proc = start(_cmd(url, local, 2, *common, "--loss-file", str(loss), "--step-sleep", "0.2"),
                 log=tmp_path / "first.out")
    wait_for_iteration(loss, 9, proc)
    kill_tree(proc)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")     # its snapshots gone: the store serves
    second = run(_cmd(url, local, 2, *common, "--loss-file", str(loss), "--dump-final", str(final)), timeout=300)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    resumed = starts(loss)[-1]
    assert resumed >= 8 and f"resumed step {resumed} from storage" in second.stdout + second.stderr, \
        (second.stdout + second.stderr)[-3000:]
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref, rank), 16, f"FSDP2 rank {rank} from the store")
    staged = [e for e in events(local / "easyckpt.log") if e["event"] == "staged"]
    assert sorted(e["rank"] for e in staged) == [0, 1] and all(e["step"] == resumed for e in staged), staged
    assert all(e["fetched"] + e["reused"] < 0.7 * e["listed"] for e in staged), staged
    # each rank checked the data file it saved, whole, on loading: its copy takes its items from there
    assert all(e["fetched"] < e["reused"] for e in staged), staged
    assert not [p.name for p in local.iterdir() if "restore" in p.name]     # the copies are removed

    loaded = tmp_path / "loaded.pt"
    one = run(script_cmd(TRAIN, 1, "--save-dir", url, "--local-dir", str(local), *common[:3], "--iters", "18",
                         "--storage-interval", "4", *FAST, "--loss-file", str(tmp_path / "one"),
                         "--dump-loaded", str(loaded), torchrun=True), timeout=300)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    assert starts(tmp_path / "one") == [16], (one.stdout + one.stderr)[-3000:]
    got, trained = torch.load(loaded, weights_only=True), torch.load(final, weights_only=True)
    assert set(got) == set(trained) and all(torch.equal(got[k], trained[k]) for k in trained)


def test_an_agent_killed_mid_upload_leaves_no_step_and_the_next_agent_removes_what_it_wrote(bucket, tmp_path):
    store, top = bucket
    url, local = f"{top}/run", tmp_path / "local"
    once = tmp_path / "once"
    once.mkdir()
    loss = tmp_path / "loss"
    # a state of ~25 MiB in 5 MiB parts: the agent dies after the first part of its first multipart upload
    env = {"EASYCKPT_FAULTS": "store.after_first_part=kill", "EASYCKPT_FAULT_ONCE_DIR": str(once),
           "EASYCKPT_S3_PART_MIB": "5"}
    proc = start(_cmd(url, local, 1, "--iters", "6", "--storage-interval", "3", "--hidden", "150000",
                      "--loss-file", str(loss), "--step-sleep", "0.3"), env, log=tmp_path / "out")
    try:
        assert proc.wait(timeout=240) == 0, (tmp_path / "out").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    assert (once / "store.after_first_part").exists(), "the fault did not fire"
    evs = events(local / "easyckpt.log")
    starts_ = [e for e in evs if e["event"] == "agent_start"]
    assert len(starts_) >= 2, "no new agent after the killed one"
    cleaned = [e for e in evs if e["event"] == "delete" and e.get("reason") == "unfinished uploads aborted"]
    assert cleaned and cleaned[0]["path"] == f"{url}/step_00000003", [e for e in evs if e["event"] == "delete"]
    keys = _keys(store, url)
    assert _committed(keys) == [6] or _committed(keys) == [3, 6], keys     # step 3 only if persisted again
    assert not store.abort_uploads(url), "an unfinished upload was left behind"
    assert not [k for k in keys if ".easyckpt-" in k], keys


def test_a_full_bucket_fails_the_step_cleanly_harms_nothing_older_and_persisting_resumes_with_room(
        bucket, server, tmp_path):
    """Row 4 on a store: steps 5 and 10 are committed; then the bucket is full (the gateway's quota leaves less
    room than a step). Training goes on to step 20; each refused persist is said (QuotaExceeded), leaves no
    object and no unfinished upload behind, nothing is pruned, and steps 5 and 10 stay byte-identical. With room
    again, the next run resumes step 10 and commits its own steps."""
    if server.quota is None:
        pytest.skip(f"{server.name}: the emulator has no quota, so a full bucket cannot be made")
    store, top = bucket
    name = top[len(server.scheme):]
    url, local, loss, log = f"{top}/run", tmp_path / "local", tmp_path / "loss", tmp_path / "audit.jsonl"
    common = ["--storage-interval", "5", "--max-ckpt", "2", "--hidden", "512", "--log-file", str(log),
              "--loss-file", str(loss)]
    run(_cmd(url, local, 1, "--iters", "10", *common))
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    before = {k: store.read(f"{url}/{k}") for k in _keys(store, url)}
    assert _committed(before) == [5, 10], sorted(before)
    used = sum(len(v) for v in before.values())
    step = sum(len(v) for k, v in before.items() if k.startswith("step_00000010/"))
    server.quota(name, used + step // 2)          # room for half a step
    try:
        out = run(_cmd(url, local, 1, "--iters", "20", *common), check=False)
        wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    finally:
        server.quota(name, None)
    text = out.stdout + out.stderr
    assert max(losses(loss)) == 20, "a full bucket must not stop training"
    assert out.returncode != 0 and "QuotaExceeded" in text, text[-3000:]      # finalize: the last step is not durable
    failed = {e["step"] for e in events(log) if e["event"] == "error" and "QuotaExceeded" in e.get("message", "")}
    assert {15, 20} <= failed, failed
    after = {k: store.read(f"{url}/{k}") for k in _keys(store, url)}
    assert after == before, "a refused step left objects behind, or an older step changed or was pruned"
    assert not store.abort_uploads(url), "an unfinished upload was left behind"

    again = run(_cmd(url, local, 1, "--iters", "20", *common))
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    said = again.stdout + again.stderr
    assert f"resumed step 10 from storage ({url}/step_00000010" in said, said[-3000:]
    assert _committed(_keys(store, url)) == [15, 20]


def test_wrong_credentials_are_refused_at_initialisation_naming_what_to_fix(bucket, server, tmp_path):
    if server.wrong_credentials is None:
        pytest.skip(f"{server.name}: the emulator has no authentication, so no key can be refused")
    env, variable = server.wrong_credentials
    _store, top = bucket
    loss = tmp_path / "loss"
    out = run(_cmd(f"{top}/run", tmp_path / "local", 1, "--iters", "3", "--loss-file", str(loss)), env, check=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "the credentials were refused" in text and variable in text, text[-3000:]
    assert not losses(loss), "training started before the store was checked"


def test_the_store_down_for_30_s_mid_run_stops_no_training_and_persisting_resumes_when_it_is_back(
        bucket, server, tmp_path):
    _store, top = bucket
    url, local, loss = f"{top}/run", tmp_path / "local", tmp_path / "loss"
    proc = start(_cmd(url, local, 2, "--iters", "120", "--storage-interval", "4", "--loss-file", str(loss),
                      "--step-sleep", "0.5"), log=tmp_path / "out")
    try:
        wait_for_iteration(loss, 10, proc)
        server.down()
        down_at = max(losses(loss))
        time.sleep(30)
        assert proc.poll() is None, "training stopped while the store was down"
        during = max(losses(loss))
        server.up()
        assert proc.wait(timeout=300) == 0, (tmp_path / "out").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        server.up()
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    out = (tmp_path / "out").read_text()
    assert during > down_at + 10, f"training stalled while the store was down: iterations {down_at} -> {during}"
    for rank in (0, 1):
        assert sorted(losses(loss, rank)) == list(range(1, 121)), f"rank {rank}: an iteration is missing"
    assert "was not committed" in out and "StoreError" in out, out[-3000:]     # said on the console
    evs = events(local / "easyckpt.log")
    commits = [e["step"] for e in evs if e["event"] == "commit"]
    assert 120 in commits and [s for s in commits if s > during], commits   # persisting resumed after the outage
    assert any(e["event"] == "error" and "does not answer" in e.get("message", "") for e in evs)
    assert sum(e["event"] == "agent_start" for e in evs) == 1, "the agent died while the store was down"


def test_two_jobs_on_one_prefix_the_second_is_refused_naming_the_first(bucket, tmp_path):
    """The first job's coordinator holds the prefix's lease (storage/storelock.py); a second job (another name)
    on the same prefix stops at initialisation naming it, writes nothing, and runs once the first is done."""
    store, top = bucket
    url = f"{top}/run"
    # the first runs 18 s: the second's start (a fresh Python, torch, the store) took longer than 8 s at a load of 6
    first = start(_cmd(url, tmp_path / "a", 1, "--iters", "60", "--job-name", "first", "--step-sleep", "0.3",
                       "--loss-file", str(tmp_path / "a-loss")), log=tmp_path / "a.out")
    try:
        wait_for_iteration(tmp_path / "a-loss", 3, first)
        second = run(_cmd(url, tmp_path / "b", 1, "--iters", "4", "--job-name", "second",
                          "--loss-file", str(tmp_path / "b-loss")), check=False)
        text = second.stdout + second.stderr
        assert second.returncode != 0 and f"save_dir {url} is in use by job first" in text, text[-3000:]
        assert not losses(tmp_path / "b-loss")
        assert first.wait(timeout=240) == 0, (tmp_path / "a.out").read_text()[-3000:]
    finally:
        if first.poll() is None:
            kill_tree(first)
    wait_no_agent(url, timeout=90, log=tmp_path / "a" / "easyckpt.log", job_name="first")
    assert not store.exists(f"{url}/.easyckpt.lock"), "the lease outlived its idle job"
    run(_cmd(url, tmp_path / "b", 1, "--iters", "4", "--job-name", "second", "--loss-file", str(tmp_path / "b-loss")))
    wait_no_agent(url, timeout=90, log=tmp_path / "b" / "easyckpt.log", job_name="second")
    assert sorted(losses(tmp_path / "b-loss")) == [1, 2, 3, 4]


def test_a_step_another_job_committed_under_the_prefix_is_refused_naming_that_job_not_advising_a_delete(bucket,
                                                                                                       tmp_path):
    """issue 51 item 4: job b after job a on one prefix, same cadence: b's steps 5 and 10 would be written in place
    over a's commits. Each is refused naming job 'a' (from its manifest) and advising a prefix of b's own or
    job_name='a', never a delete; a's objects are left as they were and b's last step commits."""
    store, top = bucket
    url = f"{top}/run"
    run(_cmd(url, tmp_path / "a", 1, "--iters", "10", "--storage-interval", "5", "--job-name", "a"))
    wait_no_agent(url, timeout=90, log=tmp_path / "a" / "easyckpt.log", job_name="a")
    theirs = ("step_00000005/", "step_00000010/")
    before = {k: store.read(f"{url}/{k}") for k in _keys(store, url) if k.startswith(theirs)}
    done = run(_cmd(url, tmp_path / "b", 1, "--iters", "12", "--storage-interval", "5", "--job-name", "b",
                    "--loss-file", str(tmp_path / "b-loss")))
    wait_no_agent(url, timeout=90, log=tmp_path / "b" / "easyckpt.log", job_name="b")
    text = done.stdout + done.stderr
    assert sorted(losses(tmp_path / "b-loss")) == list(range(1, 13)), text[-3000:]
    assert (f"{url}/step_00000005 holds step 5 of another job, job 'a' (job id ") in text, text[-3000:]
    assert ("an object store writes a step in place, so this job does not write over it. That checkpoint is not this "
            "job's to delete: give this job a prefix of its own; or, if this run continues job 'a', set job_name='a' "
            "to resume it") in text, text[-3000:]
    assert "prune or delete" not in text, text[-3000:]
    keys = _keys(store, url)
    assert _committed(keys) == [5, 10, 12]
    assert {k: store.read(f"{url}/{k}") for k in keys if k.startswith(theirs)} == before


def test_a_lease_object_with_until_1e400_refuses_the_job_naming_it_instead_of_crashing_every_agent(bucket, tmp_path):
    """issue 49 item 8: a lease object with "until": 1e400 crash-looped every agent (OverflowError) and rank 0
    failed after 60 s with "no easyckpt agent answered". A lease whose fields are not ours is a running lease of an
    unknown holder (storage/storelock.py): rank 0 is refused at once, saying so, and nothing is trained."""
    store, top = bucket
    url = f"{top}/run"
    store.write_atomic(f"{url}/.easyckpt.lock", b'{"job_id": "dddddddddddd", "job_name": "d", "host": "h", '
                                                b'"agent_pid": 7, "since": 1000, "until": 1e400}')
    t0 = time.monotonic()
    done = run(_cmd(url, tmp_path / "a", 1, "--iters", "4", "--loss-file", str(tmp_path / "loss")), check=False)
    text = done.stdout + done.stderr
    assert done.returncode != 0 and (f"save_dir {url} is in use by job ? (agent pid ? on ?; the lease object is not "
                                     f"one easyckpt wrote: until=inf is not a valid value") in text, text[-3000:]
    assert "no easyckpt agent answered" not in text and "OverflowError" not in text, text[-3000:]
    assert time.monotonic() - t0 < 45 and not losses(tmp_path / "loss")
    wait_no_agent(url, timeout=90, log=tmp_path / "a" / "easyckpt.log")
    assert json.loads(store.read(f"{url}/.easyckpt.lock"))["until"] == float("inf")     # left as it was


def test_after_a_reboot_the_local_tiers_newer_step_resumes_with_an_uninterrupted_runs_losses(bucket, tmp_path):
    store, top = bucket
    ref = tmp_path / "ref"
    run(train_cmd(tmp_path / "ref-ckpt", 2, "--iters", "16", "--storage-interval", "6", "--loss-file", str(ref),
                  *FAST))
    wait_no_agent(tmp_path / "ref-ckpt")
    url, local, loss = f"{top}/tier", tmp_path / "local", tmp_path / "loss"
    args = ["--iters", "16", "--storage-interval", "6", "--local-interval", "2", "--loss-file", str(loss)]
    proc = start(_cmd(url, local, 2, *args, "--step-sleep", "0.3"), log=tmp_path / "first.out")
    wait_for_iteration(loss, 11, proc)
    # a reboot: the agent first (it would persist the trainers' newest snapshot), the trainers, the node's memory
    jid = job_id(url)
    for e in events(local / "easyckpt.log"):
        if e["event"] == "agent_start" and e.get("job_id") == jid:
            try:
                os.kill(int(e["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    kill_tree(proc)
    wait_no_agent(url, timeout=30, log=local / "easyckpt.log")
    for name in os.listdir(SHM):
        if name.startswith(f"easyckpt-{jid}-"):
            os.unlink(SHM / name)
    stored = _committed(_keys(store, url))
    assert stored and max(stored) == 6, stored
    second = run(_cmd(url, local, 2, *args))
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    text = second.stdout + second.stderr
    resumed = starts(loss)[-1]
    assert resumed in (8, 10) and f"resumed step {resumed} from the local tier" in text, (resumed, text[-3000:])
    for rank in (0, 1):
        assert_losses_equal(losses(loss, rank), losses(ref, rank), 16, f"rank {rank} from the local tier")
    saved = [e for e in events(local / "easyckpt.log") if e["event"] == "tier_saved"]
    assert {e["rank"] for e in saved} == {0, 1} and all(e["step"] % 2 == 0 for e in saved), saved
    assert _committed(_keys(store, url))[-1] == 16      # the store goes on as before: the last step committed


def test_a_fresh_start_over_damaged_steps_in_the_store_sets_them_aside_whole(bucket, tmp_path):
    store, top = bucket
    url, local, loss = f"{top}/fresh", tmp_path / "local", tmp_path / "loss"
    run(_cmd(url, local, 2, "--iters", "8", "--storage-interval", "4"))
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    assert _committed(_keys(store, url)) == [4, 8]
    for step in (4, 8):
        victim = f"{url}/step_{step:08d}/model.safetensors"
        data = bytearray(store.read(victim))
        data[-1] ^= 0xFF
        store.write_atomic(victim, bytes(data))
    damaged = {k: store.read(f"{url}/{k}") for k in _keys(store, url) if k.startswith("step_")}

    refused = run(_cmd(url, local, 2, "--iters", "8", "--storage-interval", "4"), check=False)
    assert refused.returncode != 0 and "on_no_valid_checkpoint" in refused.stdout + refused.stderr
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    run(_cmd(url, local, 2, "--iters", "8", "--storage-interval", "4", "--start-fresh", "--loss-file", str(loss)))
    wait_no_agent(url, timeout=90, log=local / "easyckpt.log")
    assert starts(loss) == [0]
    keys = _keys(store, url)
    aside = {}
    for k in keys:
        if k.startswith("quarantined-step_"):
            name, rel = k.split("/", 1)
            aside.setdefault(name, {})[rel] = store.read(f"{url}/{k}")
    assert len(aside) == 2, sorted(aside)
    kept = {name.split("-")[1]: files for name, files in aside.items()}     # quarantined-step_N-<stamp>
    assert {f"{step}/{rel}": data for step, files in kept.items() for rel, data in files.items()} == damaged
    assert _committed(keys) == [4, 8]          # the new run's own steps, under their names
    assert "quarantined" in cli("ls", url).stdout
