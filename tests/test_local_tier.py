"""The local tier (Config.save_local_interval): each rank's snapshot copied to its node's disk by the agent, read
back by the loader when it is the newest state every rank has.

- storage/tierfiles.py on its own: a copy and its record written, listed, checked; a damaged, truncated or
  planted copy or record is passed over (and kept: readers delete nothing); pruning keeps the newest N steps
  and logs every delete;
- the engine and the real Agent in one interpreter (tests/inproc.py): 2 ranks with storage every 6 steps and
  the tier every 2; the agent and the node's memory then lost (a reboot): the resume takes the tier's step,
  newer than the store's, and trains on exactly as an uninterrupted run; with one rank's copy damaged, both
  ranks take the committed step instead and the damaged copy stays.
"""
from __future__ import annotations

import json
import mmap
import os
import time

import pytest
from harness import cli_json
from inproc import model_and_optimizer, node, ranks, run_steps, state, train_step

from easyckpt.config import Config, validate
from easyckpt.errors import ConfigError, ManifestError
from easyckpt.formats import tier as tf
from easyckpt.ipc import jobkey, shm
from easyckpt.storage import tierfiles
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.savedir import SaveDir

JOB = "0123456789ab"


def _verify(copy):
    """tierfiles.verify over the copy as the loader maps it."""
    with open(copy.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mem, memoryview(mem) as view:
        tierfiles.verify(copy, view)


def _write(where, step, rank=0, data=b"x" * 10000):
    mem = mmap.mmap(-1, len(data))
    mem.write(data)
    try:
        return tierfiles.write(where, tf.TierRecord(JOB, step, rank, 2, "", 0, "", ""), memoryview(mem),
                               lambda: None, direct=False)
    finally:
        mem.close()


def test_a_copy_is_listed_only_with_its_record_and_checked_against_it(tmp_path):
    where = str(tmp_path / tf.dir_name(JOB))
    record = _write(where, 4, data=os.urandom(20000))
    assert record.size == 20000 and record.checksum
    [copy] = tierfiles.listing(where, JOB, 0)
    assert copy.step == 4 and copy.record == record
    _verify(copy)
    assert tierfiles.listing(where, JOB, 1) == [] and tierfiles.listing(where, "ba9876543210", 0) == []

    with open(copy.path, "r+b") as f:       # one bit flipped: the checksum names it
        f.seek(123)
        byte = f.read(1)
        f.seek(123)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ManifestError, match="corrupted"):
        _verify(copy)
    assert os.path.exists(copy.path)        # a reader deletes nothing

    os.truncate(copy.path, 100)             # truncated: its size is not its record's, no longer listed
    log = AuditLog(str(tmp_path / "audit.log"), "test")
    assert tierfiles.listing(where, JOB, 0, log) == []
    log.close()
    assert "passed over" in (tmp_path / "audit.log").read_text()


@pytest.mark.parametrize("direct", [False, True])
def test_a_header_word_set_while_the_slot_is_copied_leaves_a_copy_that_matches_its_record(tmp_path, monkeypatch,
                                                                                          direct):
    """A persist of the same snapshot ends while the tier copies it, and sets its agent word in the slot's header
    (released): seen on a loaded machine, the copy held one value and its checksum the other, so the copy never
    matched its record and the next resume passed the tier over as damaged. The header is read once now."""
    mem = mmap.mmap(-1, 3 * 4096 + 100)
    mem.write(os.urandom(len(mem)))

    class PersistEndsMeanwhile(tierfiles.SequentialWriter):
        def write(self, data):            # (every path of the first 4096 bytes goes through write)
            n = super().write(data)
            mem[40:48] = bytes(range(8))  # the agent's word, set between the copy's reading and the checksum's
            return n
    monkeypatch.setattr(tierfiles, "SequentialWriter", PersistEndsMeanwhile)
    where = str(tmp_path / tf.dir_name(JOB))
    tierfiles.write(where, tf.TierRecord(JOB, 4, 0, 1, "", 0, "", ""), memoryview(mem), lambda: None, direct=direct,
                    volatile=4096)
    [copy] = tierfiles.listing(where, JOB, 0)
    _verify(copy)                         # before: ManifestError, "corrupted"
    mem.close()


