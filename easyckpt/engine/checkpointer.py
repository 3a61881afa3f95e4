"""The one public object: a job's checkpoints in this training process, built from a Config.

    ckpt = Checkpointer(config)      validate the settings, attach to (or start) this node's agent
    ckpt.save(step, state)           every iteration: a snapshot on save_mem_interval, persisted on
                                     save_storage_interval; never waits for storage
    ckpt.save_now(step, state)       a framework's own save point: this step is snapshotted and persisted
    ckpt.load(state)                 the newest complete state (memory or storage, agreed by all ranks)
                                     restored through ``state``; None when there is none
    ckpt.finalize()                  the newest state is committed when it returns; slots released

``state`` is what an adapter knows of its framework on this rank, the one protocol every adapter
implements (FrameworkState): collect this rank's state, say which files a restore reads, restore.
Adapters hold no file I/O, no threads and no knowledge of slots or agents; each adapter's module-level
verbs are a DefaultCheckpointer, a thin default instance over this object.
"""
from __future__ import annotations

import contextlib
import time
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
    runtime_checkable,
)

from easyckpt.config import Config
from easyckpt.engine import scratch
from easyckpt.engine.load.dcp import Wanted
from easyckpt.engine.load import render
from easyckpt.engine.load.newest import Layout
from easyckpt.engine.load.resharded import Route
from easyckpt.engine.load.reads import Read
from easyckpt.engine.load.resumeline import ResumeLine, missing_rng_words, saved_world_size
from easyckpt.engine.load.sources import Loaded
from easyckpt.engine.save.snapshot import ShardSpec, SnapshotResult
from easyckpt.engine.seams import AgentLink, Clock, Group
from easyckpt.engine.session import Engine, Info
from easyckpt.errors import CheckpointError, EasyCkptError
from easyckpt.formats.manifest import Manifest
from easyckpt.storage.resolve import storage_for
from easyckpt.storage.savedir import SaveDir

R = TypeVar("R", covariant=True)


@runtime_checkable
class FrameworkState(Protocol[R]):
    """One adapter's view of its framework's live objects on this rank (model, optimizer, engine, ...)."""

    def collect(self) -> Sequence[ShardSpec]:
        """This rank's state now, as the files of the framework's native layout. Tensors stay tensors
        (the snapshot copies them); called only when a snapshot is taken."""

    def needed(self, manifest: Manifest) -> List[Read]:
        """The files this rank reads to restore the checkpoint ``manifest`` describes (reads.py: a file,
        whether it may be absent, and which part of it). A CheckpointError when it cannot be restored into
        this job. Adapters that write it with tuples decorate it with reads.as_reads."""

    def restore(self, loaded: Loaded) -> R:
        """Put ``loaded.trees`` back into the live objects; returns what the adapter's load verb returns."""

    def layout(self) -> Optional[str]:
        """The parallel layout now (Megatron's TP/PP/...), for adapters whose layout can change under the
        same world size: a snapshot taken on another one is not used. None: the world size says it all."""
        return None

    # What ``restore`` reads of a step of another world size or layout taken from the nodes' memory
    # (engine/load/resharded.py), given the manifest the step would have in storage (its world size the one that
    # wrote it); a rank's memory-only files (not persisted) may be named too. Each is then in ``loaded.trees``,
    # whole, with ``loaded.path`` None. None (the default): such a step is restored from storage, through the
    # framework's own resharding. An adapter that can defines it as a method.
    needed_in_memory: Optional[Callable[[Manifest], List[Read]]] = None
    # Otherwise such a step is written out in the node's /dev/shm for ``restore`` to read as a committed step
    # (engine/load/render.py): the room that takes, in times the step's bytes, is there first or storage serves.
    # More than 1 where the restore writes beside it (DeepSpeed's universal conversion: a copy of its input, then
    # its output), into render.beside(loaded.path, ...).
    render_room: float = 1.0

    def otherwise(self) -> Optional[str]:
        """Where the framework itself resumes from when this job has nothing in save_dir (Megatron's own loader
        reading another --load directory), for the console's line; None: training starts from the beginning."""
        return None

    def snapshot_bytes(self) -> Optional[int]:
        """About how many bytes this rank's first snapshot holds, so its slots are reserved while training
        starts; None when the adapter cannot say."""
        return None

    def loads_later(self) -> bool:
        """Whether the framework loads the state after ``restore`` returns (the Trainer's load hooks): the adapter
        then times that (Checkpointer.loading) and says the resume line itself (Checkpointer.say_resumed)."""
        return False


