"""One save directory: the only owner of what is in it, over a Storage back-end (base.py).

Names come from formats/layout.py, paths are made here; every write, rename and delete in the save
directory goes through ``self.storage``. What each verb does to disk, in order, is base.py's docstring;
why that order, commit.py's; what may be deleted, retention.py's.

    names       step_path(step), staging_path(step), marker name, tracker, trash, damaged record
    listing     step_dirs() (named like a step), committed() (with a manifest of that step, newest commit
                first: by run, then step), owns(manifest), staging_dirs() (this job's),
                staging_entries() (every job's, for the operator tools), quarantined()
    per rank    write_marker(step, rank, ...), read_markers(step), ready_ranks(step)
    deletes     delete_dir(), the one trash-then-delete: retention.py's prune and remove_staging(log) use it
The commit (commit.py) and pruning (retention.py) are functions over a SaveDir, not methods of it: they
use its verbs, it never calls them.
    damaged     mark_damaged(step, why, log), read_damaged()
    quarantine  quarantine(step, why, log): a committed step renamed aside, kept whole, out of every listing
    derived     add_file(step_dir, rel, data), add_to_manifest(step_dir, entries) (converters' outputs)
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from easyckpt import console
from easyckpt.errors import CheckpointError, UntrustedFileError
from easyckpt.formats import layout, paths
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import Naming
from easyckpt.formats.marker import Marker
from easyckpt.storage import stepfiles
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.base import Storage
from easyckpt.storage.resolve import set_endpoint, storage_for

_MAX_RECORD_BYTES = 1 << 20     # markers and the damaged record are small JSON; a larger one is not ours
_SAID: Set[str] = set()


def _say_once(text: str) -> None:
    """A warning on the console once per process: retention reads the damaged record after every commit."""
    if text not in _SAID:
        _SAID.add(text)
        console.warning(text)


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
        self.run_seqs: Dict[str, int] = {}      # run token -> its number, as the commit decided it (commit.py)

    @classmethod
    def of(cls, cfg: Any, storage: Optional[Storage] = None) -> "SaveDir":
        """The save directory of the job ``cfg`` (a Config) describes (an s3:// one through the job's endpoint)."""
        set_endpoint(cfg.endpoint_url)
        return cls(cfg.save_dir, cfg.naming, cfg.job_id, storage, job_name=cfg.job_name or "")

    @property
    def renames(self) -> bool:
        """A file system: steps are staged aside and renamed into place. False on an object store: a step's
        objects go under its final prefix, with this job's claim, and the manifest written last commits it."""
        return self.storage.has_rename

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
        if not self.renames:
            return self.step_path(step)
        return self.path(layout.staging_name(self._job(), self.naming.dir_name(step)))

    def claim_path(self, step: int) -> str:
        return os.path.join(self.step_path(step), layout.claim_name(self._job()))

    def begin_step(self, step: int) -> None:
        """Before a rank writes ``step`` on an object store: refuse a prefix that holds a committed step (its
        objects would be overwritten in place), then claim it for this job (idempotent: every rank does it). A
        file system needs nothing: the step is staged in a directory of its own (stepwriter.py makes it)."""
        if self.renames:
            return
        final = self.step_path(step)
        if self.storage.is_file(os.path.join(final, mf.MANIFEST_NAME)):
            man = stepfiles.read(final)
            if man is None or not self.owns(man):
                raise FileExistsError(self.taken_words(final, step, man, "an object store writes a step in place, "
                                                                         "so this job does not write over it"))
            raise FileExistsError(f"{final} holds this job's step {step}, committed by an earlier run: in an object "
                                  f"store a step is written in place, so it is not written over (easyckpt prune, or "
                                  f"resume from it, to go on)")
        self.storage.write_atomic(self.claim_path(step), b"")

    def taken_words(self, final: str, step: int, man: Optional[mf.Manifest], why: str) -> str:
        """Why ``step`` cannot be committed here: the name holds a step another job committed (``man``, a validated
        manifest, or None when it does not validate). Names that job and advises what frees this job's way, never
        deleting a checkpoint that is not its own (docs/reliability.md promise 4)."""
        where = "prefix" if not self.renames else "save_dir"
        if man is None:
            return (f"{final} holds a step whose {mf.MANIFEST_NAME} is not one this job can read; {why}: give this "
                    f"job a {where} of its own")
        # the manifest is input from whoever wrote it: its job name is shown quoted and cut, offered only if typable
        name = man.job if man.job is not None and len(man.job) <= 64 and man.job.isprintable() else None
        shown = repr(man.job[:64]) + ("..." if len(man.job) > 64 else "") if man.job is not None else None
        owner = (f"job {shown} (job id {man.job_id[:32]!r})" if shown is not None
                 else f"job id {man.job_id[:32]!r}")
        cont = f"; or, if this run continues job {name!r}, set job_name={name!r} to resume it" if name else ""
        return (f"{final} holds step {step} of another job, {owner}; {why}. That checkpoint is not this job's to "
                f"delete: give this job a {where} of its own{cont}")

    def trash_path(self, victim: str) -> str:
        """Where a directory goes before it is deleted (a rename is atomic, a tree delete is not); named after
        the job, so that a restart of this job finishes only its own deletions."""
        return self.path(layout.trash_name(self._job(), os.path.basename(victim), os.getpid()))

    # ---- listing ------------------------------------------------------------------------------------

    def _names(self) -> List[str]:
        try:
            return self.storage.listdir(self.root)
        except FileNotFoundError:
            return []

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
            man = stepfiles.committed(path, step)
            # own: what this job may prune or replace, so never a step directory another user owns
            if man is not None and (not own or (self.owns(man) and stepfiles.owner_problem(path) is None)):
                out.append((step, path, man))
        return sorted(out, key=lambda e: (e[2].run_key, e[0]), reverse=True)

    def owns(self, man: mf.Manifest) -> bool:
        """Whether a validated manifest is a step of this job (Manifest.same_job)."""
        return man.same_job(self._job(), self.job_name)

    def is_committed(self, step: int) -> bool:
        return stepfiles.committed(self.step_path(step), step) is not None

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
        if not self.renames:
            return [path for _, path in self.step_dirs() if self._job() in self._claims(path)]
        prefix = layout.own_prefixes(self._job())[0]
        return sorted(self.path(n) for n in self._names() if n.startswith(prefix))

    def staging_entries(self) -> List[Tuple[int, str, str]]:
        """(step, job id, path) of every job's staging directory of this naming."""
        if not self.renames:
            return [(step, job, path) for step, path in self.step_dirs() for job in self._claims(path)]
        out = []
        for name in sorted(self._dirs()):
            parsed = layout.parse_staging(name)
            if parsed is None:
                continue
            step = self.naming.parse(parsed[1])
            if step is not None:
                out.append((step, parsed[0], self.path(name)))
        return out

    def _claims(self, step_dir: str) -> List[str]:
        """The job ids that claim an (unfinished) step prefix on an object store."""
        try:
            names = self.storage.listdir(step_dir)
        except FileNotFoundError:
            return []
        return [job for job in map(layout.parse_claim, names) if job is not None]

    def tracker_step(self) -> Optional[int]:
        """The step the framework's tracker names, or None (no tracker, unreadable, not a regular file)."""
        if not self.naming.tracker:
            return None
        try:
            text = self.storage.read(self.path(self.naming.tracker), 0, 256)
        except OSError:
            return None
        return self.naming.parse_tracker(text.decode("ascii", "replace"))

    def open_agent_log(self, host: str) -> Tuple[str, int]:
        """(path, an append-only fd) of the node agent's console log, never opened through a symlink planted
        in the save dir (docs/reliability.md promise 9); the caller hands the fd to the agent's process and
        closes it. Never one another user made either (docs/reliability.md promise 15)."""
        path = self.path(layout.agent_log_name(host))
        return path, paths.open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    # ---- per-rank markers -----------------------------------------------------------------------------

    def write_marker(self, step: int, rank: int, files: Dict[str, mf.FileEntry],
                     info: Optional[Dict[str, Any]] = None) -> None:
        """Rank ``rank``'s files of ``step`` are durable in its staging dir (written after they are)."""
        self.storage.write_atomic(os.path.join(self.staging_path(step), layout.marker_name(rank)),
                                  Marker(rank, step, files, info or {}).to_json())

    def read_markers(self, step: int) -> Dict[int, Marker]:
        """rank -> its marker, for every valid marker in ``step``'s staging dir (none when it is gone)."""
        staging = self.staging_path(step)
        try:
            names = self.storage.listdir(staging)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for name in names:
            if layout.parse_marker(name) is None:
                continue
            try:
                marker = Marker.parse(self.storage.read(os.path.join(staging, name), 0, _MAX_RECORD_BYTES))
            except (OSError, ValueError):
                continue
            out[marker.rank] = marker
        return out

    def ready_ranks(self, step: int) -> Optional[Set[int]]:
        """The ranks whose shard of ``step`` is durable, or None when its staging dir is not there (never
        made, failed and removed, or committed; on an object store: this job's claim is not there)."""
        if not self.storage.is_dir(self.staging_path(step)):
            return None
        if not self.renames and not self.storage.exists(self.claim_path(step)):
            return None
        return set(self.read_markers(step))

    # ---- commit and deletes ----------------------------------------------------------------------------

    def delete_dir(self, path: str, log: AuditLog, reason: str, **fields: Any) -> None:
        """Trash-then-delete, logged first: a crash mid-delete never leaves a half-deleted directory under a
        checkpoint's name (the rename is atomic; the trash goes at this job's next start if not now)."""
        log.emit("delete", path=path, reason=reason, **fields)
        if not self.renames:             # the store deletes the manifest first: never a half-deleted checkpoint
            self.storage.delete(path)
            return
        trash = self.trash_path(path)
        self.storage.rename_noreplace(path, trash)
        self.storage.sync_dir(self.root)
        self.storage.delete(trash)

    def remove_staging(self, log: AuditLog, step: Optional[int] = None, only: Optional[str] = None) -> None:
        """Remove this job's staging (and trash) leftovers, or only those of ``step`` / at path ``only``;
        never anything without this job's prefix."""
        if step is not None:
            only = self.staging_path(step)
        if not self.renames:
            self._remove_claimed(log, only)
            return
        for name in self._names():
            path = self.path(name)
            if not name.startswith(layout.own_prefixes(self._job())) or (only is not None and path != only):
                continue
            log.emit("delete", path=path, reason="staging leftover")
            self.storage.delete(path)

    def _remove_claimed(self, log: AuditLog, only: Optional[str]) -> None:
        """remove_staging on an object store: this job's claimed step prefixes (or only ``only``): an
        unfinished one goes whole, its unfinished uploads aborted; one that a manifest commits keeps everything
        but the claim and markers (a commit that died before dropping them)."""
        for path in ([only] if only is not None else self.staging_dirs()):
            step = self.naming.parse(os.path.basename(path))
            if step is None or not self.storage.exists(self.claim_path(step)):
                continue
            if self.storage.exists(os.path.join(path, mf.MANIFEST_NAME)):
                for name in self.storage.listdir(path):
                    if layout.parse_marker(name) is not None:
                        self.storage.delete(os.path.join(path, name))
            else:
                log.emit("delete", path=path, reason="staging leftover")
                aborted = self.storage.abort_uploads(path)
                if aborted:
                    log.emit("delete", path=path, reason="unfinished uploads aborted", keys=len(aborted))
                self.storage.delete(path)
            self.storage.delete(self.claim_path(step))

    def quarantine(self, step: int, reason: str, log: AuditLog) -> Optional[str]:
        """Set committed step ``step`` aside under a quarantine name (layout.quarantine_name), whole: no
        loader, retention or commit takes it any more, nothing in it changes. Logged first. Returns the new
        path, or None when there is no committed step of this job by that name (a request from a trainer
        never sets aside another job's step, nor one another user owns)."""
        final = self.step_path(step)
        man = stepfiles.read(final) if self.storage.is_dir(final) else None
        if man is None or man.step != step or not self.owns(man) or stepfiles.owner_problem(final):
            log.emit("warning", step=step, path=final, message="not set aside: no committed step of this job there")
            return None
        stamp = time.time_ns() // 1000
        while True:
            dest = self.path(layout.quarantine_name(os.path.basename(final), stamp))
            if not self.storage.exists(dest):
                break
            stamp += 1
        log.emit("quarantine", step=step, path=final, to=dest, reason=reason[:500])
        self.storage.set_aside(final, dest)     # an object store: copied, then the original deleted
        self.clear_damaged(os.path.basename(final))
        return dest

    # ---- the damaged record ----------------------------------------------------------------------------

    def mark_damaged(self, step: int, reason: str, log: AuditLog) -> None:
        """Record that the loader rejected committed step ``step`` (retention then never keeps it in place of
        a verified one). The record survives restarts; it is a hint, trusted only to order deletions."""
        name = self.naming.dir_name(step)
        log.emit("damaged", path=self.path(name), reason=reason[:500])
        record = self._record()
        if record is not None:
            record[name] = reason[:500]
            self._write_damaged(record)

    def read_damaged(self) -> Dict[str, str]:
        """{step directory name: why the loader rejected it}; empty when there is no valid record."""
        return self._record() or {}

    def clear_damaged(self, name: str) -> None:
        """A new commit under a name the loader once rejected is a new, verified checkpoint."""
        record = self._record()
        if record is not None and record.pop(name, None) is not None:
            self._write_damaged(record)

    def _record(self) -> Optional[Dict[str, str]]:
        """The damaged record as far as it is valid ({} when there is none); None when another user owns it or may
        write it: refused, said once, and never rewritten, for it orders deletions, and one planted in a shared save
        dir would have this job delete its intact steps (docs/reliability.md promise 15)."""
        try:
            data = json.loads(self.storage.read_own(self.path(layout.DAMAGED_NAME), _MAX_RECORD_BYTES) or b"{}")
        except UntrustedFileError as exc:
            _say_once(f"{exc}; the job goes on without it (retention takes every step of this job as intact)")
            return None
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}

    def _write_damaged(self, record: Dict[str, str]) -> None:
        self.storage.write_atomic(self.path(layout.DAMAGED_NAME),
                                  json.dumps(record, indent=1, sort_keys=True).encode())

    # ---- derived files (converters) ----------------------------------------------------------------------

    def add_file(self, step_dir: str, rel: str, data: bytes) -> None:
        """Add a derived file (a converter's output) to a committed step: durable before it is listed."""
        path = os.path.join(step_dir, rel)
        self.storage.makedirs(os.path.dirname(path))
        self.storage.write_atomic(path, data)

    def add_to_manifest(self, step_dir: str, entries: Dict[str, mf.FileEntry]) -> None:
        """List files already written by add_file in the step's manifest (rewritten atomically)."""
        man = stepfiles.read(step_dir)
        if man is None:
            raise CheckpointError(f"{step_dir} has no valid manifest")
        self.write_manifest(step_dir, man.with_files(entries))

    def write_manifest(self, step_dir: str, man: mf.Manifest) -> None:
        self.storage.write_atomic(os.path.join(step_dir, mf.MANIFEST_NAME), man.to_bytes())