def test_planted_records_and_copies_are_passed_over_without_blocking(tmp_path):
    where = str(tmp_path / tf.dir_name(JOB))
    _write(where, 2)
    # a record under step 6's name that describes step 2: refused (a name is ours only when its content agrees)
    with open(os.path.join(where, tf.record_name(2, 0)), "rb") as f:
        os.link(os.path.join(where, tf.copy_name(2, 0)), os.path.join(where, tf.copy_name(6, 0)))
        (tmp_path / "r6").write_bytes(f.read())
    os.rename(tmp_path / "r6", os.path.join(where, tf.record_name(6, 0)))
    # a FIFO as step 8's copy, with a record of the right size: never opened
    os.mkfifo(os.path.join(where, tf.copy_name(8, 0)))
    rec = json.loads(open(os.path.join(where, tf.record_name(2, 0))).read())
    rec["step"] = 8
    with open(os.path.join(where, tf.record_name(8, 0)), "w") as f:
        json.dump(rec, f)
    # a huge record for step 10
    with open(os.path.join(where, tf.record_name(10, 0)), "wb") as f:
        f.truncate(1 << 30)
    t0 = time.monotonic()
    assert [c.step for c in tierfiles.listing(where, JOB, 0)] == [2]
    assert time.monotonic() - t0 < 30
    with pytest.raises(ManifestError, match="exactly the fields"):
        tf.TierRecord.parse(b'{"step": 1}', JOB, 1, 0)
    with pytest.raises(ManifestError, match="under the name of job"):
        tf.TierRecord.parse(json.dumps(dict(rec, step=8)).encode(), JOB, 9, 0)


def test_a_tier_directory_others_can_write_is_passed_over_whole(tmp_path):
    where = str(tmp_path / tf.dir_name(JOB))
    _write(where, 2)
    os.chmod(where, 0o777)                 # anyone could have planted its records and copies
    log = AuditLog(str(tmp_path / "audit.log"), "test")
    assert tierfiles.listing(where, JOB, 0, log) == []
    log.close()
    assert "local tier passed over" in (tmp_path / "audit.log").read_text()
    os.chmod(where, 0o755)
    assert [c.step for c in tierfiles.listing(where, JOB, 0)] == [2]


def test_pruning_keeps_the_newest_steps_of_the_rank_and_logs_each_delete(tmp_path):
    where = str(tmp_path / tf.dir_name(JOB))
    for step in (2, 4, 6, 8):
        _write(where, step)
    _write(where, 6, rank=1)
    with open(os.path.join(where, tf.copy_name(3, 0)), "wb") as f:     # an unfinished copy (no record)
        f.write(b"half")
    log = AuditLog(str(tmp_path / "audit.log"), "test")
    assert tierfiles.prune(where, JOB, 0, 2, log) == [2, 3, 4]
    log.close()
    assert [c.step for c in tierfiles.listing(where, JOB, 0)] == [8, 6]
    assert [c.step for c in tierfiles.listing(where, JOB, 1)] == [6]     # another rank's: untouched
    deletes = [json.loads(ln) for ln in (tmp_path / "audit.log").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in deletes] == [("tier_delete", 2), ("tier_delete", 3), ("tier_delete", 4)]


def test_save_local_interval_must_be_a_multiple_of_the_memory_interval(tmp_path):
    with pytest.raises(ConfigError, match="save_local_interval=3 is not a multiple of save_mem_interval=2"):
        validate(Config(save_dir=str(tmp_path), save_mem_interval=2, save_storage_interval=4, save_local_interval=3))
    with pytest.raises(ConfigError, match="max_local_ckpt_num=0 must be a positive integer"):
        validate(Config(save_dir=str(tmp_path), save_local_interval=2, max_local_ckpt_num=0))


