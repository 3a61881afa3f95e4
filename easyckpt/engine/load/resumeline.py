"""The console's resume line: what was resumed, from where, and how long the whole load took, conversion included.

The engine picks and reads the step (session.py's load); the adapter then puts it into the framework (its
``restore``), which on another world size is where the time goes: DeepSpeed's universal-checkpoint conversion,
DCP's resharding. So the line is said after that, by checkpointer.py, with both timed; an adapter whose framework
loads later (the Trainer calls its load hooks after ``restore`` returned) times those hooks with ``timed`` and says
the line when they are done. A step written by another number of ranks is said as such, with the conversion the
adapter named (``converted``), so a resume that took seconds does not read as the reading of a few MiB.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional, Sequence

from easyckpt import console
from easyckpt.engine.load.sources import Loaded
from easyckpt.units import human

_WHERE = {"memory": "memory (the snapshot that outlived the last run)",
          "peer": "a peer node's memory (the replica of this node's snapshot)",
          "local": "the local tier (each rank's snapshot on its node's disk, verified)"}


def saved_world_size(loaded: Optional[Loaded]) -> Optional[int]:
    """The number of ranks that wrote the loaded step (a committed step's manifest says; a snapshot in memory is
    always of this world size: None)."""
    return loaded.manifest.world_size if loaded is not None and loaded.manifest is not None else None


def nothing_words(save_dir: str, fresh: Sequence[int] = (), otherwise: Optional[str] = None) -> str:
    """The line for a start with nothing resumed; ``fresh``: this job's steps set aside by start_fresh."""
    if fresh:
        return (f"none of this job's {len(fresh)} committed step(s) in {save_dir} ({', '.join(map(str, fresh))}) can "
                f"be restored here: training starts from the beginning, as on_no_valid_checkpoint='start_fresh' "
                f"allows; they are set aside as quarantined-<name>-<stamp>, kept whole (`easyckpt ls` lists them)")
    return f"no checkpoint of this job in {save_dir}: {otherwise or 'training starts from the beginning'}"


def missing_rng_words(who: str, loaded: Optional[Loaded], world_size: int) -> str:
    """The warning for a rank with no RNG state in the loaded step. On another world size that is expected: the
    Trainer names its RNG files by the number of processes, and a rank the checkpoint did not have has none."""
    saved = saved_world_size(loaded)
    if saved is None or saved == world_size:
        return f"no RNG state saved for {who}"
    return (f"no RNG state saved for {who}: expected on a new world size (the step was written by {saved} rank(s), "
            f"this run has {world_size}); it starts a fresh RNG stream")


class ResumeLine:
    """The resume line of one load: said once, on rank 0's console."""

    def __init__(self, loaded: Loaded, world_size: int, started: float):
        self.loaded, self.world_size, self.started = loaded, world_size, started
        self.seconds = 0.0           # spent loading, as timed so far (the engine's read and the adapter's restore)
        self.how: Optional[str] = None      # the adapter's conversion, e.g. "through DeepSpeed's universal checkpoint"
        self.said = False

    def since_start(self) -> None:
        """Count the time from the load's start until now (the engine's read, the adapter's restore)."""
        self.seconds += time.monotonic() - self.started

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Count the time spent in this block (a framework's load hook) as loading."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds += time.monotonic() - t0

    def converted(self, how: str) -> None:
        self.how = how

    def words(self) -> str:
        loaded = self.loaded
        where = _WHERE.get(loaded.source) or (f"storage ({loaded.path}, verified)" if loaded.source == "storage"
                                              else f"{loaded.path} ({loaded.source})")
        if loaded.detail:
            where = f"memory, {loaded.detail}"
        if loaded.from_peers and loaded.source != "peer":
            where += f"; rank(s) {list(loaded.from_peers)} from a peer node's memory (the replicas of their lost node)"
        size = human(loaded.nbytes) + (" on rank 0" if self.world_size > 1 else "")
        saved = saved_world_size(loaded)
        changed = ""
        if saved is not None and saved != self.world_size and not loaded.detail:
            changed = (f", converted from {saved} rank(s) to {self.world_size} {self.how} (the conversion included)"
                       if self.how else f", written by {saved} rank(s), loaded by {self.world_size}")
        return f"resumed step {loaded.step} from {where}: {size} in {self.seconds:.2f} s{changed}"

    def say(self) -> None:
        if not self.said:
            self.said = True
            console.info(self.words())
