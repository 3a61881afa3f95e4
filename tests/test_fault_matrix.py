"""docs/reliability.md's fault-injection matrix: rows 4, 8, 11, 12 and 14 here, and the index of every row's
test (``ROWS``), checked below so that a row cannot lose its test unnoticed."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
from harness import (
    committed_steps,
    events,
    last_iteration,
    run,
    start,
    train_cmd,
    wait_for_iteration,
    wait_no_agent,
)
from inproc import run_worker

SEED = int(os.environ.get("EASYCKPT_TEST_SEED", "20261122"))

ROWS = {
    1: "test_faults.py::test_kill_mid_snapshot_ignores_the_half_written_slot",
    2: "test_faults.py::test_agent_killed_mid_persist_leaves_no_step_dir_and_is_restarted",
    3: "test_preemption.py::test_sigterm_saves_the_agreed_step_and_loses_nothing",
    4: "test_fault_matrix.py::test_disk_full_during_persist_harms_nothing",
    5: "test_config.py::test_read_only_save_dir_fails_at_initialisation_and_stays_untouched",
    6: "test_faults.py::test_damaged_shard_is_rejected_and_the_loader_falls_back",
    7: "test_faults.py::test_bad_tracker_does_not_mislead_the_loader",
    8: "test_fault_matrix.py::test_a_second_job_on_the_same_directory_fails_fast",
    9: "test_faults.py::test_too_small_shm_is_a_clear_error_before_any_copy",
    10: "test_faults.py::test_leftover_segments_of_a_dead_job_are_cleaned_on_next_start",
    11: "test_fault_matrix.py::test_ranks_that_disagree_on_the_step_get_no_manifest",
    12: "test_fault_matrix.py::test_a_rank_dying_while_the_other_waits_to_commit_is_named",
    13: "test_faults.py::test_tensors_changed_after_save_returns_do_not_leak_into_the_persisted_step",
    14: "test_fault_matrix.py::test_random_save_fail_kill_prune_sequences_keep_the_invariants",
    15: "test_faults.py::test_crash_at_each_point_of_the_durable_sequence_loads_old_or_new",
    16: "test_formats.py::test_a_malicious_pickle_in_a_checkpoint_is_not_executed",
    17: "test_trust.py::test_another_local_user_cannot_command_the_agent",
    18: "test_trust.py::test_slots_planted_by_another_user_are_refused_and_never_read",
    19: "test_trust.py::test_a_symlinked_lock_file_or_audit_log_in_the_save_dir_is_never_followed",
    20: "test_trust.py::test_a_slot_whose_file_names_leave_the_step_is_refused_by_the_agent",
    21: "test_trust.py::test_a_killed_agent_holding_both_slots_is_replaced_and_nothing_waits_for_it",
    22: "test_trust.py::test_a_shard_that_failed_on_one_rank_is_rewritten_on_every_rank_after_the_trainers_die",
    23: "test_trust.py::test_a_new_run_in_the_dir_of_a_crashed_run_whose_agent_lives_commits_its_own_steps",
    24: "test_trust.py::test_retention_never_keeps_a_damaged_checkpoint_in_place_of_a_verified_one",
    25: "test_manifest_trust.py::test_a_malformed_manifest_is_rejected_logged_and_the_job_starts_from_the_previous_step",
    26: "test_adopt.py::test_megatrons_own_checkpoint_is_adopted_and_later_saves_commit",
    27: "test_preemption.py::test_sigterm_to_every_process_with_dataloader_workers_saves_the_agreed_step",
    28: "test_trust.py::test_skipped_snapshots_under_back_pressure_are_said_once_an_episode_per_rank_with_a_summary",
    29: "test_verdicts.py::test_every_step_rejected_stops_the_job_and_a_fresh_start_sets_them_aside_whole",
    30: "test_megatron.py::test_a_wrong_flag_at_relaunch_is_incompatible_and_costs_no_checkpoint",
    31: "test_verdicts.py::test_a_job_never_resumes_another_jobs_steps_and_says_whose_they_are",
    32: "test_verdicts.py::test_a_new_runs_commits_are_never_pruned_for_an_older_runs_higher_steps",
    33: "test_verdicts.py::test_prune_deletes_nothing_when_the_newest_step_it_would_keep_is_damaged",
    34: "test_verdicts.py::test_a_copied_save_dir_resumes_commits_and_prunes",
    35: "test_planted.py::test_a_fifo_planted_under_a_replica_slot_name_never_blocks_the_agent",
    36: "test_planted.py::test_a_fifo_planted_as_the_key_or_a_slot_stops_the_job_at_once_naming_it",
    37: "test_planted.py::test_a_stopped_agent_costs_training_only_skipped_persists",
    38: "test_planted.py::test_a_fifo_in_a_step_blocks_neither_the_tools_nor_the_loader",
    39: "test_planted.py::test_refused_connections_are_counted_not_logged_one_line_each",
    40: "test_planted.py::test_a_staging_dir_planted_mid_run_is_refused_and_no_committed_step_belongs_to_another_user",
    41: "test_replicas.py::test_slow_strangers_on_the_peer_port_never_starve_the_jobs_own_nodes",
    42: "test_many_nodes.py::test_the_replica_secret_is_not_in_the_jobs_store_and_replicas_still_flow",
    43: "test_store_checkpoints.py::test_an_agent_killed_mid_upload_leaves_no_step_and_the_next_agent_removes_what_it_wrote",
    44: "test_store_checkpoints.py::test_the_store_down_for_30_s_mid_run_stops_no_training_and_persisting_resumes_when_it_is_back",
    45: "test_store_checkpoints.py::test_two_jobs_on_one_prefix_the_second_is_refused_naming_the_first",
    46: "test_store_checkpoints.py::test_a_job_killed_with_kill_9_resumes_from_the_store_with_an_uninterrupted_runs_losses",
    47: "test_store_checkpoints.py::test_after_a_reboot_the_local_tiers_newer_step_resumes_with_an_uninterrupted_runs_losses",
    48: "test_local_tier.py::test_after_a_reboot_the_local_tiers_newer_step_resumes_exactly_else_the_committed_one",
    49: "test_local_tier.py::test_planted_records_and_copies_are_passed_over_without_blocking",
    50: "test_store_checkpoints.py::test_a_full_bucket_fails_the_step_cleanly_harms_nothing_older_and_persisting_resumes_with_room",
    51: "test_s3.py::test_a_throttling_store_is_retried_with_backoff_and_one_that_keeps_throttling_fails_naming_it",
    52: "test_shared_dir.py::test_a_damaged_record_planted_by_another_user_deletes_no_intact_step",
    53: "test_shared_dir.py::test_a_log_planted_by_another_user_is_refused_at_start_never_appended_to",
    54: "test_shared_dir.py::test_a_stranger_cannot_hold_the_jobs_lock_and_is_named_when_it_does",
    55: "test_shared_dir.py::test_planted_twin_and_future_step_names_never_outrank_the_jobs_own_steps",
    56: "test_shared_dir.py::test_a_directory_where_a_file_belongs_is_refused_at_start_naming_it",
    57: "test_shared_dir.py::test_a_save_dir_replaced_under_a_running_job_is_noticed_and_still_guarded",
    58: "test_run_order.py::test_a_run_whose_clock_was_a_day_ahead_never_costs_the_next_run_its_commits",
    59: "test_run_order.py::test_a_step_deleted_right_after_its_commit_fails_finalize_at_once_naming_why",
    60: "test_replicas.py::test_slow_handshakes_from_the_jobs_own_nodes_address_never_keep_that_node_out",
    61: "test_planted.py::test_a_flood_of_garbage_on_the_agents_peer_port_adds_a_few_log_lines_not_one_each",
    62: "test_store_checkpoints.py::"
        "test_a_lease_object_with_until_1e400_refuses_the_job_naming_it_instead_of_crashing_every_agent",
    63: "test_s3.py::test_a_job_whose_clock_is_a_day_off_cannot_take_over_a_running_lease",
    64: "test_local_tier.py::test_the_agent_leaving_after_the_job_copies_the_last_due_snapshot_its_thread_had_not_looked_at",
    65: "test_local_tier.py::test_a_header_word_set_while_the_slot_is_copied_leaves_a_copy_that_matches_its_record",
    66: "test_local_tier.py::"
        "test_an_agent_leaving_while_the_job_was_started_again_on_its_node_leaves_the_new_runs_memory_alone",
    67: "test_audit_history.py::test_what_was_committed_and_deleted_outlives_the_audit_logs_rotations",
    68: "test_audit_history.py::test_a_writer_silent_while_the_others_rotated_the_log_twice_writes_on_in_the_new_log",
    69: "test_shared_dir.py::test_a_strangers_listener_on_the_agents_address_does_not_keep_a_jobs_memory",
}


def test_every_row_of_the_matrix_has_its_test():
    """docs/reliability.md lists the rows of the matrix, each with the test that proves it."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    rows = sorted(int(n) for n in re.findall(r"^\| (\d+) \|", doc, re.M))
    assert rows == list(range(1, len(rows) + 1)) and sorted(ROWS) == rows, (rows, sorted(ROWS))
    for row, ref in ROWS.items():
        module, name = ref.split("::")
        assert hasattr(importlib.import_module(module[:-3]), name), f"row {row}: {ref} does not exist"
        assert f"| {row} |" in doc and name in doc, f"row {row} or its test {name} missing in docs/reliability.md"