def test_an_agent_leaving_while_the_job_was_started_again_on_its_node_leaves_the_new_runs_memory_alone(tmp_path):
    """A job that ends is often started again at once (the next stage of the same run). The agent of the run that
    ended leaves after its trainers, its last copy to the tier taking seconds; meanwhile the new run's trainers
    start their own agent and reuse the job's slots and key. The leaving agent removed them all the same: the new
    run's memory snapshots out of reach, its late ranks refused. Now it leaves them to the agent that listens."""
    import socket

    from easyckpt.ipc import agentsocket
    cfg = validate(Config(save_dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), save_mem_interval=1,
                          save_storage_interval=4, save_local_interval=2, autocheckpoint_on_sigterm=False))

    def job(ckpt, group):
        return run_steps(ckpt, 4)

    # the new run's agent on the job's address (the in-process agent has none: its trainers reach it directly)
    new_agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        new_agent.bind(agentsocket.address(cfg.job_id))
        new_agent.listen(4)
        with node(cfg) as local:
            assert ranks(cfg, local, 2, job) == [4, 4]
            local.tick(30)          # (the tier may still be copying: the agent leaves after it)
            assert local.left
            slots = [shm.slot_path(cfg.job_id, rank, i) for rank in (0, 1) for i in (0, 1)]
            assert all(os.path.exists(p) for p in slots) and os.path.exists(jobkey.path(cfg.job_id))
        log = (tmp_path / "local" / "easyckpt.log").read_text()
        assert '"event": "shm_kept"' in log and '"event": "shm_release"' not in log, log
    finally:
        new_agent.close()
        _lose_the_node(cfg)

    # the same end with no other agent on the address: the job's memory and key go with its agent
    cfg = validate(Config(save_dir=str(tmp_path / "ckpt2"), local_dir=str(tmp_path / "local2"), save_mem_interval=1,
                          save_storage_interval=4, save_local_interval=2, autocheckpoint_on_sigterm=False))
    try:
        with node(cfg) as local:
            assert ranks(cfg, local, 2, job) == [4, 4]
            local.tick(30)          # (the tier may still be copying: the agent leaves after it)
            assert local.left
            assert shm.segments_of(cfg.job_id) == [] and not os.path.exists(jobkey.path(cfg.job_id))
    finally:
        _lose_the_node(cfg)


def test_a_trainer_whose_key_goes_while_its_agent_starts_makes_a_new_one_and_attaches(tmp_path, monkeypatch):
    """The other half of row 66: the previous run's agent, leaving, finds no agent listening (the new run's is
    still starting) and removes the job's key, which the new run's trainer had already read. Its agent then cannot
    start (no key), nor could any it started again: the trainer gave up after agent_start_timeout. Now the trainer
    reads the key at each try, makes a new one when it is gone, and its next agent attaches (a real process)."""
    from harness import wait_no_agent

    from easyckpt.engine.link.client import AgentClient
    from easyckpt.formats import protocol
    cfg = validate(Config(save_dir=str(tmp_path / "ckpt"), agent_start_timeout=30, autocheckpoint_on_sigterm=False))
    first = jobkey.ensure(cfg.job_id)          # read by the new run's trainer, as it starts
    spawn = AgentClient._spawn
    removed = []

    def while_the_agent_starts(self):
        if not removed:      # the previous run's agent removes the key just as this one starts
            removed.append(True)
            jobkey.remove(cfg.job_id)
        spawn(self)

    monkeypatch.setattr(AgentClient, "_spawn", while_the_agent_starts)
    client = AgentClient(cfg, 0, 0, 1, AuditLog(cfg.audit_log, "rank0"))
    try:
        assert removed and client.agent_pid is not None and shm.pid_alive(client.agent_pid)
        assert jobkey.read(cfg.job_id) != first
        client.send(protocol.Bye(0))
    finally:
        client.close()
        wait_no_agent(tmp_path / "ckpt", timeout=60)
        _lose_the_node(cfg)


def _lose_the_node(cfg: Config) -> None:
    """What a reboot leaves: no agent (closed by the caller), no shared memory; the disks as they were."""
    for path in shm.segments_of(cfg.job_id):
        shm.unlink_quiet(path)
    jobkey.remove(cfg.job_id)


def _wait_for_tier(cfg: Config, step: int, nranks: int, timeout: float = 30) -> None:
    where = tierfiles.directory(cfg.node_dir, cfg.job_id)
    deadline = time.monotonic() + timeout
    while not all(any(c.step == step for c in tierfiles.listing(where, cfg.job_id, r)) for r in range(nranks)):
        assert time.monotonic() < deadline, f"the agent did not copy step {step} to the local tier in {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("damaged", [False, True])
