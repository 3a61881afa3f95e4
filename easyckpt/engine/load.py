"""Load: pick the newest state that is complete on every rank, verify it, fall back when damaged.

Order:
  1. every rank lists its complete shared-memory snapshots and the committed step directories;
  2. all ranks exchange them (one all_gather): memory candidates are the steps every rank holds;
  3. a memory snapshot at least as new as the newest committed checkpoint (and the local tier's) wins (it is
     faster); a rank whose node lost its memory (a replacement node) takes that step from a peer node's
     replica of it (engine/peers.py), pulled into its own slot first; a step counts as in memory when every
     rank has it on its node or on a peer; then the local tier (agent/localtier.py: each rank's snapshot
     on its node's disk) when its newest step every rank has is at least as new as the committed ones,
     each copy checked against its record;
  4. otherwise, newest committed step first: each rank reads the files it needs and checks sizes
     and checksums against the manifest; all ranks exchange the verdict; any failure anywhere
     rejects the step for everyone (loudly) and the next older one is tried.
The tracker file is ignored: manifests are the truth (a tracker can be stale, empty or garbage).
Only this job's committed steps are candidates (SaveDir.owns: by job name, so a copied directory stays the
job's own), newest commit first (run, then step); another job's steps are named on the console, never loaded.
Each rank's verdict on a step is a formats/verdicts.Verdict: only a CORRUPT one (the step's own bytes fail)
is reported to the agent as damaged; an INCOMPATIBLE or UNREADABLE one leaves the step as it is. When this
job's committed steps exist and none can be restored, NoValidCheckpoint lists each with its verdict: the
engine stops there unless ``on_no_valid_checkpoint="start_fresh"`` (docs/reliability.md promise 12).
A step whose manifest is invalid (not JSON, a field missing or of the wrong type, a file named outside the
step) is no candidate: it is logged as rejected, with the reason, and older steps are tried. Only files
the manifest lists are read, each through manifest.read_entry (inside the step, no symlink out).

The framework's own checkpoints (no manifest) take part in 3 and 4 beside the committed steps, with
the rules of adopt.py (the framework's tracker bounds them; no checksums exist to check).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, cast

from easyckpt import console
from easyckpt.config import Config
from easyckpt.engine import adopt, estimate, snapshot
from easyckpt.engine.dist import all_gather
from easyckpt.engine.peers import Remote
from easyckpt.engine.reads import Fetched, Needed
from easyckpt.engine.stepread import read_step
from easyckpt.errors import NoValidCheckpoint
from easyckpt.formats import manifest as mf
from easyckpt.formats import verdicts
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.verdicts import Verdict
from easyckpt.storage import stepfiles, tierfiles
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.resolve import remote
from easyckpt.storage.savedir import SaveDir
from easyckpt.storage.tierfiles import TierCopy

@dataclass
class Loaded:
    step: int
    source: str               # "memory", "peer" (a replica on another node), "local" (the local tier: a
                              # snapshot on this node's disk), "storage" or "adopted" (the framework's own
                              # checkpoint, adopt.py); path is None for the snapshots (memory, peer, local)
    path: Optional[str]
    trees: Dict[str, Any]
    nbytes: int
    seconds: float
    manifest: Optional[Manifest] = None   # the committed step's manifest, or an adopted one's inventory
    from_peers: Tuple[int, ...] = ()            # the ranks that pulled the step from a peer's replica
    fetched: Fetched = field(default_factory=Fetched)   # from an object store: for the reader's copy (reads.py)


Gather = Callable[[Any, int], List[Any]]      # (this rank's object, world size) -> every rank's, in order


def load_newest(cfg: Config, rank: int, world_size: int, needed: Needed, log: AuditLog,
                on_rejected: Optional[Callable[[int, str], object]] = None,
                remote: Optional[Remote] = None, layout: Optional[str] = None,
                gather: Gather = all_gather) -> Optional[Loaded]:
    """``on_rejected(step, why)``: called on rank 0 for each committed step rejected as corrupt.
    ``remote``: this rank's replicas on peer nodes (None: replicas are off). ``layout``: the adapter's
    parallel layout now (e.g. Megatron's TP/PP sizes); a snapshot taken on another one is not used.
    ``gather``: the ranks' all_gather (the engine's Group; torch.distributed by default)."""
    # a snapshot taken with another world size or layout holds another layout's shards: storage serves that
    mem = [s for s in snapshot.complete_snapshots(cfg.job_id, rank)
           if s.world_size == world_size and (layout is None or s.layout == layout)]
    on_peer = sorted({s for s, w, _ in (remote.steps() if remote else []) if w == world_size}
                     - {s.step for s in mem})
    sd = SaveDir.of(cfg)
    every = sd.committed_manifests()
    ours = [e for e in every if sd.owns(e[2])]
    stored = [(s, p) for s, p, _ in ours]
    runs = {s: man.run_key for s, _, man in ours}
    _say_other_jobs([e for e in every if not sd.owns(e[2])], rank, log)
    _log_invalid_manifests(sd, {s for s, _, _ in every}, log)
    native = adopt.candidates(cfg.save_dir, cfg.naming, _console(rank, log))   # the framework's own
    # the local tier, read whenever it holds copies (also when save_local_interval is off now): a state kept
    tiered = {c.step: c for c in tierfiles.listing(tierfiles.directory(cfg.node_dir, cfg.job_id), cfg.job_id, rank,
                                                   log)
              if c.record.world_size == world_size and (layout is None or c.record.layout == layout)}
    # a step another user owns or may write is tried last-resort only (stepread refuses it, naming the owner): it
    # never outranks the job's own memory or tier, or a planted step_99999990 would send every resume to storage
    planted = sorted(s for s, p in stored if stepfiles.owner_problem(p) is not None)
    views = gather(([s.step for s in mem], [s for s, _ in stored], [c.step for c in native], on_peer, sorted(tiered),
                    planted), world_size)
    common_mem = set.intersection(*(set(v[0]) | set(v[3]) for v in views))
    common_nat = set.intersection(*(set(v[2]) for v in views))
    common_sto = mf.newest_first(set.intersection(*(set(v[1]) for v in views)) | common_nat, runs)
    common_tier = set.intersection(*(set(v[4]) for v in views))
    best_mem = max(common_mem) if common_mem else None
    best_tier = max(common_tier) if common_tier else None
    untrusted = set().union(*(set(v[5]) for v in views))
    trusted_sto = [s for s in common_sto if s not in untrusted]
    _say_lost_memory(views, rank, log)
    if best_mem is not None and (not trusted_sto or best_mem >= trusted_sto[0]) and \
            (best_tier is None or best_mem >= best_tier):
        loaded = _from_memory(cfg, rank, world_size, best_mem, mem, remote, layout, log, gather)
        if loaded is not None:
            return loaded
    if best_tier is not None and (not trusted_sto or best_tier >= trusted_sto[0]):
        loaded = _from_tier(tiered[best_tier], rank, world_size, log, gather)
        if loaded is not None:
            return loaded
    foreign = {c.step: c for c in native if c.step in common_nat}
    known = {s: man for s, _, man in ours}      # read and validated by the listing: not read again
    return _from_storage(cfg, rank, world_size, needed, log, common_sto, dict(stored), known, foreign, on_rejected,
                         gather)


def _from_memory(cfg: Config, rank: int, world_size: int, step: int, mem: List[Any], remote: Optional[Remote],
                 layout: Optional[str], log: AuditLog, gather: Gather) -> Optional[Loaded]:
    """Step ``step`` from this node's memory (or pulled from a peer's); None, on every rank, when any rank
    cannot read it (storage serves instead)."""
    t0 = time.perf_counter()
    trees, err, source = None, None, "memory"
    try:
        info = next((s for s in mem if s.step == step), None)
        if info is None:
            assert remote is not None
            # fetch raises for a reply that names no slot
            slot, source = cast(int, remote.fetch(step).slot), "peer"
            pulled = next((s for s in snapshot.complete_snapshots(cfg.job_id, rank) if s.slot == slot), None)
            if layout is not None and (pulled is None or pulled.layout != layout):
                # a peer lists replicas by world size alone: one taken on another layout serves nobody
                raise ValueError(f"the replica of step {step} pulled from a peer was taken on layout "
                                 f"{pulled.layout if pulled else 'unknown'}, this run is {layout}")
        trees = snapshot.read_snapshot(cfg.job_id, rank, info.slot if info else slot, step)
    except Exception as exc:  # noqa: BLE001 - any failure means: use storage instead
        err = f"{type(exc).__name__}: {exc}"
    gathered = gather((err, source), world_size)
    errors = [v for v, _ in gathered]
    if all(v is None for v in errors):
        nbytes = estimate.tensor_bytes(trees)
        pulled_by = tuple(r for r, (_, where) in enumerate(gathered) if where == "peer")
        # this rank's err is None too: read_snapshot returned its trees
        return Loaded(step, source, None, cast(Dict[str, Any], trees), nbytes, time.perf_counter() - t0,
                      from_peers=pulled_by)
    bad = "; ".join(f"rank {r}: {v}" for r, v in enumerate(errors) if v is not None)
    log.record("warning", step=step, message=f"memory snapshot unusable on some rank: {bad}; falling back to storage")
    if rank == 0:
        console.warning(f"step {step} in memory is unusable ({bad}): resuming from storage instead")
    return None


def _from_tier(copy: TierCopy, rank: int, world_size: int, log: AuditLog, gather: Gather) -> Optional[Loaded]:
    """Step ``copy.step`` from every rank's copy in the local tier, each checked against its record first; None,
    on every rank, when any rank cannot read its copy (kept as it is: storage serves instead)."""
    t0 = time.perf_counter()
    trees, err = None, None
    try:
        # checked against its record in the same mapping the tensors are then copied from (one pass over the disk)
        trees = snapshot.read_slot_file(copy.path, copy.step, lambda mapped: tierfiles.verify(copy, mapped))
    except Exception as exc:  # noqa: BLE001 - any failure means: use storage instead
        err = f"{type(exc).__name__}: {exc}"
    errors = gather(err, world_size)
    if all(v is None for v in errors):
        trees = cast(Dict[str, Any], trees)       # this rank's err is None too: it read its copy
        return Loaded(copy.step, "local", None, trees, estimate.tensor_bytes(trees), time.perf_counter() - t0)
    bad = "; ".join(f"rank {r}: {v}" for r, v in enumerate(errors) if v is not None)
    log.record("warning", step=copy.step, message=f"local tier copy unusable on some rank: {bad}; kept as it is, "
                                                   f"falling back")
    if rank == 0:
        console.warning(f"step {copy.step} in the local tier is unusable ({bad}): resuming from storage instead")
    return None


def _from_storage(cfg: Config, rank: int, world_size: int, needed: Needed, log: AuditLog, order: List[int],
                  paths: Dict[int, str], known: Dict[int, Manifest], foreign: Dict[int, adopt.Candidate],
                  on_rejected: Optional[Callable[[int, str], object]], gather: Gather) -> Optional[Loaded]:
    """The newest committed step (``order``) every rank can restore, verified; the framework's own steps
    (``foreign``) adopted where no commit of that step exists. NoValidCheckpoint when this job's steps
    exist and none restores: never a silent fresh start over them."""
    rejected: List[Verdict] = []
    for step in order:
        if step in foreign and step not in paths:
            loaded = _adopt(foreign[step], cfg, rank, world_size, needed, log, gather)
            if loaded is not None:
                return loaded
            continue
        t0 = time.perf_counter()
        kept = Fetched() if remote(paths[step]) is not None else None
        trees, mine, nbytes, man = read_step(paths[step], needed, progress=rank == 0, listed=known.get(step),
                                             kept=kept)
        verdict = verdicts.combine(step, paths[step], gather(mine, world_size))
        if verdict is None:
            # no verdict on this rank either: read_step returned its trees
            return Loaded(step, "storage", paths[step], cast(Dict[str, Any], trees), nbytes,
                          time.perf_counter() - t0, man, fetched=kept or Fetched())
        rejected.append(verdict)
        log.record("error" if verdict.corrupt else "warning", step=step, path=paths[step],
                   verdict=verdict.kind.value, message=f"checkpoint rejected: {verdict.reason}")
        if rank == 0:
            console.warning(f"{verdict.words()}: " + ("marked damaged, " if verdict.corrupt else "kept as it is, ")
                            + "trying the previous checkpoint")
        if verdict.corrupt and on_rejected is not None and rank == 0:
            on_rejected(step, verdict.reason)
    if rejected:
        raise NoValidCheckpoint(_none_restorable(cfg, rejected), rejected)
    return None


def _none_restorable(cfg: Config, rejected: List[Verdict]) -> str:
    lines = "\n".join(f"  {v.words()}" for v in rejected)
    return (f"{len(rejected)} committed checkpoint(s) of this job in {cfg.save_dir}, and none can be restored "
            f"here:\n{lines}\nNothing was deleted. Fix what the verdicts name (a corrupt step: restore its files "
            f"from a copy; an incompatible one: relaunch with the layout, model or settings it was saved with), "
            f"or set on_no_valid_checkpoint=\"start_fresh\" to train from the beginning: these steps are then set "
            f"aside as quarantined-<name>-<stamp>, kept whole, and their names never reused")


def _say_other_jobs(others: List[Tuple[int, str, Manifest]], rank: int, log: AuditLog) -> None:
    """Committed steps of other jobs in the save dir: never resumed, said once (docs/reliability.md promise 12)."""
    if not others:
        return
    names = sorted({man.job_words() for _, _, man in others})
    text = (f"{len(others)} committed step(s) in this save dir belong to another job ({'; '.join(names)}): "
            f"{', '.join(os.path.basename(p) for _, p, _ in others[:8])}{' ...' if len(others) > 8 else ''}; "
            f"not resumed (a job resumes only its own; set job_name to the job's name to resume them)")
    _say(rank, log, text, "not_ours")


def _say_lost_memory(views: List[Any], rank: int, log: AuditLog) -> None:
    """Ranks with no snapshot in memory anywhere, while others have one: their node and every holder of its
    replicas were lost (or replicas are off). Storage serves; said loudly, once."""
    empty = [r for r, v in enumerate(views) if not v[0] and not v[3]]
    if empty and len(empty) < len(views):
        why = (f"rank(s) {empty} have no snapshot in memory, neither on their node nor on a peer node (their node "
               f"and the holders of its replicas were lost, or replicas are off): resuming from storage, which "
               f"may be older than the other ranks' memory")
        _say(rank, log, why)


def _log_invalid_manifests(sd: SaveDir, valid: Set[int], log: AuditLog) -> None:
    """Step directories that hold a manifest the loader cannot trust: each one said in the audit log (they
    are skipped, not fatal: an older intact step still serves)."""
    for step, path in sd.step_dirs():
        if step in valid or not sd.storage.exists(os.path.join(path, mf.MANIFEST_NAME)):
            continue          # no manifest at all: an interrupted save or a framework's own, not damage
        _man, reason = stepfiles.judge(path, step)
        if reason is None:
            continue      # valid, e.g. committed by another job: not ours to judge here
        log.emit("error", step=step, path=path, message=f"checkpoint rejected: {reason}; it is skipped")


def _adopt(cand: adopt.Candidate, cfg: Config, rank: int, world_size: int, needed: Needed,
           log: AuditLog, gather: Gather) -> Optional[Loaded]:
    """Load a checkpoint the framework wrote itself, or None (all ranks agree) when it is incomplete."""
    t0 = time.perf_counter()
    what = adopt.describe(cfg.naming, cand.path)
    trees, problem, nbytes, inv = adopt.read_candidate(cand, needed, progress=rank == 0)
    problems = gather(problem, world_size)
    bad = [(r, v) for r, v in enumerate(problems) if v is not None]
    if bad:
        message = "; ".join(f"rank {r}: {v}" for r, v in bad)
        log.record("error", step=cand.step, path=cand.path, message=f"{what} not adopted: {message}")
        if rank == 0:    # the same verdicts on every rank: one console line
            console.warning(f"{what} is incomplete or unreadable ({message}): trying the previous checkpoint")
        return None
    log.emit("adopt", step=cand.step, rank=rank, path=cand.path, bytes=nbytes,
             message=f"{what}: no easyckpt manifest, so no checksums to verify; every file this rank needs "
                     f"exists with its size on disk and loads")
    console.info(f"resuming from {what} (no easyckpt manifest)")
    # no problem on this rank either: read_candidate returned its trees
    return Loaded(cand.step, "adopted", cand.path, cast(Dict[str, Any], trees), nbytes, time.perf_counter() - t0, inv)


def _console(rank: int, log: AuditLog) -> Callable[[str], None]:
    """What the loader passed over of the framework's own checkpoints, and why (``_say``)."""
    return lambda text: _say(rank, log, text, "not_adopted")


def _say(rank: int, log: AuditLog, text: str, event: str = "warning") -> None:
    """The audit log on every rank, the console once (rank 0): the ranks agree, so one line says it."""
    log.record(event, message=text)
    if rank == 0:
        console.warning(text)