def digest(root: Path):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def committed_digest(ckpt: Path):
    # only committed step directories: a staging one may be renamed or dropped while it is read
    return {f"{d.name}/{k}": v for d in sorted(ckpt.glob("step_*")) for k, v in digest(d).items()}


# ---- row 4 ----------------------------------------------------------------------------------

# the injected ENOSPC repeats the real full tmpfs's path: -m slow
@pytest.mark.parametrize("cause", [pytest.param("injected", marks=pytest.mark.slow), "tmpfs"])
def test_disk_full_during_persist_harms_nothing(tmp_path, cause):
    """Steps 5 and 10 are committed; then the disk fills up (a real 2 MiB tmpfs filled to the brim, or
    ENOSPC injected into the shard writer). Training goes on to step 20; the failed persists are
    reported, their staging goes, nothing is pruned, and steps 5 and 10 stay byte-identical."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    ckpt.mkdir()
    mounted = False
    if cause == "tmpfs":
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(ckpt)], capture_output=True,
                          timeout=30).returncode != 0:
            pytest.skip("cannot mount a small tmpfs here (needs root); the injected variant covers row 4")
        mounted = True
    try:
        common = ["--storage-interval", "5", "--max-ckpt", "2", "--log-file", str(log), "--hidden", "512",
                  "--loss-file", str(tmp_path / "loss"), "--idle-timeout", "1"]
        run(train_cmd(ckpt, 1, "--iters", "10", *common))
        wait_no_agent(ckpt)
        assert committed_steps(ckpt) == [5, 10]
        before = committed_digest(ckpt)
        env = {}
        if mounted:
            st = os.statvfs(ckpt)
            (ckpt / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 64 * 1024))
        else:
            env = {"EASYCKPT_FAULTS": "agent.persist_file=enospc"}
        out = run(train_cmd(ckpt, 1, "--iters", "20", *common), extra_env=env, check=False)
        wait_no_agent(ckpt)
        assert last_iteration(tmp_path / "loss") == 20, "a failed persist must not stop training"
        assert out.returncode != 0 and "No space left on device" in out.stderr, out.stderr[-2000:]
        errors = [e for e in events(log) if e["event"] == "error"]
        assert errors and all("No space left on device" in e["message"] for e in errors if e.get("step") == 15)
        assert committed_steps(ckpt) == [5, 10]
        assert committed_digest(ckpt) == before, "an older checkpoint changed"
        assert not list(ckpt.glob(".easyckpt-staging-*")), "staging of the failed steps left behind"
        assert not [e for e in events(log) if e["event"] == "delete" and e.get("reason") == "retention"]
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckpt)], timeout=30)   # lazy: a straggler may hold a file


# ---- row 8 ----------------------------------------------------------------------------------

def test_a_second_job_on_the_same_directory_fails_fast(tmp_path):
    """Job A trains; job B (another job name) and job B' (A's own name, a duplicate launch) start on A's
    directory: both fail at initialisation with a message naming the holder; A's files are untouched and
    A finishes normally."""
    ckpt, loss = tmp_path / "ckpt", tmp_path / "loss"
    a = start(train_cmd(ckpt, 1, "--iters", "3000", "--storage-interval", "5", "--step-sleep", "0.03",
                        "--max-ckpt", "1000", "--loss-file", str(loss), "--job-name", "A", "--idle-timeout", "1"),
              log=tmp_path / "a.out")
    try:
        _second_jobs_fail(ckpt, tmp_path, a, loss)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(timeout=30)
    wait_no_agent(ckpt, job_name="A")
    wait_no_agent(ckpt, job_name="B")


def _second_jobs_fail(ckpt: Path, tmp_path: Path, a, loss: Path) -> None:
    wait_for_iteration(loss, 6, a)
    snapshot = committed_digest(ckpt)
    for name, needle in (("B", "is in use by job A"), ("A", "is already running")):
        t0 = time.monotonic()
        b = run(train_cmd(ckpt, 1, "--iters", "5", "--job-name", name, "--loss-file", str(tmp_path / f"loss{name}"),
                          "--idle-timeout", "1"), check=False)
        assert b.returncode != 0 and needle in b.stderr, b.stderr[-2000:]
        assert time.monotonic() - t0 < 60
        assert not Path(f"{tmp_path}/loss{name}.rank0").exists(), "the second job must not train"
    after = committed_digest(ckpt)
    assert {k: v for k, v in after.items() if k in snapshot} == snapshot
    assert a.poll() is None, "job A must keep training"
    a.terminate()                    # SIGTERM: A saves the agreed step and exits
    assert a.wait(timeout=60) == 0


# ---- row 11 ---------------------------------------------------------------------------------

def test_ranks_that_disagree_on_the_step_get_no_manifest(tmp_path):
    """At iteration 10 rank 1 says step 110: neither step 10 nor 110 has every rank's shard. Step 10 is
    dropped when the next save (15) commits (a newer step made it useless), 110 times out (3 s); each
    message names the ranks whose shard never came, no manifest is written for either."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    run_worker(train_cmd(ckpt, 2, "--iters", "20", "--storage-interval", "5", "--max-ckpt", "5", "--log-file", str(log),
                  "--misreport", "10@1:110", "--commit-timeout", "3", "--step-sleep", "0.1", "--idle-timeout", "1"))
    wait_no_agent(ckpt, timeout=30)
    assert committed_steps(ckpt) == [5, 15, 20]
    assert not (ckpt / "step_00000010").exists() and not (ckpt / "step_00000110").exists()
    assert not list(ckpt.glob(".easyckpt-staging-*"))
    timeouts = {e["step"]: e["message"] for e in events(log) if e["event"] == "error"}
    dropped = {e["step"]: e["message"] for e in events(log) if e["event"] == "abandon" and "superseded" in e["message"]}
    assert "ranks [1]" in dropped[10] and "ranks [0]" in timeouts[110], (dropped, timeouts)