class Checkpointer:
    """Checkpoints of one job in this process; see the module docstring for the call order."""

    def __init__(self, config: Config, *, group: Optional[Group] = None, link: Optional[AgentLink] = None,
                 clock: Optional[Clock] = None):
        """``group``, ``link``, ``clock``: the engine's seams (seams.py), for tests that run ranks and the
        agent in one interpreter (easyckpt/_testing/); left out, a job's real ones."""
        self.engine = Engine(config, group=group, link=link, clock=clock)
        self.resume: Optional[ResumeLine] = None     # the last load's console line (resumeline.py)

    @property
    def config(self) -> Config:
        return self.engine.cfg

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def save(self, step: int, state: FrameworkState[Any], *, info: Info = None, persist: Optional[bool] = None,
             optimizer: Any = None) -> Optional[SnapshotResult]:
        """Call once per step, after the optimizer step. ``persist``: None = on save_storage_interval,
        False when the framework decides what is persisted (it calls save_now at its save points).
        ``optimizer``: the one whose next step changes the parameters (the snapshot may overlap until then).
        ``info``: recorded in the manifest (e.g. ``{"protect": [best step]}``)."""
        return self.engine.maybe_save(step, state.collect, info=info, persist=persist, optimizer=optimizer)

    def save_now(self, step: int, state: FrameworkState[Any], *, info: Info = None, fresh: bool = False,
                 timeout: Optional[float] = None) -> SnapshotResult:
        """Snapshot ``step`` (unless it already is; ``fresh``: again, the state changed without the step
        changing) and hand it to the agent; waits only for a free slot, never for storage."""
        return self.engine.persist_now(step, state.collect, timeout=timeout, info=info, fresh=fresh)

    def safe_point(self, step: int, state: FrameworkState[Any], *, info: Info = None) -> bool:
        """For a step the framework already saved: still the point where a SIGTERM agreement is kept."""
        return self.engine.safe_point(step, state.collect, info)

    def load(self, state: FrameworkState[R]) -> Optional[R]:
        """Restore the newest complete state through ``state``; None (logged) when there is nothing."""
        # an adapter whose layout can change under the same world size (Megatron's TP/PP) says which it has
        started = time.monotonic()
        # a step of another world size from the nodes' memory: decoded where the adapter takes it so, else written
        # out for its restore to read as a committed step (not for one whose framework loads after restore returns)
        route = Route(state.needed_in_memory, None if state.loads_later() else state.needed, state.render_room)
        loaded = self.engine.load(state.needed, Layout(state.layout(), route), otherwise=state.otherwise())
        if loaded is None:
            self.engine.log.emit("load", step=0, rank=self.rank, source="none",
                                 message="no checkpoint found: starting from scratch")
            restored = None
        else:
            self.resume = ResumeLine(loaded, self.world_size, started)
            try:
                restored = state.restore(loaded)
            finally:
                self._rendered_done(loaded)
            self.resume.since_start()      # the engine's read and the adapter's restore (a conversion included)
            if not state.loads_later():
                self.say_resumed()
        # the snapshot slots are reserved while the first iterations run (an adapter that can say how
        # large its state will be: ``snapshot_bytes``)
        estimate = state.snapshot_bytes()
        if estimate is not None:
            self.engine.prepare(estimate)
        return restored

    def _rendered_done(self, loaded: Loaded) -> None:
        """A step written out of the nodes' memory for the restore (engine/load/render.py) is removed once every rank
        of its node restored: all ranks meet first (a restore that raised on one rank fails the job anyway)."""
        if loaded.source != "resharded" or loaded.path is None:
            return
        self.engine.group.all_gather(None)
        render.remove(loaded.path, self.config.job_id)

    def converting(self, how: str) -> None:
        """The adapter converts the loaded step to this world size (``how``: "through DeepSpeed's universal
        checkpoint"): the resume line says so."""
        if self.resume is not None:
            self.resume.converted(how)

    def loading(self) -> ContextManager[None]:
        """Time a block where the framework loads the resumed state after ``restore`` (FrameworkState.loads_later)."""
        return self.resume.timed() if self.resume is not None else contextlib.nullcontext()

    def timed_hook(self, hook: Callable[..., Any], say_after: bool = False) -> Callable[..., Any]:
        """``hook`` (a framework's load hook), its time counted as loading; ``say_after``: the resume line is said
        once it returned."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.loading():
                out = hook(*args, **kwargs)
            if say_after:
                self.say_resumed()
            return out
        return timed

    def say_resumed(self) -> None:
        """Say the resume line on rank 0's console (once), and what it timed in the audit log."""
        line = self.resume
        if line is None or line.said:
            return
        line.say()
        self.engine.log.record("resumed", step=line.loaded.step, rank=self.rank, seconds=round(line.seconds, 6),
                               saved_world_size=saved_world_size(line.loaded), world_size=self.world_size,
                               converted=line.how)

    def missing_rng(self, who: str) -> None:
        """Warn that ``who`` (this rank, this process) has no RNG state in the loaded step; expected on a new world
        size, and said so."""
        self.emit("warning", message=missing_rng_words(who, self.resume.loaded if self.resume else None,
                                                       self.world_size))

    def is_committed(self, step: int, directory: Optional[str] = None) -> bool:
        """Whether ``step`` is committed (its manifest verifies) in ``directory`` (default: save_dir)."""
        where = directory if directory is not None else self.config.save_dir
        return SaveDir(where, self.config.naming).is_committed(step)

    def settle(self) -> None:
        """Finish the snapshot copy running in the background, if one runs: before the framework itself changes
        the parameters in place outside an optimizer step (the Trainer loading its best model at the end)."""
        self.engine.settle()

    def wait_committed(self, step: int, timeout: Optional[float] = None) -> None:
        """Block until ``step``, already handed to the agent, is committed (AgentError after ``timeout``)."""
        self.engine.wait_committed(step, timeout)

    def staging(self, loaded: Loaded) -> Optional[scratch.Stage]:
        """How a reader that opens paths (DCP's, Megatron's) reads the committed step ``loaded`` from an object
        store: a copy in this rank's scratch directory under the node directory holding only what its load reads,
        made first of what the loader already fetched and checked (each copy said in the audit log: ``staged``,
        with the bytes fetched for it and those reused). The ranks agree that every copy is made before any
        reader starts (its load is a collective: a rank whose copy failed would leave the others waiting in
        it); one failure fails every rank, naming it. None where the reader opens the step itself (a file
        system: nothing is computed or copied) and for a snapshot (memory, a peer, the local tier)."""
        if loaded.path is None or loaded.manifest is None or storage_for(loaded.path).local:
            return None
        cfg, step = self.config, loaded.step

        def said(fetched: int, reused: int, listed: int) -> None:
            self.emit("staged", step=step, fetched=fetched, reused=reused, listed=listed)
        copy = scratch.staging(loaded.path, loaded.manifest, scratch.path(cfg.node_dir, "restore", cfg.job_id,
                                                                             self.rank), said, loaded.fetched)

        @contextlib.contextmanager
        def agreed(wanted: Wanted, files: Callable[[str], bool]) -> Iterator[str]:
            with contextlib.ExitStack() as stack:
                failed = None
                try:
                    here = stack.enter_context(copy(wanted, files))
                except Exception as exc:  # noqa: BLE001 - said to every rank, then raised here
                    failed = exc
                why = self.engine.group.all_gather(None if failed is None else f"{type(failed).__name__}: {failed}")
                bad = [(rank, text) for rank, text in enumerate(why) if text]
                if bad:
                    raise CheckpointError(f"step {step} from {loaded.path}: the copy for the framework's reader "
                                          f"failed on rank {bad[0][0]} ({bad[0][1][:400]})"
                                          + (f" and on {len(bad) - 1} more" if len(bad) > 1 else "")) from failed
                yield here
        return agreed

    def metrics(self) -> Dict[str, float]:
        """This rank's checkpointing figures so far, ``{"easyckpt/<name>": number}`` (engine/link/metrics.py;
        docs/metrics.md lists the keys); after finalize, the run's last ones."""
        return self.engine.metrics.values()

    def emit(self, event: str, **fields: Any) -> None:
        """A line of the audit log (and the console, for warnings and errors) from this rank."""
        self.engine.log.emit(event, rank=self.rank, **fields)

    def finalize(self, timeout: Optional[float] = None, persist: bool = True) -> Optional[int]:
        """Persist and commit the newest state, wait for the commit, release the slots; returns its step.
        ``persist=False``: only release (the framework was told not to save)."""
        return self.engine.finalize(timeout, persist=persist)


