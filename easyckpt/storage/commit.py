"""The commit: the sequence that makes a staged step a checkpoint (the agent's jobdir.py runs it).

Order of operations (docs/reliability.md, "The durable sequence"); the order IS the design:

  all ranks, per shard (agent/stepwriter.py): write files into the staging dir → fsync each file and dir
  all ranks:        SaveDir.write_marker()    rank r's files are durable (temp, fsync, rename)
  coordinator:      ready_ranks() == world    IMPORTANT: commit only after every rank's marker
  coordinator:      commit():
      1. merge the markers into the manifest; write it (temp, fsync, rename); drop the markers
      2. fsync the staging dir
      3. rename staging → final name, never over an existing directory
      4. fsync save_dir (the rename is durable only now)
      5. update the tracker (temp, fsync, rename, fsync save_dir): a hint for the frameworks' own
         loaders; easyckpt's loader trusts manifests, so a crash between 4 and 5 loses nothing.
  then:             retention.prune()  (only after a successful commit, with the manifest of step 1)

A crash anywhere leaves either no visible step directory (before 3) or a complete one (after 3).
A failure (not a crash) from 1 to 3 also removes the staging dir: its markers are gone after 1, so it
could never commit, and the error says what failed. Staging directories carry this job's id in their
name, so a restart removes only its own leftovers.

On a store without rename (base.py), 2 to 4 do not exist: the files are under the step's final prefix, and
the manifest, created in 1 only if no manifest is there (a conditional PUT), is the commit; the markers and
the job's claim are deleted after it (_commit_in_place).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, NamedTuple, Optional

from easyckpt import _faults as faults
from easyckpt.errors import TrackerNotUpdated
from easyckpt.formats import layout
from easyckpt.formats import manifest as mf
from easyckpt.storage import stepfiles
from easyckpt.storage.auditlog import AuditLog

if TYPE_CHECKING:
    from easyckpt.storage.savedir import SaveDir


class Committed(NamedTuple):
    path: str                      # the step directory, under its final name
    nbytes: int                    # what its files hold
    manifest: mf.Manifest          # as written: retention reads the adapter's "protect" from it, not from disk


def commit(sd: "SaveDir", step: int, world_size: int, log: AuditLog,
           extra: Optional[Dict[str, Any]] = None) -> Committed:
    """Make step ``step`` a committed checkpoint; every rank's marker must be present."""
    job_id = sd._job()
    staging = sd.staging_path(step)
    markers = sd.read_markers(step)
    steps = {m.step for m in markers.values()}
    if set(markers) != set(range(world_size)) or steps != {step}:
        raise RuntimeError(f"refusing to commit step {step}: shards from ranks {sorted(markers)} for steps "
                           f"{sorted(steps)}, expected every rank of {world_size} at step {step}")
    files: Dict[str, mf.FileEntry] = {}
    info: Dict[str, Any] = {}
    for rank in sorted(markers, reverse=True):   # what the adapter said on rank 0 wins
        files.update(markers[rank].files)
        info.update(markers[rank].info)
    manifest = mf.build(step, job_id, sd.naming.framework, world_size, files, info, job_name=sd.job_name,
                        run_seq=run_seq_of(sd, info))
    final = sd.step_path(step)
    if not sd.renames:
        _commit_in_place(sd, step, final, manifest, markers, log)
        return _after(sd, step, final, manifest)
    try:
        sd.write_manifest(staging, manifest)
        faults.inject("agent.after_manifest")
        for rank in sorted(markers):
            sd.storage.delete(os.path.join(staging, layout.marker_name(rank)))
        sd.storage.sync_dir(staging)
        faults.inject("agent.before_rename")
        sd.storage.check_own_dir(staging)     # what becomes the step dir is ours (a rename keeps its owner)
        if sd.storage.exists(final):
            _retire_existing(sd, step, final, manifest, log)
        sd.storage.rename_noreplace(staging, final)
    except Exception:
        sd.remove_staging(log, step=step)    # (a crash leaves it instead: the job's next start removes it)
        raise
    faults.inject("agent.after_rename")
    sd.storage.sync_dir(sd.root)
    return _after(sd, step, final, manifest)


