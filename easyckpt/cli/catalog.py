"""What a save directory holds: the checkpoints in it, complete or not and why, their world layout, and
the one easyckpt's loader would pick. The operator tools (``easyckpt ls | inspect | verify | prune``)
read it; nothing here writes.

Decisions:
- The framework is detected from the step directories' names (``iter_0000100``, ``global_step100``,
  ``checkpoint-100``, ``step_00000100``) unless given; the most matches wins.
- "Complete" is what the loader's first, cheap test says: a manifest of the same step, every listed file
  present with its recorded size. Checksums are ``verify``'s job (they read every byte).
- The loader's pick is the newest complete one. For the HF Trainer that includes a ``checkpoint-N`` the
  Trainer wrote itself (no manifest, a trainer_state.json of step N): TrainerWrapper resumes from it. A snapshot that survived in this node's shared memory
  can be newer: ``easyckpt status`` shows those (they belong to a job, not to a directory).
- The HF Trainer's best checkpoint (``best_model_checkpoint`` in the newest trainer_state.json, which
  save_total_limit keeps whatever its age) is marked ``best``.
- The world layout comes from the native file names, so that checkpoints written before the manifest
  recorded it are described too: Megatron ``mp_rank_TT[_PPP]`` directories and ``distrib_optim_dpRRR``
  shards; DeepSpeed ``zero_pp_rank_D_mp_rank_MM`` files; otherwise every rank is data-parallel.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from easyckpt.errors import CatalogError
from easyckpt.formats import manifest as mf
from easyckpt.formats.layout import NAMINGS, Naming
from easyckpt.storage import stepfiles
from easyckpt.storage.resolve import storage_for
from easyckpt.storage.savedir import SaveDir

FRAMEWORKS = sorted(NAMINGS)
DAMAGED_MANIFEST = "bad manifest"      # how an entry's ``why`` starts when its manifest cannot be trusted


def naming(framework: str) -> Naming:
    return NAMINGS[framework]


def detect(save_dir: str) -> Tuple[str, Naming]:
    """The framework whose step-directory naming matches the most entries of ``save_dir``."""
    best: Tuple[str, Optional[Naming], int] = ("pytorch", None, -1)
    for name, nm in sorted(NAMINGS.items()):
        n = len(SaveDir(save_dir, nm).step_dirs())
        if n > best[2]:
            best = (name, nm, n)
    return best[0], best[1] or naming("pytorch")


@dataclass
class Entry:
    step: int
    path: str
    complete: bool
    why: Optional[str]                 # what makes it incomplete (None when complete)
    framework: str
    time: float                        # when it was committed (manifest), else the directory's mtime
    bytes: int                         # the manifest's files, else what is on disk
    files: int
    layout: Dict[str, int] = field(default_factory=dict)    # tp, pp, dp, world
    job_id: Optional[str] = None
    run: float = 0.0                   # when the run that committed it started (Manifest.run)
    run_seq: int = 0                   # the number of that run (Manifest.run_seq): with run, orders the pick
    picked: bool = False               # the one easyckpt's loader would pick
    staging: bool = False              # a step being written (or left by a crash), not yet visible
    # complete | plain (the HF Trainer's own, no manifest) | incomplete (never committed) | damaged | staging |
    # quarantined (set aside whole by a fresh start or a newer run's commit of its name: never loaded or pruned) |
    # "untrusted: why" (whole, but another user owns or may write it: the loader, run as this user, refuses it)
    state: str = ""
    best: bool = False                 # the HF Trainer's best_model_checkpoint: save_total_limit and prune keep it

    @property
    def run_key(self) -> mf.RunKey:
        """How the loader orders runs (Manifest.run_key)."""
        return (self.run_seq, self.run if self.run_seq == 0 else 0.0)

    def __post_init__(self) -> None:
        if not self.state:
            self.state = "complete" if self.complete else "staging" if self.staging else "damaged"

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class Catalog:
    save_dir: str
    framework: str
    entries: List[Entry]               # newest first

    @property
    def picked(self) -> Optional[Entry]:
        return next((e for e in self.entries if e.picked), None)

    def step(self, step: Optional[int]) -> Entry:
        """The entry of ``step``, or the loader's pick when None; CatalogError when there is none."""
        visible = [e for e in self.entries if not e.staging and e.state != "quarantined"]
        if step is None:
            chosen = self.picked or (visible[0] if visible else None)
            if chosen is None:
                raise CatalogError(f"{self.save_dir} holds no {self.framework} checkpoint")
            return chosen
        for e in visible:
            if e.step == step:
                return e
        have = ", ".join(str(e.step) for e in visible) or "none"
        raise CatalogError(f"{self.save_dir} holds no checkpoint of step {step} (steps: {have})")