class DefaultCheckpointer:
    """The checkpointer behind an adapter's module-level verbs (initialize → save/load → finalize)."""

    def __init__(self, verbs: str):
        self.verbs = verbs            # e.g. "easyckpt" or "easyckpt.megatron", for messages
        self.current: Optional[Checkpointer] = None
        self.finished: Optional[Checkpointer] = None     # the last one finalized: its figures stay readable
        # what initialize_easyckpt builds: a Checkpointer over the job's real seams; the test suite swaps it
        # for one over an in-process agent (tests/inproc.py) to run the example's loop in its interpreter
        self.make: Callable[[Config], Checkpointer] = Checkpointer

    def start(self, config: Config) -> Checkpointer:
        if self.current is not None:
            raise EasyCkptError(f"{self.verbs}.initialize_easyckpt was already called in this process; call "
                                f"{self.verbs}.finalize_easyckpt() first to start another job")
        self.current = self.make(config)
        return self.current

    def require(self) -> Checkpointer:
        if self.current is None:
            hint = (" (with the Megatron-LM patches: pass --save DIR, which is where easyckpt saves; add --load DIR "
                    "to resume)" if self.verbs == "easyckpt.megatron" else "")
            raise EasyCkptError(f"call {self.verbs}.initialize_easyckpt(...) before saving or loading{hint}")
        return self.current

    def finalize(self, timeout: Optional[float] = None) -> Optional[int]:
        ckpt = self.require()
        try:
            return ckpt.finalize(timeout)
        finally:
            self.current, self.finished = None, ckpt

    def metrics(self) -> Dict[str, float]:
        """The current job's figures (Checkpointer.metrics), or the last finalized one's; {} before any."""
        ckpt = self.current or self.finished
        return ckpt.metrics() if ckpt is not None else {}


__all__ = ["Checkpointer", "DefaultCheckpointer", "FrameworkState"]
