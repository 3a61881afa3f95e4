"""The commit on an object store, which has no rename: the manifest written last is the commit (Orbax's "commit
file"). A prefix without a manifest is invisible to readers; a manifest is created only if none is there.

The order of calls; the order IS the design:

  every rank:       begin_step(): refuse a prefix a manifest commits (its objects would be overwritten in place),
                    then write this job's claim object there (layout.claim_name; idempotent, every rank does it)
  every rank:       write the files under the step's final prefix (agent/stepwriter.py; an object appears whole
                    when its upload completes, so there is nothing to fsync)
  every rank:       markers.write()           rank r's files are complete (a plain PUT)
  coordinator:      ready_ranks() == world    IMPORTANT: commit only after every rank's marker (and the claim there)
  coordinator:      ManifestCommit.commit():
      1. merge the markers into the manifest (markers.merge; the run's number: SaveDir.run_seq)
      2. create the manifest only if no manifest is there (Storage.create_exclusive, a conditional PUT): the
         commit, never over another commit of the name (AlreadyCommitted)
      3. delete the markers and this job's claim (one request)
      4. update the tracker (tracker.write)
  deletes (delete_dir): Storage.delete of the prefix, which deletes the manifest FIRST, so a half-deleted step is
  never read as a checkpoint.

A crash before 2 leaves a claimed prefix without a manifest: invisible, and only this job's next agent removes it
(remove_staging: its unfinished uploads aborted, then every object). A crash between 2 and 3 leaves a committed
step with its markers and claim: remove_staging drops those and keeps the step.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Set, Tuple

from easyckpt import _faults as faults
from easyckpt.formats import layout
from easyckpt.formats import manifest as mf
from easyckpt.storage import markers, stepfiles, tracker
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.commit import Committed, Owner, taken_words


class ManifestCommit:
    polls = True
    where = "prefix"

    def __init__(self, owner: Owner):
        self.owner, self.storage, self.root = owner, owner.storage, owner.root

    def _job(self) -> str:
        if self.owner.job_id is None:
            raise ValueError(f"{self.root}: a SaveDir without a job id only reads")
        return self.owner.job_id

    def _owns(self, man: mf.Manifest) -> bool:
        return man.same_job(self._job(), self.owner.job_name)

    def staging_path(self, step: int) -> str:
        """The step's final prefix: no staging on a store."""
        return os.path.join(self.root, self.owner.naming.dir_name(step))

    def _claim(self, step: int) -> str:
        return os.path.join(self.staging_path(step), layout.claim_name(self._job()))

    def begin_step(self, step: int) -> None:
        final = self.staging_path(step)
        if self.storage.is_file(os.path.join(final, mf.MANIFEST_NAME)):
            man = stepfiles.read(final, storage=self.storage)
            if man is None or not self._owns(man):
                raise FileExistsError(taken_words(final, step, man, "an object store writes a step in place, "
                                                                           "so this job does not write over it",
                                                         self.where))
            raise FileExistsError(f"{final} holds this job's step {step}, committed by an earlier run: in an object "
                                  f"store a step is written in place, so it is not written over (easyckpt prune, or "
                                  f"resume from it, to go on)")
        self.storage.write_atomic(self._claim(step), b"")

    def ready_ranks(self, step: int) -> Optional[Set[int]]:
        """The ranks whose shard of ``step`` is complete, or None when this job's claim is not there (never
        begun, failed and removed, or committed)."""
        final = self.staging_path(step)
        if not self.storage.is_dir(final) or not self.storage.exists(self._claim(step)):
            return None
        return set(markers.read(self.storage, final))

    def commit(self, step: int, world_size: int, log: AuditLog) -> Committed:
        """Make step ``step`` a committed checkpoint (1-4 above); every rank's marker must be present."""
        final = self.staging_path(step)
        found = markers.read(self.storage, final)
        manifest = markers.manifest(self.owner, self._job(), step, world_size, found)    # 1
        try:
            faults.inject("agent.before_rename")
            self.storage.create_exclusive(os.path.join(final, mf.MANIFEST_NAME), manifest.to_bytes())    # 2
        except Exception:
            self.remove_staging(log, step=step)    # keeps a step a manifest commits; removes an unfinished one
            raise
        faults.inject("agent.after_rename")
        self.storage.delete_files([os.path.join(final, layout.marker_name(rank)) for rank in sorted(found)]
                                  + [self._claim(step)])    # 3
        return tracker.finish(self.storage, self.root, self.owner.naming, step, final, manifest)    # 4

    def delete_dir(self, path: str, log: AuditLog, reason: str, **fields: Any) -> None:
        """Logged first; the store deletes the manifest first: never a half-deleted checkpoint."""
        log.emit("delete", path=path, reason=reason, **fields)
        self.storage.delete(path)

    def remove_staging(self, log: AuditLog, step: Optional[int] = None, only: Optional[str] = None) -> None:
        """This job's claimed step prefixes (or only ``step``'s / ``only``): an unfinished one goes whole, its
        unfinished uploads aborted; one that a manifest commits keeps everything but the claim and markers (a
        commit that died before dropping them)."""
        if step is not None:
            only = self.staging_path(step)
        for path in ([only] if only is not None else self.staging_dirs()):
            parsed = self.owner.naming.parse(os.path.basename(path))
            if parsed is None or not self.storage.exists(self._claim(parsed)):
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
            self.storage.delete(self._claim(parsed))

    def _claims(self, step_dir: str) -> List[str]:
        """The job ids that claim an (unfinished) step prefix."""
        try:
            names = self.storage.listdir(step_dir)
        except FileNotFoundError:
            return []
        return [job for job in map(layout.parse_claim, names) if job is not None]

    def staging_dirs(self) -> List[str]:
        """The step prefixes with this job's claim."""
        job = self._job()
        return [path for _, path in self.owner.step_dirs() if job in self._claims(path)]

    def staging_entries(self) -> List[Tuple[int, str, str]]:
        """(step, job id, path) of every claimed step prefix of this naming."""
        return [(step, job, path) for step, path in self.owner.step_dirs() for job in self._claims(path)]