def scan(save_dir: str, framework: Optional[str] = None, checksums: bool = False,
         on_bytes: Optional[Callable[[int], None]] = None) -> Catalog:
    """The step directories of ``save_dir``, newest first. With ``checksums``, every file of every
    complete step is read and checked too, so that the pick is exactly the loader's."""
    store = storage_for(save_dir)
    if not store.is_dir(save_dir):
        raise CatalogError(f"{save_dir}: no such directory" if not store.exists(save_dir)
                           else f"{save_dir} is not a directory")
    if framework is None:
        framework, nm = detect(save_dir)
    else:
        nm = naming(framework)
    sd = SaveDir(save_dir, nm)
    entries = [_entry(step, path, framework) for step, path in sd.step_dirs()]
    entries += _staging(sd, framework)
    entries += _quarantined(sd, framework)
    entries.sort(key=lambda e: (e.step, not e.staging, e.state != "quarantined"), reverse=True)
    if checksums:
        for e in entries:
            if e.complete and e.state != "quarantined":
                problems = verify(e, on_bytes)
                if problems:
                    e.complete, e.state, e.why = False, "damaged", problems[0] + (f" (and {len(problems) - 1} more)"
                                                              if len(problems) > 1 else "")
    # the loader, run as this user, refuses a step another user owns or may write (stepread: untrusted): never
    # the pick, and said, though its bytes may be whole
    for e in entries:
        if e.complete and e.state == "complete":
            problem = stepfiles.owner_problem(e.path)
            if problem is not None:
                e.state = f"untrusted: {problem}"
    best = trainer_best(entries, nm) if framework == "transformers" else None
    for e in entries:
        e.best = e.step == best and not e.staging and e.state != "quarantined"
    complete = {e.step: e for e in entries if e.complete and not e.state.startswith("untrusted")}
    order = mf.newest_first(complete, {s: e.run_key for s, e in complete.items()})    # the loader's order
    if order:
        complete[order[0]].picked = True
    return Catalog(save_dir, framework, entries)


def trainer_best(entries: List[Entry], nm: Naming) -> Optional[int]:
    """The step of the Trainer's best checkpoint (load_best_model_at_end, metric_for_best_model), as the newest
    readable trainer_state.json records it (``best_model_checkpoint``: a path ending in the step directory's
    name), or None. The file is untrusted: stepfiles.trainer_state caps and checks it, and anything but a
    string naming one of our step directories is no best."""
    for e in entries:                   # newest first: the Trainer's latest view of which one is best
        if e.staging or e.state == "quarantined" or e.state.startswith("untrusted"):     # not a say in it
            continue
        state = stepfiles.trainer_state(e.path)
        if state is None:
            continue
        where = state.get("best_model_checkpoint")
        if not isinstance(where, str) or len(where) > 4096:
            return None
        return nm.parse(os.path.basename(where.rstrip("/")))
    return None


def verify(entry: Entry, on_bytes: Optional[Callable[[int], None]] = None) -> List[str]:
    """Every problem of one step: no manifest, a manifest of another step, a file missing, truncated or
    corrupted (sizes and checksums, every byte read). Empty when the step is intact."""
    if entry.state == "plain":
        return []           # no manifest: nothing recorded to check against (cmd_verify says so)
    man, why = stepfiles.judge(entry.path, entry.step)
    if man is None:
        return [f"{DAMAGED_MANIFEST}: {why}" if why else f"{mf.MANIFEST_NAME}: {entry.why}"]
    problems = [why] if why else []
    for rel in man.files:
        problem = stepfiles.verify_file(entry.path, rel, man, on_bytes)
        if problem:
            problems.append(problem)
    return problems


def stored_bytes(entries: List[Entry]) -> int:
    """What ``verify`` of these entries reads (a progress bar's total)."""
    return sum(e.bytes for e in entries
               if not e.staging and storage_for(e.path).exists(os.path.join(e.path, mf.MANIFEST_NAME)))


def require(save_dir: str, framework: Optional[str] = None, **scan_args: Any) -> Catalog:
    """``scan``, refusing a directory with no step directory at all (a wrong path, most likely)."""
    cat = scan(save_dir, framework, **scan_args)
    if not [e for e in cat.entries if not e.staging]:
        names = ", ".join(f"{n.dir_format.format(100)}" for n in map(naming, FRAMEWORKS))
        raise CatalogError(f"{save_dir} holds no checkpoint (no step directory named like {names}); "
                           f"give the directory passed as the save dir / output_dir")
    return cat


