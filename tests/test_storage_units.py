"""In-process unit tests of the save-dir layer: names (formats/layout.py), SaveDir's commit and prune over
a faulty Storage (fails the Nth write, an fsync, a rename), and retention as a state machine over a
sequence of commits. Fast, no subprocess, no torch."""
from __future__ import annotations

import errno
import json
import os
import random
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

from easyckpt.errors import UntrustedFileError
from easyckpt.formats import layout
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import NAMINGS
from easyckpt.storage import stepfiles
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.base import Storage, Writer
from easyckpt.storage.commit import commit
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.manifestcommit import ManifestCommit
from easyckpt.storage.renamecommit import RenameCommit
from easyckpt.storage.retention import KeepLast, prune
from easyckpt.storage.savedir import SaveDir

JOB, OTHER_JOB = "0123456789ab", "ffffffffffff"
LOG = AuditLog(None, "test")


class FaultyStorage:
    """The POSIX storage with faults on demand: the Nth write (atomic writes and streamed files counted
    together), every fsync, every rename. Records each mutating call, in order."""

    has_rename = True
    local = True

    def __init__(self) -> None:
        self.inner = PosixStorage()
        self.fail_write_at: Optional[int] = None
        self.fail_sync = self.fail_rename = False
        self.writes = 0
        self.calls: List[Tuple[str, str]] = []

    def arm(self, write_at: Optional[int] = None, sync: bool = False, rename: bool = False) -> None:
        self.writes, self.calls = 0, []
        self.fail_write_at, self.fail_sync, self.fail_rename = write_at, sync, rename

    def _write(self, path: str) -> None:
        self.writes += 1
        if self.writes == self.fail_write_at:
            raise OSError(errno.ENOSPC, f"injected: write #{self.writes} failed", path)

    def __getattr__(self, name: str) -> Any:       # listdir, is_dir, exists, read
        return getattr(self.inner, name)

    def makedirs(self, path: str) -> None:
        self.calls.append(("makedirs", os.path.basename(path)))
        self.inner.makedirs(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        self.calls.append(("write_atomic", os.path.basename(path)))
        self._write(path)
        self.inner.write_atomic(path, data)

    def open_writer(self, path: str, direct: bool = True) -> "FaultyWriter":
        self.calls.append(("open_writer", os.path.basename(path)))
        return FaultyWriter(self, self.inner.open_writer(path, direct), path)

    def sync_dir(self, path: str) -> None:
        self.calls.append(("sync_dir", os.path.basename(path)))
        if self.fail_sync:
            raise OSError(errno.EIO, "injected: fsync failed", path)
        self.inner.sync_dir(path)

    def rename_noreplace(self, src: str, dst: str) -> None:
        self.calls.append(("rename_noreplace", os.path.basename(dst)))
        if self.fail_rename:
            raise OSError(errno.EXDEV, "injected: rename failed", src)
        self.inner.rename_noreplace(src, dst)

    def delete(self, path: str) -> None:
        self.calls.append(("delete", os.path.basename(path)))
        self.inner.delete(path)


class FaultyWriter:
    def __init__(self, storage: FaultyStorage, inner: Writer, path: str):
        self.storage, self.inner, self.path = storage, inner, path

    @property
    def size(self) -> int:
        return self.inner.size

    def write(self, data: bytes) -> int:
        self.storage._write(self.path)
        return self.inner.write(data)

    def write_mapped(self, view: memoryview, start: int, end: int) -> None:
        self.storage._write(self.path)
        self.inner.write_mapped(view, start, end)

    def finish(self) -> None:
        self.inner.finish()

    def sync(self) -> None:
        if self.storage.fail_sync:
            raise OSError(errno.EIO, "injected: fsync failed", self.path)
        self.inner.sync()

    def close(self) -> None:
        self.inner.close()


def stage(sd: SaveDir, step: int, world: int = 1) -> Dict[str, bytes]:
    """What the agents do for ``step``: every rank's file streamed into staging, synced, then its marker."""
    staging = sd.staging_path(step)
    sd.storage.makedirs(staging)
    written = {}
    for rank in range(world):
        rel, data = f"rank{rank}.bin", os.urandom(100 + rank)
        out = sd.storage.open_writer(os.path.join(staging, rel), direct=False)
        try:
            out.write(data)
            out.finish()
            out.sync()
        finally:
            out.close()
        sd.storage.sync_dir(staging)
        sd.write_marker(step, rank, {rel: mf.FileEntry(len(data), mf.checksum(data))})
        written[rel] = data
    return written


def intact(sd: SaveDir, step: int) -> bool:
    man = stepfiles.read(sd.step_path(step))
    return man is not None and man.step == step and stepfiles.check_sizes(sd.step_path(step), man) == [] and all(
        stepfiles.verify_file(sd.step_path(step), rel, man) is None for rel in man.files)


@pytest.fixture
def sd(tmp_path) -> SaveDir:
    return SaveDir(str(tmp_path), NAMINGS["deepspeed"], JOB, FaultyStorage())


# ---- names ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework", sorted(NAMINGS))
def test_names_round_trip_for_every_framework(framework):
    naming = NAMINGS[framework]
    for step in (0, 1, 7, 100, 1234567):
        assert naming.parse(naming.dir_name(step)) == step
        assert naming.parse_tracker(naming.tracker_text(step)) == step
        assert layout.parse_staging(layout.staging_name(JOB, naming.dir_name(step))) == (JOB, naming.dir_name(step))
    for rank in (0, 3, 99999):
        assert layout.parse_marker(layout.marker_name(rank)) == rank
    assert layout.deepspeed_tag(12) == NAMINGS["deepspeed"].dir_name(12) == "global_step12"


@pytest.mark.parametrize("framework", sorted(NAMINGS))
def test_foreign_names_are_ignored(tmp_path, framework):
    naming = NAMINGS[framework]
    others = {n.dir_name(5) for n in NAMINGS.values() if n.dir_name(5) != naming.dir_name(5)}
    for name in others | {"notes", "step_5", naming.dir_name(5) + ".bak", layout.staging_name(JOB, "other")}:
        assert naming.parse(name) is None, name
        (tmp_path / name).mkdir()
    (tmp_path / naming.dir_name(6)).write_bytes(b"a file, not a step directory")
    (tmp_path / naming.dir_name(7)).mkdir()
    assert SaveDir(str(tmp_path), naming).step_dirs() == [(7, str(tmp_path / naming.dir_name(7)))]
    for bad in ("release", "", "garbage", "step_x"):
        assert naming.parse_tracker(bad) is None
    for bad in (".easyckpt-staging-", ".easyckpt-staging-nothex-step_00000001", ".easyckpt-trash-x"):
        assert layout.parse_staging(bad) is None
    for bad in (".easyckpt-done-rank-1.json", ".easyckpt-done-rank-00001.json.tmp", "easyckpt_manifest.json"):
        assert layout.parse_marker(bad) is None


def test_posix_storage_is_a_storage():
    assert isinstance(PosixStorage(), Storage)
    assert isinstance(FaultyStorage(), Storage)


# ---- commit -------------------------------------------------------------------------------------------

def test_a_commit_makes_the_calls_in_the_documented_order(sd):
    stage(sd, 1, world=2)
    sd.storage.arm()
    final, nbytes, _ = commit(sd, 1, 2, LOG)
    assert final == sd.step_path(1) and nbytes == 100 + 101 and intact(sd, 1)
    stg = os.path.basename(sd.staging_path(1))
    assert sd.storage.calls == [
        ("write_atomic", mf.MANIFEST_NAME),
        ("delete", layout.marker_name(0)), ("delete", layout.marker_name(1)),
        ("sync_dir", stg),
        ("rename_noreplace", "global_step1"),
        ("sync_dir", os.path.basename(sd.root)),
        ("write_atomic", "latest"),
    ]
    assert sd.tracker_step() == 1 and sd.committed(own=True) == [(1, final)] and sd.staging_dirs() == []


@pytest.mark.parametrize("fault", ["manifest write", "staging fsync", "rename"])
def test_a_failed_commit_shows_nothing_keeps_the_previous_step_and_cleans_its_staging(sd, fault):
    stage(sd, 1)
    commit(sd, 1, 1, LOG)
    stage(sd, 2)
    sd.storage.arm(write_at=1 if fault == "manifest write" else None, sync=fault == "staging fsync",
                   rename=fault == "rename")
    with pytest.raises(OSError, match="injected"):
        commit(sd, 2, 1, LOG)
    assert not os.path.lexists(sd.step_path(2)), "a half-committed step is visible"
    assert sd.committed(own=True) == [(1, sd.step_path(1))] and intact(sd, 1)
    assert sd.staging_dirs() == [], "the failed step's staging dir stays"
    assert sd.tracker_step() == 1


def test_a_failed_tracker_write_leaves_a_complete_step_the_loader_trusts(sd):
    stage(sd, 1)
    sd.storage.arm(write_at=2)          # 1: the manifest, 2: the tracker
    with pytest.raises(OSError, match="injected"):
        commit(sd, 1, 1, LOG)
    assert intact(sd, 1) and sd.committed(own=True) == [(1, sd.step_path(1))] and sd.tracker_step() is None


@pytest.mark.parametrize("n", [1, 2])
def test_a_failed_shard_write_never_gets_a_marker_so_it_cannot_commit(sd, n):
    sd.storage.arm(write_at=n)           # 1: rank 0's file, 2: rank 0's marker
    with pytest.raises(OSError, match="injected"):
        stage(sd, 1)
    assert sd.ready_ranks(1) == set()
    with pytest.raises(RuntimeError, match="refusing to commit step 1"):
        commit(sd, 1, 1, LOG)
    assert not os.path.lexists(sd.step_path(1))
    sd.remove_staging(LOG, step=1)       # what the agent does with a failed step
    assert sd.staging_dirs() == [] and sd.ready_ranks(1) is None


def test_a_commit_never_replaces_another_jobs_step(sd, tmp_path):
    other = SaveDir(sd.root, sd.naming, OTHER_JOB)
    stage(other, 3)
    commit(other, 3, 1, LOG)
    stage(sd, 3)
    with pytest.raises(FileExistsError, match="another job"):
        commit(sd, 3, 1, LOG)
    assert stepfiles.read(sd.step_path(3)).job_id == OTHER_JOB and intact(sd, 3) and sd.staging_dirs() == []


def test_a_refused_step_names_its_owner_from_the_manifest_quoted_and_cut(sd):
    """issue 51 item 4: the owner's job name is read from another job's manifest, so it is input: shown quoted
    (control characters escaped) and cut at 64 characters; job_name=... is offered only for a name one can type."""
    other = SaveDir(sd.root, sd.naming, OTHER_JOB, job_name="beta")
    stage(other, 3)
    commit(other, 3, 1, LOG)
    stage(sd, 3)
    with pytest.raises(FileExistsError) as err:
        commit(sd, 3, 1, LOG)
    assert str(err.value) == (f"{sd.step_path(3)} holds step 3 of another job, job 'beta' (job id '{OTHER_JOB}'); it "
                              f"is never replaced. That checkpoint is not this job's to delete: give this job a "
                              f"save_dir of its own; or, if this run continues job 'beta', set job_name='beta' to "
                              f"resume it")
    odd = mf.Manifest(step=3, framework="x", files={}, job_id=OTHER_JOB, job="\x1b[2J" + "b" * 100)
    said = sd.taken_words(sd.step_path(3), 3, odd, "it is never replaced")
    assert "job '\\x1b[2J" + "b" * 60 + "'... (job id" in said and "\x1b" not in said and "set job_name" not in said


def test_remove_staging_removes_only_this_jobs_leftovers(sd):
    stage(sd, 1)
    other = SaveDir(sd.root, sd.naming, OTHER_JOB)
    stage(other, 1)
    sd.remove_staging(LOG)
    assert sd.staging_dirs() == [] and other.staging_dirs() == [other.staging_path(1)]


# ---- prune --------------------------------------------------------------------------------------------

def test_a_failed_prune_leaves_every_checkpoint_whole(sd):
    for step in (1, 2, 3):
        stage(sd, step)
        commit(sd, step, 1, LOG)
    sd.storage.arm(rename=True)
    with pytest.raises(OSError, match="injected"):
        prune(sd, KeepLast(1), LOG)
    assert [s for s, _ in sd.committed(own=True)] == [3, 2, 1] and all(intact(sd, s) for s in (1, 2, 3))
    sd.storage.arm()
    assert prune(sd, KeepLast(1), LOG) == [2, 1]
    assert [c[0] for c in sd.storage.calls] == ["rename_noreplace", "sync_dir", "delete"] * 2
    assert [s for s, _ in sd.committed(own=True)] == [3] and intact(sd, 3)
    assert not [n for n in os.listdir(sd.root) if n.startswith(layout.TRASH_PREFIX)]


def _expected(state: List[int], damaged: Set[int], keep: int, protect: Set[int]) -> List[int]:
    """The retention rules, stated independently of retention.py: the newest verified ones up to ``keep``
    (protected ones kept and counted), the newest step always; a damaged one goes once a newer verified
    one exists."""
    newest_first = sorted(state, reverse=True)
    verified = [s for s in newest_first if s not in damaged]
    kept_v = set(verified[:1]) | (protect & set(verified))
    for s in verified:
        if len(kept_v) >= max(keep, len(kept_v)):
            break
        kept_v.add(s)
    kept_d = {s for s in newest_first if s in damaged and (s == newest_first[0] or not any(v > s for v in verified))}
    return sorted(kept_v | kept_d, reverse=True)


@pytest.mark.parametrize("seed", range(6))
def test_retention_over_a_sequence_of_commits_keeps_the_newest_the_protected_and_verified_over_damaged(
        tmp_path, seed):
    rnd = random.Random(seed)
    sd = SaveDir(str(tmp_path), NAMINGS["pytorch"], JOB, FaultyStorage())
    other = SaveDir(str(tmp_path), NAMINGS["pytorch"], OTHER_JOB)
    stage(other, 1000)
    commit(other, 1000, 1, LOG)                  # another job's, newer than all of ours: never touched
    keep, step = rnd.randint(1, 3), 0
    state: List[int] = []
    for _ in range(25):
        step += rnd.randint(1, 3)
        stage(sd, step)
        final, _, _ = commit(sd, step, 1, LOG)
        state.append(step)
        if len(state) > 1 and rnd.random() < 0.3:        # the loader rejected an older one
            sd.mark_damaged(rnd.choice(state[:-1]), "checksum mismatch", LOG)
        protect = {rnd.choice(state)} if rnd.random() < 0.3 else set()
        damaged = {NAMINGS["pytorch"].parse(n) for n in sd.read_damaged()}
        want = _expected(state, damaged, keep, protect)
        prune(sd, KeepLast(keep, protect), LOG)
        state = [s for s, _ in sd.committed(own=True)]
        assert state == want, f"seed {seed}, keep {keep}, protect {protect}, damaged {sorted(damaged)}"
        assert state[0] == step, "the newest committed step was deleted"
        verified = [s for s in state if s not in damaged]
        assert not (damaged & set(state)) or verified, "a verified step was deleted while a damaged one stays"
        assert intact(other, 1000)


def test_a_new_commit_under_a_damaged_name_is_verified_again(sd):
    stage(sd, 1)
    commit(sd, 1, 1, LOG)
    sd.mark_damaged(1, "torn", LOG)
    assert sd.read_damaged() == {"global_step1": "torn"}
    stage(sd, 1)
    commit(sd, 1, 1, LOG)                          # the same step redone (a resumed run reached it again)
    assert sd.read_damaged() == {} and intact(sd, 1)


# ---- runs and jobs (docs/reliability.md promise 12) ------------------------------------------------------

def _commit_in_run(sd: SaveDir, step: int, run: float) -> None:
    stage(sd, step)
    marker = sd.read_markers(step)[0]
    sd.write_marker(step, 0, marker.files, {"run": run})      # what the engine records: its run's start
    commit(sd, step, 1, LOG)


def test_retention_orders_by_run_then_step_and_a_newer_run_sets_an_older_runs_step_aside(tmp_path):
    sd = SaveDir(str(tmp_path), NAMINGS["deepspeed"], JOB, PosixStorage(), job_name="")
    for step in (10, 20):
        _commit_in_run(sd, step, run=100.0)
    for step in (4, 8):                                  # a new run from scratch: its steps are the newest
        _commit_in_run(sd, step, run=200.0)
    assert [s for s, _ in sd.committed(own=True)] == [8, 4, 20, 10]
    assert prune(sd, KeepLast(3), LOG) == [10]
    _commit_in_run(sd, 20, run=200.0)                  # the new run reaches the old run's name: set aside, kept
    (name, path), = sd.quarantined()
    assert name == "global_step20" and json_step(path) == 20
    assert [s for s, _ in sd.committed(own=True)] == [20, 8, 4]
    _commit_in_run(sd, 20, run=200.0)                  # again in the same run (a fresh snapshot): replaced
    assert len(sd.quarantined()) == 1 and intact(sd, 20)


def test_a_step_is_the_jobs_by_its_name_wherever_the_directory_is(tmp_path):
    sd = SaveDir(str(tmp_path), NAMINGS["deepspeed"], JOB, PosixStorage(), job_name="a")
    _commit_in_run(sd, 5, run=1.0)
    moved = SaveDir(str(tmp_path), NAMINGS["deepspeed"], "0123456789ab", PosixStorage(), job_name="a")
    other = SaveDir(str(tmp_path), NAMINGS["deepspeed"], JOB, PosixStorage(), job_name="b")
    assert [s for s, _ in moved.committed(own=True)] == [5]     # another job id (a copy elsewhere), same job
    assert other.committed(own=True) == [] and [s for s, _ in other.committed()] == [5]
    stage(other, 5)
    with pytest.raises(FileExistsError, match="another job"):
        commit(other, 5, 1, LOG)
    assert intact(sd, 5)


def json_step(path: str) -> int:
    return stepfiles.read(path).step


def test_files_deleted_by_name_are_exactly_those_a_missing_one_no_error(tmp_path):
    """Storage.delete_files on POSIX (the object store's: tests/test_s3.py): the named files, nothing else."""
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"x")
    PosixStorage().delete_files([str(tmp_path / "a"), str(tmp_path / "c"), str(tmp_path / "never")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_the_audit_log_is_capped_and_every_writer_follows_a_rotation(tmp_path, monkeypatch):
    """Issue 49 item 7b: the audit log, appended to by several processes (two AuditLogs here), never grows past
    the cap by more than a line: over it, one writer renames it to easyckpt.log.1 and starts a new one, the
    other follows to the new file, and nothing written is lost but what a second rotation replaced (before:
    no cap, and a flood of refused connections added 24.7 MB in a minute)."""
    from easyckpt.storage import logcap
    monkeypatch.setattr(logcap, "MAX_LOG_BYTES", 4096)
    path = tmp_path / "easyckpt.log"
    a, b = AuditLog(str(path), "a"), AuditLog(str(path), "b")
    try:
        for i in range(100):         # about 130 bytes a line: over the cap three times
            (a if i % 2 else b).record("probe", i=i, message="x" * 20)
        newest, older = path.read_text().splitlines(), (tmp_path / "easyckpt.log.1").read_text().splitlines()
        assert path.stat().st_size <= 4096 + 400 and (tmp_path / "easyckpt.log.1").stat().st_size <= 4096 + 400
        seen = [json.loads(line)["i"] for line in older + newest]
        assert seen == list(range(seen[0], 100)) and seen[0] > 0, seen     # in order, none lost since the cut
        assert {os.fstat(w._fd).st_ino for w in (a, b)} == {path.stat().st_ino}   # both write the new file
    finally:
        a.close()
        b.close()


def test_the_agent_log_is_capped_through_the_stderr_it_was_handed(tmp_path):
    """Issue 49 item 7b: the agent's stdout and stderr are its log file (an fd from its starter): over the
    cap, logcap.cap_stdio renames it to .1 and points both at a new file, so a process that prints without
    end still holds at most twice the cap on disk."""
    import subprocess
    import sys
    path = tmp_path / "easyckpt-agent-host.log"
    script = (
        "import os, sys\n"
        "from easyckpt.storage import logcap\n"
        "reopen = lambda: os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)\n"
        "for i in range(400):\n"
        "    print('line %05d ' % i + 'y' * 40, file=sys.stderr, flush=True)\n"
        "    logcap.cap_stdio(sys.argv[1], reopen)\n")
    with open(path, "ab") as log:
        subprocess.run([sys.executable, "-c", script, str(path)], stdout=log, stderr=log, check=True, timeout=60,
                       env={**os.environ, "EASYCKPT_MAX_LOG_BYTES": "2048"})
    older = tmp_path / "easyckpt-agent-host.log.1"
    assert path.stat().st_size <= 2048 + 100 and older.stat().st_size <= 2048 + 100
    lines = (older.read_text() + path.read_text()).splitlines()
    assert lines[-1].startswith("line 00399") and len(lines) < 100, lines[-3:]


def test_a_lock_file_removed_between_its_open_and_its_lock_is_opened_again(tmp_path, monkeypatch):
    """storage/firstfiles.py removes a failed run's lock file while holding it: a process that opened the old file
    just before must not hold a lock on it (it guards nothing) while another locks the new one."""
    from easyckpt.storage import joblock
    real = joblock.paths.open_own
    calls = []

    def open_then_removed(path: str, flags: int, mode: int) -> int:
        fd = real(path, flags, mode)
        calls.append(path)
        if len(calls) == 1:
            os.unlink(path)           # the holder took it back after this open, before the flock
        return fd

    monkeypatch.setattr(joblock.paths, "open_own", open_then_removed)
    first = joblock.JobLock(str(tmp_path), "job", None)
    assert first.acquire() is None and len(calls) == 2
    assert first.fd is not None and os.fstat(first.fd).st_ino == os.lstat(first.path).st_ino
    monkeypatch.setattr(joblock.paths, "open_own", real)
    other = joblock.JobLock(str(tmp_path), "job", None)
    assert other.acquire() is not None           # the file at the path is the one held
    first.release()


@pytest.mark.parametrize("value,step", [(7, 7), ("7", None), (True, None), (7.9, None), (-1, None), (None, None)])
def test_the_trainers_global_step_is_taken_only_as_the_int_it_writes(tmp_path, value, step):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": value}))
    assert stepfiles.trainer_state_step(str(tmp_path)) == step


# ---- the read verbs of the Storage protocol on POSIX (base.py) --------------------------------------------------

def test_posix_size_and_owner_never_follow_a_symlink_nor_read_a_fifo(tmp_path):
    s = PosixStorage()
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 1234)
    assert s.size(str(f)) == 1234
    assert s.owner(str(f)) == (os.geteuid(), os.lstat(f).st_mode)
    assert s.owner(str(tmp_path / "none")) is None
    os.symlink(f, tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    for name, kind in (("link", "symlink"), ("fifo", "FIFO")):
        with pytest.raises(UntrustedFileError, match=kind):
            s.size(str(tmp_path / name))
    with pytest.raises(FileNotFoundError):
        s.size(str(tmp_path / "none"))


@pytest.mark.parametrize("nbytes", [1000, (9 << 20) + 7])     # one plain read; parallel O_DIRECT pieces
def test_posix_read_hashed_reads_a_whole_file_with_and_without_its_checksum(tmp_path, nbytes):
    s = PosixStorage()
    data = os.urandom(nbytes)
    (tmp_path / "f.bin").write_bytes(data)
    heard: List[int] = []
    buf, digest = s.read_hashed(str(tmp_path / "f.bin"), mf.ALGO, heard.append)
    assert bytes(buf) == data and digest == mf.checksum(data) and sum(heard) == nbytes
    buf, digest = s.read_hashed(str(tmp_path / "f.bin"), None, None, nbytes)
    assert bytes(buf) == data and digest is None
    with pytest.raises(OSError, match="shrank"):           # a size larger than the file: never stitched
        s.read_hashed(str(tmp_path / "f.bin"), mf.ALGO, None, nbytes + 10)
    os.symlink(tmp_path / "f.bin", tmp_path / "link")
    with pytest.raises(UntrustedFileError):
        s.read_hashed(str(tmp_path / "link"), mf.ALGO)


def test_posix_read_into_and_read_ranges_are_short_only_at_the_end(tmp_path):
    s = PosixStorage()
    data = os.urandom(4096 + 3)
    path = str(tmp_path / "f.bin")
    (tmp_path / "f.bin").write_bytes(data)
    view = memoryview(bytearray(100))
    assert s.read_into(path, 10, view) == 100 and bytes(view) == data[10:110]
    assert s.read_into(path, len(data) - 5, view) == 5 and bytes(view[:5]) == data[-5:]
    got = s.read_ranges(path, [(0, 3), (4000, 50), (len(data) - 2, 9)])
    assert [bytes(b) for b in got] == [data[:3], data[4000:4050], data[-2:]]
    os.symlink(path, tmp_path / "link")
    with pytest.raises(UntrustedFileError):
        s.read_ranges(str(tmp_path / "link"), [(0, 1)])
    s.check(str(tmp_path))          # a file system's checks are config.py's: nothing here


def test_a_steps_files_are_read_through_the_storage_it_is_given(tmp_path):
    """stepfiles reads a step through the Storage verbs alone: a back-end that is not the one its name picks is
    used as given (a SaveDir's), for the manifest, sizes, whole files, items and verification."""
    step = tmp_path / "step_00000001"
    step.mkdir()
    data = os.urandom(3000)
    (step / "a.bin").write_bytes(data)
    items = (mf.Item(0, 1000, mf.checksum(data[:1000]), ["x", None, None]),
             mf.Item(1000, 2000, mf.checksum(data[1000:]), ["y", None, None]))
    man = mf.build(1, JOB, "pytorch", 1, {"a.bin": mf.FileEntry(len(data), mf.checksum(data), None, items)}, {})
    (step / mf.MANIFEST_NAME).write_bytes(man.to_bytes())
    asked: List[str] = []
    seen: Any = _Recording(PosixStorage(), asked)
    loaded = stepfiles.load(str(step), storage=seen)
    assert loaded.files["a.bin"].size == 3000 and stepfiles.check_sizes(str(step), loaded, storage=seen) == []
    assert stepfiles.read_verified(str(step), "a.bin", loaded, storage=seen) == data
    kept: Dict[int, bytearray] = {}
    assert stepfiles.read_items(str(step), "a.bin", loaded, [1], keep=kept, storage=seen) == (None, 2000)
    assert bytes(kept[1]) == data[1000:]
    assert stepfiles.verify_file(str(step), "a.bin", loaded, storage=seen, chunk=1024) is None
    assert stepfiles.owner_problem(str(step), ["a.bin"], storage=seen) is None
    assert {"size", "read", "read_hashed", "read_ranges", "read_into", "owner"} <= set(asked)


class _Recording:
    def __init__(self, inner: Storage, asked: List[str]):
        self.inner, self.asked = inner, asked

    def __getattr__(self, name: str) -> Any:
        self.asked.append(name)
        return getattr(self.inner, name)


# ---- the commit path walks each module once ----------------------------------------------------------------------

_COMMIT_MODULES = ("savedir", "commit", "renamecommit", "manifestcommit")


def _module_walk(run: Any) -> List[str]:
    """The storage modules of the commit concern that ``run()`` is in, in order, each stretch once (leaves such as
    the back-end, stepfiles, markers, damaged and formats/ are passed through, not counted)."""
    import sys
    walk: List[str] = []

    def module_of(frame: Any) -> Optional[str]:
        while frame is not None:
            name = os.path.splitext(os.path.basename(frame.f_code.co_filename))[0]
            if "easyckpt/storage/" in frame.f_code.co_filename and name in _COMMIT_MODULES:
                return name
            if "easyckpt/" in frame.f_code.co_filename and "/storage/" not in frame.f_code.co_filename:
                return None                      # back in the caller (jobdir, the test)
            frame = frame.f_back
        return None

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event not in ("call", "return"):
            return
        where = module_of(frame if event == "call" else frame.f_back)
        if where is not None and (not walk or walk[-1] != where):
            walk.append(where)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return walk


def _returns(walk: List[str]) -> int:
    return sum(1 for i, m in enumerate(walk) if m in walk[:i])


class _NoRename:
    """The POSIX file system as an object store would be used: no rename, so the manifest commit."""
    has_rename = False

    def __init__(self) -> None:
        self.inner = PosixStorage()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write_atomic(self, path: str, data: bytes) -> None:       # a key needs no directory made first
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.inner.write_atomic(path, data)


@pytest.mark.parametrize("renames", [True, False])
def test_the_commit_path_returns_at_most_once_to_a_module_it_left(tmp_path, renames):
    """From JobDir.commit's call (sd.commits.commit) each strategy runs its whole sequence in its own module; it
    enters the save dir once (the run's number: SaveDir.run_seq) and comes back once, never bouncing between them
    (everything else it calls is a leaf: the back-end, markers, damaged, tracker, stepfiles, formats/)."""
    storage: Any = PosixStorage() if renames else _NoRename()
    sd = SaveDir(str(tmp_path), NAMINGS["megatron"], JOB, storage=storage)
    assert isinstance(sd.commits, RenameCommit if renames else ManifestCommit)
    sd.begin_step(5)
    stage(sd, 5)
    walk = _module_walk(lambda: sd.commits.commit(5, 1, LOG))
    assert intact(sd, 5) and sd.tracker_step() == 5
    strategy = "renamecommit" if renames else "manifestcommit"
    assert walk == [strategy, "savedir", strategy] and _returns(walk) == 1, walk
