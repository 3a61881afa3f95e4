"""The commit on a file system: a step staged aside under this job's name, renamed into place.

The order of calls (docs/reliability.md, "The durable sequence"); the order IS the design:

  all ranks, per shard (agent/stepwriter.py): write files into the staging dir → fsync each file and dir
  all ranks:        markers.write()           rank r's files are durable (temp, fsync, rename)
  coordinator:      ready_ranks() == world    IMPORTANT: commit only after every rank's marker
  coordinator:      RenameCommit.commit():
      1. merge the markers into the manifest (markers.merge; the run's number: SaveDir.run_seq); write it
         (temp, fsync, rename); drop the markers
      2. fsync the staging dir
      3. rename staging → final name, never over an existing directory (a step already there: _retire_existing)
      4. fsync save_dir (the rename is durable only now)
      5. update the tracker (tracker.write: temp, fsync, rename, fsync save_dir): a hint for the frameworks' own
         loaders; easyckpt's loader trusts manifests, so a crash between 4 and 5 loses nothing.
  deletes (delete_dir: retention's prune, a replaced step): rename to a trash name of this job, fsync save_dir,
  then delete the tree: a crash mid-delete never leaves a half-deleted directory under a checkpoint's name.

A crash anywhere leaves either no visible step directory (before 3) or a complete one (after 3). A failure (not a
crash) from 1 to 3 also removes the staging dir: its markers are gone after 1, so it could never commit, and the
error says what failed. Staging and trash directories carry this job's id in their name, so a restart removes only
its own leftovers (remove_staging).
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Set, Tuple

from easyckpt import _faults as faults
from easyckpt.formats import layout
from easyckpt.formats import manifest as mf
from easyckpt.storage import damaged, markers, stepfiles, tracker
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.commit import Committed, Owner, taken_words


class RenameCommit:
    polls = False
    where = "save_dir"

    def __init__(self, owner: Owner):
        self.owner, self.storage, self.root = owner, owner.storage, owner.root

    def _job(self) -> str:
        if self.owner.job_id is None:
            raise ValueError(f"{self.root}: a SaveDir without a job id only reads")
        return self.owner.job_id

    def _owns(self, man: mf.Manifest) -> bool:
        return man.same_job(self._job(), self.owner.job_name)

    def _final(self, step: int) -> str:
        return os.path.join(self.root, self.owner.naming.dir_name(step))

    def staging_path(self, step: int) -> str:
        job = self._job()
        return os.path.join(self.root, layout.staging_name(job, self.owner.naming.dir_name(step)))

    def begin_step(self, step: int) -> None:
        """Nothing: the step is staged in a directory of its own (stepwriter.py makes it)."""

    def ready_ranks(self, step: int) -> Optional[Set[int]]:
        """The ranks whose shard of ``step`` is durable, or None when its staging dir is not there (never made,
        failed and removed, or committed)."""
        staging = self.staging_path(step)
        if not self.storage.is_dir(staging):
            return None
        return set(markers.read(self.storage, staging))

    def commit(self, step: int, world_size: int, log: AuditLog) -> Committed:
        """Make step ``step`` a committed checkpoint (1-5 above); every rank's marker must be present."""
        staging, final = self.staging_path(step), self._final(step)
        found = markers.read(self.storage, staging)
        manifest = markers.manifest(self.owner, self._job(), step, world_size, found)
        try:
            self.storage.write_atomic(os.path.join(staging, mf.MANIFEST_NAME), manifest.to_bytes())    # 1
            faults.inject("agent.after_manifest")
            for rank in sorted(found):
                self.storage.delete(os.path.join(staging, layout.marker_name(rank)))
            self.storage.sync_dir(staging)    # 2
            faults.inject("agent.before_rename")
            self.storage.check_own_dir(staging)     # what becomes the step dir is ours (a rename keeps its owner)
            if self.storage.exists(final):
                self._retire_existing(step, final, manifest, log)
            self.storage.rename_noreplace(staging, final)    # 3
        except Exception:
            self.remove_staging(log, step=step)    # (a crash leaves it instead: the job's next start removes it)
            raise
        faults.inject("agent.after_rename")
        self.storage.sync_dir(self.root)    # 4
        return tracker.finish(self.storage, self.root, self.owner.naming, step, final, manifest)    # 5

    def _retire_existing(self, step: int, final: str, new: mf.Manifest, log: AuditLog) -> None:
        """A step directory of the same name exists. A foreign one (not easyckpt's, another job's) is never
        touched (docs/reliability.md promise 4). One of this job is replaced only when nothing is lost by it:
        committed by this same run (a fresh snapshot of the step, e.g. with evaluation results) or rejected as
        damaged by the loader; any other (an older run's step a fresh start or a resume from an older step reaches
        again) is quarantined: renamed aside, kept whole, listed by ``easyckpt ls`` (docs/reliability.md promise 12)."""
        planted = stepfiles.owner_problem(final, storage=self.storage)
        if planted:
            raise FileExistsError(f"{final}: {planted}; refusing to replace it")
        man = stepfiles.read(final, storage=self.storage)
        if man is None and self.storage.listdir(final):
            raise FileExistsError(f"{final} exists and is not an easyckpt checkpoint; refusing to replace it")
        if man is not None and not self._owns(man):
            raise FileExistsError(taken_words(final, step, man, "it is never replaced", self.where))
        rejected = damaged.read(self.storage, self.root).get(os.path.basename(final))
        if man is None or rejected is not None or man.run_key == new.run_key:
            why = (f"replaced by a newer commit of the same step (the old one was rejected: {rejected})" if rejected
                   else "replaced by a newer commit of the same step")
            self.delete_dir(final, log, why)
            return
        damaged.quarantine(self.storage, final, step, self._owns,
                           "an older run's commit of this step; a newer run committed it again", log)

    def delete_dir(self, path: str, log: AuditLog, reason: str, **fields: Any) -> None:
        """Trash-then-delete, logged first (the trash goes at this job's next start if not now)."""
        log.emit("delete", path=path, reason=reason, **fields)
        trash = os.path.join(self.root, layout.trash_name(self._job(), os.path.basename(path),
                                                          os.getpid()))
        self.storage.rename_noreplace(path, trash)
        self.storage.sync_dir(self.root)
        self.storage.delete(trash)

    def remove_staging(self, log: AuditLog, step: Optional[int] = None, only: Optional[str] = None) -> None:
        """Remove this job's staging (and trash) leftovers, or only those of ``step`` / at path ``only``; never
        anything without this job's prefix."""
        if step is not None:
            only = self.staging_path(step)
        own = layout.own_prefixes(self._job())
        for name in self._names():
            path = os.path.join(self.root, name)
            if not name.startswith(own) or (only is not None and path != only):
                continue
            log.emit("delete", path=path, reason="staging leftover")
            self.storage.delete(path)

    def _names(self) -> List[str]:
        try:
            return self.storage.listdir(self.root)
        except FileNotFoundError:
            return []

    def staging_dirs(self) -> List[str]:
        """This job's staging directories."""
        prefix = layout.own_prefixes(self._job())[0]
        return sorted(os.path.join(self.root, n) for n in self._names() if n.startswith(prefix))

    def staging_entries(self) -> List[Tuple[int, str, str]]:
        """(step, job id, path) of every job's staging directory of this naming."""
        out = []
        for name in sorted(self.storage.subdirs(self.root)):
            parsed = layout.parse_staging(name)
            if parsed is None:
                continue
            step = self.owner.naming.parse(parsed[1])
            if step is not None:
                out.append((step, parsed[0], os.path.join(self.root, name)))
        return out