def run_seq_of(sd: "SaveDir", info: Dict[str, Any]) -> int:
    """The number of the run whose rank 0 recorded ``info``: that of this job's committed steps of the same run,
    else (the run's first commit) one more than the newest run of this job in the save dir. Decided here, by
    the coordinator's agent under the job's lock (one committer at a time), from what the save dir holds, so
    that a run that started later is later whatever the ranks' clocks say (an NTP step, a node a day ahead):
    the wall-clock stamp ("run") only names the run, with the token its engine drew ("run_id") where there is
    one, and orders the steps committed before runs were numbered (Manifest.run_key)."""
    run_id, stamp = info.get("run_id"), info.get("run", 0)
    if isinstance(run_id, str) and run_id in sd.run_seqs:
        return sd.run_seqs[run_id]      # decided at the run's first commit: not a listing of every manifest again
    ours = [man for _, _, man in sd.committed_manifests(own=True)]
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
        sd.run_seqs[run_id] = seq
    return seq


def _after(sd: "SaveDir", step: int, final: str, manifest: mf.Manifest) -> Committed:
    sd.clear_damaged(os.path.basename(final))
    done = Committed(final, manifest.nbytes, manifest)
    faults.inject("agent.before_tracker")
    if sd.naming.tracker:
        tracker = sd.path(sd.naming.tracker)
        try:
            sd.storage.write_atomic(tracker, sd.naming.tracker_text(step).encode())
        except OSError as exc:
            raise TrackerNotUpdated(f"step {step} is committed, but its tracker {tracker} was not updated ({exc}): the "
                                    f"framework's own loader may not see it; easyckpt's loader reads manifests",
                                    done) from exc
    faults.inject("agent.after_tracker")
    return done


def _commit_in_place(sd: "SaveDir", step: int, final: str, manifest: mf.Manifest, markers: Dict[int, Any],
                     log: AuditLog) -> None:
    """The commit on an object store: the files are already under the step's final prefix (SaveDir.begin_step
    refused a committed one); the manifest's conditional create makes it a checkpoint, never over another
    commit of the name (AlreadyCommitted); then the markers and this job's claim go."""
    try:
        faults.inject("agent.before_rename")
        sd.storage.create_exclusive(os.path.join(final, mf.MANIFEST_NAME), manifest.to_bytes())
    except Exception:
        sd.remove_staging(log, step=step)    # keeps a step a manifest commits; removes an unfinished one
        raise
    faults.inject("agent.after_rename")
    sd.storage.delete_files([os.path.join(final, layout.marker_name(rank)) for rank in sorted(markers)]
                            + [sd.claim_path(step)])


def _retire_existing(sd: "SaveDir", step: int, final: str, new: mf.Manifest, log: AuditLog) -> None:
    """A step directory of the same name exists. A foreign one (not easyckpt's, another job's) is never
    touched (docs/reliability.md promise 4). One of this job is replaced only when nothing is lost by it:
    committed by this same run (a fresh snapshot of the step, e.g. with evaluation results) or rejected as
    damaged by the loader; any other (an older run's step a fresh start or a resume from an older step reaches again) is
    quarantined: renamed aside, kept whole, listed by ``easyckpt ls`` (docs/reliability.md promise 12)."""
    planted = stepfiles.owner_problem(final)
    if planted:
        raise FileExistsError(f"{final}: {planted}; refusing to replace it")
    man = stepfiles.read(final)
    if man is None and sd.storage.listdir(final):
        raise FileExistsError(f"{final} exists and is not an easyckpt checkpoint; refusing to replace it")
    if man is not None and not sd.owns(man):
        raise FileExistsError(sd.taken_words(final, step, man, "it is never replaced"))
    damaged = sd.read_damaged().get(os.path.basename(final))
    if man is None or damaged is not None or man.run_key == new.run_key:
        why = (f"replaced by a newer commit of the same step (the old one was rejected: {damaged})" if damaged
               else "replaced by a newer commit of the same step")
        sd.delete_dir(final, log, why)
        return
    sd.quarantine(step, "an older run's commit of this step; a newer run committed it again", log)
