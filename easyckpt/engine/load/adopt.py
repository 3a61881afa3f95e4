"""Adoption: the framework's own checkpoints (no easyckpt manifest) as resume candidates
(docs/reliability.md promise 11).

A job that adds easyckpt halfway (Megatron-LM with ``--save`` = ``--load``, a DeepSpeed loop, an HF
Trainer run) has the framework's own step directories in the save dir. Ignoring them would restart
training from step 1; replacing them would destroy the user's work. The loader therefore weighs them
beside easyckpt's committed steps and picks the newest complete one, saying which on the console.

easyckpt writes the frameworks' native layouts (formats/layout.py's NAMINGS), so a native step directory is read
with the adapter's own ``needed`` list. In place of a manifest, ``needed`` gets an *inventory* built
from the directory itself, with the keys adapters read from a manifest:

    step       the number in the directory's name (the framework's naming, layout.NAMINGS)
    files      every regular file under the step dir (symlinks are neither listed nor followed):
               {relpath: {"size": bytes on disk, "format": how easyckpt decodes it}}; the format comes
               from the name: ``*.safetensors`` -> safetensors, ``*.pt|*.pth|*.bin`` -> torch (read only
               through safe_torch_load: weights_only with an allow-list), anything else -> raw bytes
    world_size None (unknown: the frameworks do not record it)
    info       {"dp_world_size": n} when the directory holds ZeRO partitions (DeepSpeed, the Trainer with
               DeepSpeed): n = the number of distinct ``zero_pp_rank_{r}_`` optimizer files, which is what
               the DeepSpeed helpers compare with the current data-parallel size (a different size goes
               through DeepSpeed's universal checkpoint, as for easyckpt's own steps); for Megatron
               {"tp": number of mp_rank_TT, "pp": number of mp_rank_TT_PPP} (informational: Megatron's
               ``needed`` names its own (tp, pp) file, which is missing when the layout changed)
    adopted    True, checksum None: native checkpoints carry no checksums, so completeness is "every
               file this rank needs exists, has the size it had when listed, and decodes"; the audit log
               says that no checksum was checked

Which native directories are candidates:
  * a directory named by the framework's naming, not a symlink, with no ``easyckpt_manifest.json`` at all
    (one with a damaged manifest is easyckpt's own, rejected by the loader: never adopted);
  * not newer than the step the framework's tracker names (``latest_checkpointed_iteration.txt``,
    ``latest``), when that tracker is readable: Megatron and DeepSpeed write the tracker after every
    rank's files, so a newer directory is an interrupted save (skipped, loudly). The Trainer has none.
  * framework "pytorch" has no native format besides easyckpt's: nothing is adopted there.

What the framework never saved is not restored: DeepSpeed keeps no RNG states (easyckpt's own
``easyckpt_rng/`` files are optional in every adapter's ``needed``), so with dropout a run resumed from
DeepSpeed's own checkpoint draws other masks than one that never stopped, as with DeepSpeed alone.

Reading: each path comes from ``needed`` and must be in the inventory (so it is a regular file found
inside the step dir without following a link); it is opened with O_NOFOLLOW, checked to resolve inside
the step dir, to be a regular file and to still have its listed size. Failure on any rank rejects the
candidate on every rank (adopted.py's all_gather verdict) and the next older candidate is tried.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from easyckpt.config import Naming
from easyckpt.engine.load.reads import Needed, reads
from easyckpt.engine.shards import codecs
from easyckpt.errors import CheckpointError, UnsafePath, UntrustedFileError
from easyckpt.formats import manifest as mf
from easyckpt.formats import paths
from easyckpt.formats.manifest import FileEntry, Manifest
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.progress import Progress
from easyckpt.storage.savedir import SaveDir

FRAMEWORK_NAMES = {"megatron": "Megatron", "deepspeed": "DeepSpeed", "transformers": "the HF Trainer"}
_ZERO_RANK = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_MP_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


@dataclass(frozen=True)
class Candidate:
    step: int
    path: str
    naming: Naming


def adoptable(naming: Naming) -> bool:
    return naming.framework in FRAMEWORK_NAMES


def describe(naming: Naming, path: str) -> str:
    return f"{FRAMEWORK_NAMES.get(naming.framework, naming.framework)}'s own checkpoint {os.path.basename(path)}"


def candidates(save_dir: str, naming: Naming, say: Callable[[str], None]) -> List[Candidate]:
    """Native step directories of ``naming`` in ``save_dir`` worth trying, newest first. ``say`` hears of
    every directory passed over (a newer one than the tracker)."""
    if not adoptable(naming):
        return []
    sd = SaveDir(save_dir, naming)
    bound = sd.tracker_step()
    out = []
    for step, path in sd.step_dirs():
        if not _is_real_dir(path) or os.path.lexists(os.path.join(path, mf.MANIFEST_NAME)):
            continue
        if bound is not None and step > bound:
            say(f"{describe(naming, path)} is newer than the step {naming.tracker} names ({bound}): an "
                f"interrupted save, not adopted")
            continue
        out.append(Candidate(step, path, naming))   # listed only when tried: most never are
    return out


def tracker_step(save_dir: str, naming: Naming) -> Optional[int]:
    """The step the framework's tracker file names, or None (no tracker, unreadable, ``release``)."""
    return SaveDir(save_dir, naming).tracker_step()