# ---- row 12 ---------------------------------------------------------------------------------

def test_a_rank_dying_while_the_other_waits_to_commit_is_named(tmp_path):
    """Rank 1 is killed inside its copy of the last step (12) while rank 0 waits in finalize for the
    commit: rank 0 fails after commit_timeout (4 s) naming rank 1, and step 12 gets no manifest. (The fault
    counts snapshots: steps of 50 ms let the persists of steps 5 and 10 keep up, where back-pressure on a loaded
    machine skipped snapshots 11 and 12 and the kill never came.)"""
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    out = run_worker(train_cmd(ckpt, 2, "--iters", "12", "--storage-interval", "5", "--log-file", str(log),
                        "--commit-timeout", "4", "--idle-timeout", "1", "--step-sleep", "0.05"), check=False,
              extra_env={"EASYCKPT_FAULTS": "trainer.mid_snapshot@1=kill",
                         "EASYCKPT_FAULT_AFTER": "trainer.mid_snapshot:11"})
    assert out.returncode != 0
    assert "step 12 was not committed within 4s: no shard from rank(s) [1]" in out.stderr, out.stderr[-3000:]
    wait_no_agent(ckpt, timeout=30)
    assert 12 not in committed_steps(ckpt)
    assert not list(ckpt.glob(".easyckpt-staging-*"))