def _entry(step: int, path: str, framework: str) -> Entry:
    man, why = stepfiles.judge(path, step)
    if man is None and why is not None:
        why = f"{DAMAGED_MANIFEST}: {why}"
    if man is None and why is None and framework == "transformers" and _trainer_step(path) == step:
        # the Trainer's own save: TrainerWrapper resumes from it when it is the newest (nothing to verify)
        nbytes, nfiles = _disk_usage(path)
        return Entry(step, path, True, None, framework, storage_for(path).mtime(path), nbytes, nfiles,
                     layout_of(path, framework, None), state="plain")
    if man is None:
        damaged = why is not None
        why = why or "no manifest: not committed by easyckpt (interrupted, or written by the framework's own saver)"
        nbytes, nfiles = _disk_usage(path)
        return Entry(step, path, False, why, framework, storage_for(path).mtime(path), nbytes, nfiles,
                     layout_of(path, framework, None), state="" if damaged else "incomplete")
    problems = [] if why is not None else stepfiles.check_sizes(path, man)
    if problems:
        why = problems[0] + (f" (and {len(problems) - 1} more)" if problems[1:] else "")
    return Entry(step, path, why is None, why, man.framework, man.created, man.nbytes, len(man.files),
                 layout_of(path, framework, man), man.job_id, man.run, man.run_seq)


def step_entry(step: int, path: str, framework: str) -> Entry:
    """The catalog entry of one step directory (sizes checked, no checksum read)."""
    return _entry(step, path, framework)


def _quarantined(sd: SaveDir, framework: str) -> List[Entry]:
    """Steps set aside whole (SaveDir.quarantine): listed with what they were, never picked."""
    out = []
    for final, path in sd.quarantined():
        step = sd.naming.parse(final)
        if step is None:
            continue
        e = _entry(step, path, framework)
        e.complete, e.picked, e.state = False, False, "quarantined"
        e.why = (f"set aside as {os.path.basename(path)} (was {final}): a fresh start could not restore it, or a "
                 f"newer run committed its name again; kept whole, never loaded or pruned: move it back or delete "
                 f"it by hand")
        out.append(e)
    return out


def _trainer_step(path: str) -> Optional[int]:
    return stepfiles.trainer_state_step(path)


def _staging(sd: SaveDir, framework: str) -> List[Entry]:
    out = []
    for step, job, path in sd.staging_entries():
        nbytes, nfiles = _disk_usage(path)
        out.append(Entry(step, path, False, "being written (staging), or left by a crash",
                         framework, sd.storage.mtime(path), nbytes, nfiles, {}, job, staging=True))
    return out


def _disk_usage(path: str) -> Tuple[int, int]:
    files = storage_for(path).files(path)
    return sum(n for _, n in files), len(files)


_MEGATRON_MP = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?/")
_MEGATRON_DP = re.compile(r"distrib_optim_dp(\d+)\.pt$")
_DS_ZERO = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_")


def layout_of(path: str, framework: str, man: Optional[mf.Manifest]) -> Dict[str, int]:
    """TP/PP/DP sizes (and the world size) of a step, from its native file names."""
    files = list(man.files) if man else _relpaths(path)
    world = (man.world_size or 0) if man else 0
    tp = pp = 1
    dp = 0
    stated = man.layout if man else None
    sizes = re.fullmatch(r"tp(\d+)\.pp(\d+)\.dp(\d+)\.vp\d+(?:\.ep\d+)?", stated) if isinstance(stated, str) else None
    if framework == "megatron" and sizes:     # what the adapter recorded (any layout, torch_dist included)
        tp, pp, dp = (int(g) for g in sizes.groups())
    elif framework == "megatron":
        tps, pps, dps = set(), set(), set()
        for rel in files:
            m = _MEGATRON_MP.match(rel)
            if m:
                tps.add(int(m.group(1)))
                pps.add(int(m.group(2) or 0))
            d = _MEGATRON_DP.search(rel)
            if d:
                dps.add(int(d.group(1)))
        tp, pp = max(len(tps), 1), max(len(pps), 1)
        dp = len(dps) or (world // (tp * pp) if world else 0)
    elif framework in ("deepspeed", "transformers"):
        dps, mps = set(), set()
        for rel in files:
            m = _DS_ZERO.search(rel)
            if m:
                dps.add(int(m.group(1)))
                mps.add(int(m.group(2)))
        tp = max(len(mps), 1)
        dp = len(dps)
        saved = man.info.get("dp_world_size", 0) if man else 0
        dp = dp or (saved if isinstance(saved, int) and not isinstance(saved, bool) and saved > 0 else 0)
    if not dp:
        dp = world // (tp * pp) if world else 1
    return {"tp": tp, "pp": pp, "dp": dp, "world": world or tp * pp * dp}


def _relpaths(path: str) -> List[str]:
    return [rel for rel, _ in storage_for(path).files(path)]