def test_after_a_reboot_the_local_tiers_newer_step_resumes_exactly_else_the_committed_one(tmp_path, damaged):
    cfg = validate(Config(save_dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), save_mem_interval=1,
                          save_storage_interval=6, save_local_interval=2, max_local_ckpt_num=2,
                          autocheckpoint_on_sigterm=False))

    def first(ckpt, group):
        model, opt = model_and_optimizer()
        for step in range(1, 10):
            train_step(model, opt, step)
            ckpt.save(step, state(ckpt, model, opt, step), optimizer=opt)
            if step in (6, 8):     # the tier copies in the background: the next steps would take its slot
                _wait_for_tier(cfg, step, 2)

    with node(cfg) as local:
        ranks(cfg, local, 2, first)           # no finalize: the job dies with its node below
        local.tick(0.5)
    _lose_the_node(cfg)
    assert [s for s, _ in SaveDir.of(cfg).committed(own=True)] == [6]
    where = tierfiles.directory(cfg.node_dir, cfg.job_id)
    assert [c.step for c in tierfiles.listing(where, cfg.job_id, 0)] == [8, 6]     # max_local_ckpt_num=2
    tier = cli_json("status", cfg.save_dir, "--local-dir", str(cfg.local_dir))["local_tier"]     # what an operator sees
    assert tier["dir"] == where and sorted((c["step"], c["rank"]) for c in tier["copies"]) == [(6, 0), (6, 1), (8, 0),
                                                                                              (8, 1)]
    if damaged:
        victim = tierfiles.listing(where, cfg.job_id, 1)[0].path
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            f.write(b"\xff\x00\xff")

    def resumed(ckpt, group):
        model, opt = model_and_optimizer(seed=1)
        step, _ = ckpt.load(state(ckpt, model, opt))
        more = [train_step(model, opt, s) for s in range(step + 1, step + 3)]
        ckpt.finalize(persist=False)
        return step, more

    with node(cfg) as local:
        got = ranks(cfg, local, 2, resumed)
    want = 6 if damaged else 8
    assert [s for s, _ in got] == [want, want]
    model, opt = model_and_optimizer()
    reference = [train_step(model, opt, s) for s in range(1, want + 3)]
    assert got[0][1] == reference[want:want + 2] and got[1][1] == reference[want:want + 2]
    log = (tmp_path / "local" / "easyckpt.log").read_text()
    if damaged:
        assert "local tier copy unusable on some rank: rank 1" in log and "corrupted" in log
        assert os.path.exists(victim)        # kept as it is
    else:
        loads = [json.loads(ln) for ln in log.splitlines() if '"event": "load"' in ln]
        assert loads and all(e["source"] == "local" for e in loads[-2:]), loads


def test_the_agent_leaving_after_the_job_copies_the_last_due_snapshot_its_thread_had_not_looked_at(tmp_path,
                                                                                                  monkeypatch):
    """The tier's thread runs niced and looks every POLL seconds; on a loaded machine the job's last snapshot
    was persisted, committed and the agent gone before it looked once, so the last due step never reached the
    tier (and the next resume read the store). Here the thread never looks before the agent leaves: the agent's
    own last look copies it. A job whose trainers have not all said bye gets no last look (a slot the trainer
    needs could be pinned)."""
    import easyckpt.agent.localtier as localtier
    monkeypatch.setattr(localtier, "POLL", 3600.0)       # the thread's first look would come in an hour
    cfg = validate(Config(save_dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), save_mem_interval=1,
                          save_storage_interval=4, save_local_interval=2, autocheckpoint_on_sigterm=False))
    where = tierfiles.directory(cfg.node_dir, cfg.job_id)

    def job(ckpt, group):
        model, opt = model_and_optimizer()
        for step in range(1, 7):
            train_step(model, opt, step)
            ckpt.save(step, state(ckpt, model, opt, step), optimizer=opt)
        assert tierfiles.listing(where, cfg.job_id, group.rank) == []      # the thread has not looked
        return ckpt.finalize()

    with node(cfg) as local:
        assert ranks(cfg, local, 2, job) == [6, 6]
        local.tick(0)
        assert local.left
    for rank in (0, 1):
        assert [c.step for c in tierfiles.listing(where, cfg.job_id, rank)] == [6], rank
    log = [json.loads(ln) for ln in (tmp_path / "local" / "easyckpt.log").read_text().splitlines()]
    assert sorted((e["step"], e["rank"]) for e in log if e["event"] == "tier_saved") == [(6, 0), (6, 1)]

    cfg = validate(Config(save_dir=str(tmp_path / "ckpt2"), local_dir=str(tmp_path / "local2"), save_mem_interval=1,
                          save_storage_interval=4, save_local_interval=2, autocheckpoint_on_sigterm=False))

    def dies(ckpt, group):
        run_steps(ckpt, 2, finalize=False)

    with node(cfg) as local:
        ranks(cfg, local, 1, dies)            # no bye: the agent is closed with its trainer still attached
    assert tierfiles.listing(tierfiles.directory(cfg.node_dir, cfg.job_id), cfg.job_id, 0) == []
    _lose_the_node(cfg)