# ---- row 14 ---------------------------------------------------------------------------------

def test_random_save_fail_kill_prune_sequences_keep_the_invariants(tmp_path, monkeypatch):
    """Property test over the engine's own commit, failure clean-up, restart clean-up and pruning code:
    seeded random sequences of save / failed save / kill at a point of the commit / restart / prune /
    foreign files. After every operation: the newest committed step is never deleted, at most
    max_ckpt_num remain after a prune, no half-written step is visible, foreign files are untouched."""
    from easyckpt.formats import manifest as mf
    from easyckpt.pytorch import NAMING
    from easyckpt.storage import retention, stepfiles
    from easyckpt.storage.auditlog import AuditLog
    from easyckpt.storage.commit import commit
    from easyckpt.storage.savedir import SaveDir
    rnd = random.Random(SEED)
    log = AuditLog(None, "test")
    points = ["agent.after_manifest", "agent.before_rename", "agent.after_rename", "agent.before_tracker"]
    for trial in range(25):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        job, n_keep, step = f"{trial:012x}", rnd.randint(1, 4), 0
        sd = SaveDir(str(d), NAMING, job)
        foreign = {}

        def stage(s: int, complete: bool = True) -> None:
            staging = Path(sd.staging_path(s))
            staging.mkdir()
            data = rnd.randbytes(rnd.randint(1, 300))
            (staging / "model.bin").write_bytes(data if complete else data[:1])
            if complete:
                sd.write_marker(s, 0, {"model.bin": mf.FileEntry(len(data), mf.checksum(data))})

        def save(s: int) -> None:
            stage(s)
            try:
                done = commit(sd, s, 1, log)
            except FileExistsError:     # another job's directory of that name: refused, as the agent does
                sd.remove_staging(log, step=s)
                return
            retention.prune(sd, retention.KeepLast(n_keep, retention.protected(done.manifest)), log)

        for _ in range(30):
            newest_before = sd.committed(own=True)[:1]
            op = rnd.choice(["save", "save", "save", "fail", "kill", "crash", "restart", "prune", "foreign"])
            if op == "save":
                step += rnd.randint(1, 3)
                save(step)
            elif op == "fail":            # e.g. disk full while writing: the agent removes the staging dir
                step += 1
                stage(step, complete=False)
                sd.remove_staging(log, step=step)
            elif op == "kill":            # the agent died while writing: staging stays until the next start
                step += 1
                stage(step, complete=False)
            elif op == "crash":           # the agent died at one point of the commit
                step += 1
                monkeypatch.setenv("EASYCKPT_FAULTS", f"{rnd.choice(points)}=raise")
                try:
                    save(step)
                except RuntimeError as exc:
                    assert "injected fault" in str(exc)
                monkeypatch.delenv("EASYCKPT_FAULTS")
            elif op == "restart":         # the next agent's start
                sd.remove_staging(log)
            elif op == "prune":
                committed = sd.committed(own=True)
                if committed:
                    retention.prune(sd, retention.KeepLast(n_keep, retention.protected(sd.committed_manifests(own=True)[0][2])), log)
            else:                         # another job's checkpoint and staging, an unrelated file
                other = d / NAMING.dir_name(rnd.randint(1, 200))
                made = [d / f"notes-{rnd.randint(0, 9)}.txt",
                        d / f".easyckpt-staging-ffffffffffff-step_{rnd.randint(1, 99):08d}" / "x",
                        d / f".easyckpt-trash-ffffffffffff-step_{rnd.randint(1, 99):08d}-1" / "y"]
                if not other.exists():
                    other.mkdir()
                    # another job's checkpoint: a complete manifest of another job id (a partial one is damage)
                    (other / mf.MANIFEST_NAME).write_text(json.dumps(mf.build(0, "ffffffffffff", "pytorch", 1, {}).to_json()))
                    made.append(other / mf.MANIFEST_NAME)
                for p in made[:3]:
                    p.parent.mkdir(exist_ok=True)
                    p.write_bytes(rnd.randbytes(8))
                foreign.update({p: p.read_bytes() for p in made})
            committed = sd.committed(own=True)
            steps = [s for s, _ in committed]
            what = f"trial {trial}, op {op}, keep {n_keep}, committed {steps}"
            if newest_before:   # only a newer commit may retire the newest one
                assert steps and steps[0] >= newest_before[0][0], f"{what}: the newest committed step was deleted"
                if op not in ("save",):
                    assert newest_before[0][0] in steps, f"{what}: the newest committed step was deleted"
            if op in ("save", "prune"):
                assert len(steps) <= n_keep, what
            for path, data in foreign.items():
                assert path.exists() and path.read_bytes() == data, f"{what}: foreign {path} touched"
            for s, path in sd.step_dirs():
                man = stepfiles.read(path)
                assert man is not None, f"{what}: {path} is visible without a manifest"
                if man.job_id == job:
                    assert stepfiles.check_sizes(path, man) == [], f"{what}: {path} incomplete"
