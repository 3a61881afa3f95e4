"""The commit: what makes a written step a checkpoint. A save dir picks one of two strategies once, when it is
opened (SaveDir.__init__), by what its back-end can do:

- renamecommit.RenameCommit, on a file system (``Storage.has_rename``): every rank writes into a staging dir of
  this job; the coordinator writes the manifest there, then renames the staging dir to the step's name, never
  over an existing one, with the fsyncs that make each step durable. Atomic because a rename is.
- manifestcommit.ManifestCommit, on an object store (no rename): every rank writes under the step's final prefix,
  which carries this job's claim; the manifest, created last and only if no manifest is there (a conditional
  PUT), is the commit. Atomic because a reader counts a step only when its manifest exists.

Each module's docstring is its call order. The agent's jobdir.py runs them:

  all ranks:        begin_step(step); write the files (agent/stepwriter.py); write_marker(): rank r's are durable
  coordinator:      ready_ranks(step) == world    IMPORTANT: commit only after every rank's marker
  coordinator:      commit(step) → Committed      the strategy's sequence, ending with the tracker (``finish``)
  then:             retention.prune()  (only after a successful commit, with the manifest as written)

Shared by both, here: the types (``Committed``; ``Owner``, what a strategy reads of its save dir; ``Commit``, the
strategy's verbs) and what a refusal says when another job's step holds the name (``taken_words``). A commit's
path: jobdir.py → the strategy's ``commit`` → the save dir once (``SaveDir.run_seq``: the run's number, from the
listing of this job's commits at a run's first commit) → back in the strategy to the end; everything else it
calls is a leaf (the back-end, markers.py, damaged.py, tracker.py, stepfiles.py, formats/).
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Set, Tuple

from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import Naming
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.base import Storage


class Committed(NamedTuple):
    path: str                      # the step directory, under its final name
    nbytes: int                    # what its files hold
    manifest: mf.Manifest          # as written: retention reads the adapter's "protect" from it, not from disk


class Owner(Protocol):
    """What a strategy reads of its save dir (storage/savedir.py's SaveDir): settings, and its listings."""
    root: str
    naming: Naming
    job_id: Optional[str]
    job_name: Optional[str]
    storage: Storage

    def run_seq(self, info: Dict[str, Any]) -> int: ...

    def step_dirs(self) -> List[Tuple[int, str]]: ...


class Commit(Protocol):
    """The commit strategy of one save dir (RenameCommit, ManifestCommit): where a step is written, the commit
    itself, and the removal of what is not (yet) a checkpoint."""
    polls: bool        # reading a step's markers costs requests (an object store): the agent's loop throttles it
    where: str         # what a job's own place is called in advice: "save_dir", "prefix"

    def staging_path(self, step: int) -> str: ...

    def begin_step(self, step: int) -> None: ...

    def ready_ranks(self, step: int) -> Optional[Set[int]]: ...

    def commit(self, step: int, world_size: int, log: AuditLog) -> Committed: ...

    def delete_dir(self, path: str, log: AuditLog, reason: str, **fields: Any) -> None: ...

    def remove_staging(self, log: AuditLog, step: Optional[int] = None, only: Optional[str] = None) -> None: ...

    def staging_dirs(self) -> List[str]: ...

    def staging_entries(self) -> List[Tuple[int, str, str]]: ...


def commit(sd: Any, step: int, world_size: int, log: AuditLog, extra: Optional[Dict[str, Any]] = None) -> Committed:
    """Make step ``step`` a committed checkpoint of save dir ``sd`` by its strategy; every rank's marker must be
    present. (The agent calls ``sd.commits.commit`` itself.)"""
    done: Committed = sd.commits.commit(step, world_size, log)
    return done


def taken_words(final: str, step: int, man: Optional[mf.Manifest], why: str, where: str) -> str:
    """Why ``step`` cannot be committed here: the name holds a step another job committed (``man``, a validated
    manifest, or None when it does not validate). Names that job and advises what frees this job's way, never
    deleting a checkpoint that is not its own (docs/reliability.md promise 4)."""
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
