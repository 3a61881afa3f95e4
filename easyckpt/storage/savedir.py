"""One save directory: its names and its listings, over a Storage back-end (base.py) and a commit strategy
(commit.py) chosen once, here, by what the back-end can do.

Names come from formats/layout.py, paths are made here; every write, rename and delete in the save directory goes
through ``self.storage``, by the strategy (``self.commits``: renamecommit.py on a file system, manifestcommit.py on
an object store; each module's docstring is its order of calls), the per-rank markers (markers.py), the damaged
record and quarantine (damaged.py), and retention (retention.py: what may be deleted).

    names       path(name), step_path(step), staging_path(step) (the strategy's)
    listing     step_dirs() (named like a step), committed() (with a manifest of that step, newest commit
                first: by run, then step), owns(manifest), staging_dirs() (this job's), staging_entries() (every
                job's, for the operator tools), quarantined(), tracker_step(), run_seq(info) (a run's number)
The other verbs below are the one door the agent and the tools hold; each is one line into the module that does it.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Set, Tuple

from easyckpt.errors import CheckpointError
from easyckpt.formats import layout, paths
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import Naming
from easyckpt.formats.marker import Marker
from easyckpt.storage import damaged, markers, stepfiles, tracker
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.base import Storage
from easyckpt.storage.commit import Commit, Committed, taken_words
from easyckpt.storage.manifestcommit import ManifestCommit
from easyckpt.storage.renamecommit import RenameCommit
from easyckpt.storage.resolve import set_endpoint, storage_for


class SaveDir:
    """``job_id`` None: a reader that does not belong to a job (``easyckpt ls``): it may list, not write.
    ``job_name``: the job's name setting ("" when unset); a step is this job's when its manifest carries the
    same name (Manifest.same_job), so a copied or moved directory stays the job's own. None: by job id alone."""

    def __init__(self, save_dir: str, naming: Naming, job_id: Optional[str] = None,
                 storage: Optional[Storage] = None, job_name: Optional[str] = None):
        self.root = str(save_dir)
        self.naming = naming
        self.job_id = job_id
        self.job_name = job_name
        self.storage: Storage = storage if storage is not None else storage_for(self.root)
        self.run_seqs: Dict[str, int] = {}      # run token -> its number, as the commit decided it (run_seq)
        # the commit strategy, chosen once: a rename where the back-end has one, else the manifest written last
        self.commits: Commit = RenameCommit(self) if self.storage.has_rename else ManifestCommit(self)

    @classmethod
    def of(cls, cfg: Any, storage: Optional[Storage] = None) -> "SaveDir":
        """The save directory of the job ``cfg`` (a Config) describes (an s3:// one through the job's endpoint)."""
        set_endpoint(cfg.endpoint_url)
        return cls(cfg.save_dir, cfg.naming, cfg.job_id, storage, job_name=cfg.job_name or "")

    def _job(self) -> str:
        if self.job_id is None:
            raise ValueError(f"{self.root}: a SaveDir without a job id only reads")
        return self.job_id

    # ---- names --------------------------------------------------------------------------------------

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def step_path(self, step: int) -> str:
        return self.path(self.naming.dir_name(step))

    def staging_path(self, step: int) -> str:
        """Where a rank's files of ``step`` go: this job's staging dir, or on an object store the final prefix."""
        return self.commits.staging_path(step)

    # ---- listing ------------------------------------------------------------------------------------

    def _dirs(self) -> List[str]:
        return self.storage.subdirs(self.root)

    def step_dirs(self) -> List[Tuple[int, str]]:
        """(step, path) of every directory named like a step directory, newest first."""
        out = []
        for name in self._dirs():
            step = self.naming.parse(name)
            if step is not None:
                out.append((step, self.path(name)))
        return sorted(out, reverse=True)

    def committed(self, own: bool = False) -> List[Tuple[int, str]]:
        """Step directories with a valid manifest of the same step (only this job's if ``own``), newest
        commit first: by run, then step (Manifest.run_key), so that a new run's commits are never taken for older
        than a previous run's higher step numbers."""
        return [(step, path) for step, path, _ in self.committed_manifests(own)]

    def committed_manifests(self, own: bool = False) -> List[Tuple[int, str, mf.Manifest]]:
        """committed(), each with its manifest."""
        if own:
            self._job()
        out = []
        for step, path in self.step_dirs():
            man = stepfiles.committed(path, step, storage=self.storage)
            # own: what this job may prune or replace, so never a step directory another user owns
            if man is not None and (not own or (self.owns(man) and
                                                stepfiles.owner_problem(path, storage=self.storage) is None)):
                out.append((step, path, man))
        return sorted(out, key=lambda e: (e[2].run_key, e[0]), reverse=True)

    def owns(self, man: mf.Manifest) -> bool:
        """Whether a validated manifest is a step of this job (Manifest.same_job)."""
        return man.same_job(self._job(), self.job_name)

    def is_committed(self, step: int) -> bool:
        return stepfiles.committed(self.step_path(step), step, storage=self.storage) is not None

    def quarantined(self) -> List[Tuple[str, str]]:
        """(former step directory name, path) of every quarantined step, oldest first."""
        out = []
        for name in sorted(self._dirs()):
            parsed = layout.parse_quarantine(name)
            if parsed is not None and self.naming.parse(parsed[0]) is not None:
                out.append((parsed[1], parsed[0], self.path(name)))
        return [(final, path) for _, final, path in sorted(out)]

    def staging_dirs(self) -> List[str]:
        """This job's staging directories (on an object store: the step prefixes with this job's claim)."""
        return self.commits.staging_dirs()

    def staging_entries(self) -> List[Tuple[int, str, str]]:
        """(step, job id, path) of every job's staging directory of this naming."""
        return self.commits.staging_entries()

    def tracker_step(self) -> Optional[int]:
        """The step the framework's tracker names, or None (no tracker, unreadable, not a regular file)."""
        return tracker.read(self.storage, self.root, self.naming)

    def run_seq(self, info: Dict[str, Any]) -> int:
        """The number of the run whose rank 0 recorded ``info`` (the commit's, for its manifest): that of this job's
        committed steps of the same run, else (the run's first commit) one more than the newest run of this job in
        the save dir. Decided by the coordinator's agent under the job's lock (one committer at a time), from what
        the save dir holds, so that a run that started later is later whatever the ranks' clocks say (an NTP step,
        a node a day ahead): the wall-clock stamp ("run") only names the run, with the token its engine drew
        ("run_id") where there is one, and orders the steps committed before runs were numbered (Manifest.run_key)."""
        run_id, stamp = info.get("run_id"), info.get("run", 0)
        if isinstance(run_id, str) and run_id in self.run_seqs:
            return self.run_seqs[run_id]    # decided at the run's first commit: not a listing of every manifest again
        ours = [man for _, _, man in self.committed_manifests(own=True)]
        seq = max((man.run_seq for man in ours), default=0) + 1
        for man in ours:
            if isinstance(run_id, str):
                same = man.run_id == run_id
            else:                   # markers written without a token (older trainers): the run is its stamp
                same = man.run_id is None and man.info.get("run", 0) == stamp
            if same and man.run_seq:
                seq = man.run_seq
                break
        if isinstance(run_id, str):
            self.run_seqs[run_id] = seq
        return seq

    def open_agent_log(self, host: str) -> Tuple[str, int]:
        """(path, an append-only fd) of the node agent's console log, never opened through a symlink planted
        in the save dir (docs/reliability.md promise 9); the caller hands the fd to the agent's process and
        closes it. Never one another user made either (docs/reliability.md promise 15)."""
        path = self.path(layout.agent_log_name(host))
        return path, paths.open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    # ---- the door: each verb is one line into the module that does it ---------------------------------------------

    def begin_step(self, step: int) -> None:
        self.commits.begin_step(step)

    def commit(self, step: int, world_size: int, log: AuditLog) -> Committed:
        return self.commits.commit(step, world_size, log)

    def write_marker(self, step: int, rank: int, files: Dict[str, mf.FileEntry],
                     info: Optional[Dict[str, Any]] = None) -> None:
        markers.write(self.storage, self.staging_path(step), step, rank, files, info)

    def read_markers(self, step: int) -> Dict[int, Marker]:
        return markers.read(self.storage, self.staging_path(step))

    def ready_ranks(self, step: int) -> Optional[Set[int]]:
        return self.commits.ready_ranks(step)

    def taken_words(self, final: str, step: int, man: Optional[mf.Manifest], why: str) -> str:
        return taken_words(final, step, man, why, self.commits.where)

    def delete_dir(self, path: str, log: AuditLog, reason: str, **fields: Any) -> None:
        self.commits.delete_dir(path, log, reason, **fields)

    def remove_staging(self, log: AuditLog, step: Optional[int] = None, only: Optional[str] = None) -> None:
        self.commits.remove_staging(log, step, only)

    def quarantine(self, step: int, reason: str, log: AuditLog) -> Optional[str]:
        return damaged.quarantine(self.storage, self.step_path(step), step, self.owns, reason, log)

    def mark_damaged(self, step: int, reason: str, log: AuditLog) -> None:
        damaged.mark(self.storage, self.root, self.naming.dir_name(step), reason, log)

    def read_damaged(self) -> Dict[str, str]:
        return damaged.read(self.storage, self.root)

    def clear_damaged(self, name: str) -> None:
        damaged.clear(self.storage, self.root, name)

    # ---- derived files (converters) ----------------------------------------------------------------------

    def add_file(self, step_dir: str, rel: str, data: bytes) -> None:
        """Add a derived file (a converter's output) to a committed step: durable before it is listed."""
        path = os.path.join(step_dir, rel)
        self.storage.makedirs(os.path.dirname(path))
        self.storage.write_atomic(path, data)

    def add_to_manifest(self, step_dir: str, entries: Dict[str, mf.FileEntry]) -> None:
        """List files already written by add_file in the step's manifest (rewritten atomically)."""
        man = stepfiles.read(step_dir, storage=self.storage)
        if man is None:
            raise CheckpointError(f"{step_dir} has no valid manifest")
        self.write_manifest(step_dir, man.with_files(entries))

    def write_manifest(self, step_dir: str, man: mf.Manifest) -> None:
        self.storage.write_atomic(os.path.join(step_dir, mf.MANIFEST_NAME), man.to_bytes())