def inventory(step_dir: str, step: int, naming: Naming) -> Manifest:
    files: Dict[str, FileEntry] = {}
    for root, dirs, names in os.walk(step_dir, followlinks=False):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for name in names:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                rel = os.path.relpath(path, step_dir).replace(os.sep, "/")
                files[rel] = FileEntry(st.st_size, format=ShardFormat.of_filename(rel))
    info: Dict[str, Any] = {}
    zero_ranks = {int(m.group(1)) for m in map(_ZERO_RANK.search, files) if m}
    if zero_ranks:
        info["dp_world_size"] = len(zero_ranks)
    if naming.framework == "megatron":
        mp_dirs = [_MP_DIR.match(rel.split("/", 1)[0]) for rel in files if "/" in rel]
        mp = {(m.group(1), m.group(2)) for m in mp_dirs if m}
        if mp:
            info["tp"] = len({t for t, _ in mp})
            info["pp"] = len({p for _, p in mp}) if all(p is not None for _, p in mp) else 1
    return Manifest(step=step, framework=naming.framework, files=dict(sorted(files.items())), checksum=None,
                    info=info, adopted=True)


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def read_candidate(cand: Candidate, needed: Needed,
                   progress: bool = False
                   ) -> Tuple[Optional[Dict[str, Any]], Optional[str], int, Manifest]:
    """(trees, problem, bytes, inventory): what stepread.read_step returns for a committed step; the
    inventory (see the module docstring) is what ``needed`` gets in place of a manifest."""
    inv = inventory(cand.path, cand.step, cand.naming)
    try:
        wanted = reads(needed, inv)
    except ValueError as exc:
        return None, str(exc), 0, inv
    missing = [w.relpath for w in wanted if not w.optional and w.relpath not in inv.files]
    if missing:
        return None, _missing_problem(missing[0], inv), 0, inv
    present = [w.relpath for w in wanted if w.relpath in inv.files]    # whole files: adopted ones list no items
    total = sum(inv.files[rel].size for rel in present)
    trees: Dict[str, Any] = {}
    with Progress(total if progress else 0, f"load {os.path.basename(cand.path)}") as bar:
        for rel in present:
            try:
                buf = _read_inside(cand.path, rel, inv.files[rel].size, bar.update if bar.on else None)
                trees[rel] = codecs.decode(buf, inv.files[rel].shard_format)
            except Exception as exc:  # noqa: BLE001 - any unreadable file rejects the candidate
                return None, f"{rel}: unreadable ({type(exc).__name__}: {exc})", 0, inv
    return trees, None, total, inv


def _missing_problem(rel: str, inv: Manifest) -> str:
    files = inv.files
    if inv.framework == "megatron" and any(r.endswith(".distcp") for r in files):
        return (f"{rel}: missing; a torch_dist checkpoint (*.distcp) is incomplete without common.pt, "
                f"metadata.json and .metadata")
    return f"{rel}: missing"


def _read_inside(step_dir: str, rel: str, size: int, on_bytes: Optional[Callable[[int], None]]) -> bytearray:
    try:
        fd = paths.open_regular(paths.inside(step_dir, rel))   # a FIFO or device: refused, never waited on
    except (UnsafePath, UntrustedFileError) as exc:
        raise CheckpointError(str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError("not a regular file")
        if st.st_size != size:
            raise CheckpointError(f"size {st.st_size} != {size} when listed (still being written?)")
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:got + (64 << 20)]])
            if not n:
                raise CheckpointError("file shrank while being read")
            got += n
            if on_bytes is not None:
                on_bytes(n)
        return buf
    finally:
        os.close(fd)
