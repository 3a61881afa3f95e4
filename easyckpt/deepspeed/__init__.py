"""DeepSpeed engines (ZeRO 0-3): the three verbs, in DeepSpeed's native ``global_stepN/`` layout.

On-disk layout of step N (``global_step{N}/``), byte for byte what ``engine.save_checkpoint`` writes:
    mp_rank_00_model_states.pt                         module, scheduler, counters, client_state (ZeRO 0-2,
                                                       written by the data-parallel writer)
    zero_pp_rank_{dp}_mp_rank_00_model_states.pt       the same per rank under ZeRO-3
    [bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt this rank's ZeRO optimizer partition
    easyckpt_rng/rank_{r:05d}.safetensors              every rank's RNG states (DeepSpeed keeps none)
and ``latest`` holds ``global_stepN`` after the commit, so ``engine.load_checkpoint(save_dir)`` reads it.

How: for a snapshot, the engine's checkpoint engine is swapped for one that *captures* the state dicts
DeepSpeed hands it instead of writing them (DeepSpeed's own code decides what goes into each file);
the agent later writes them with torch.save. For a load, the swapped engine *serves* the trees easyckpt
read (from memory, or from storage after verifying the manifest), so ``engine.load_checkpoint`` restores
exactly as it would from files (easyckpt/deepspeed/state.py, shared with the Trainer's adapter). A different
data-parallel size is refused by plain ZeRO; easyckpt then converts the committed step with DeepSpeed's
universal-checkpoint converter into a temporary directory under the save dir, loads it with
``load_universal``, and removes it (easyckpt/deepspeed/universal.py).

Decision: every rank snapshots the model-states file (memory resume needs no collective), only the
writer persists it. The helper scripts DeepSpeed copies next to the tag directory (zero_to_fp32.py)
are not written by the plain-engine verbs: they would live outside the atomically committed step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from easyckpt.config import NAMINGS, STORAGE_DEFAULT, Config, adapter_config
from easyckpt.deepspeed import cpu, universal
from easyckpt.deepspeed.state import (
    UNIVERSAL_INFO,
    dp_rank,
    dp_size,
    native_shards,
    needed_files,
    restore_native,
    restore_universal,
    same_layout,
)
from easyckpt.deepspeed.state import snapshot_bytes as ds_snapshot_bytes
from easyckpt.engine import scratch
from easyckpt.engine.checkpointer import (
    Checkpointer,
    DefaultCheckpointer,
    FrameworkState,
)
from easyckpt.engine.load.reads import as_reads
from easyckpt.engine.load.sources import Loaded
from easyckpt.engine.save import rng
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.formats.manifest import Manifest

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

NAMING = NAMINGS["deepspeed"]
RNG_DIR = "easyckpt_rng/"

_default = DefaultCheckpointer("easyckpt.deepspeed")


def _rng_file(rank: int) -> str:
    return f"{RNG_DIR}rank_{rank:05d}.safetensors"


@dataclass
class DeepSpeedState(FrameworkState[Any]):
    """A DeepSpeed engine on one rank (the FrameworkState of this adapter); the step is its global_steps."""

    ckpt: Checkpointer
    engine: "DeepSpeedEngine"
    client_state: Optional[Dict[str, Any]] = None
    load_kwargs: Optional[Dict[str, Any]] = None
    step: int = field(init=False, default=0)
    # a step resharded from memory is written out, then its universal conversion stages a copy of its DeepSpeed files
    # and writes the converted copy beside it, all in the node's /dev/shm (universal.where)
    render_room = 3.0

    def __post_init__(self) -> None:
        # the step the verb was called at: a later collect (finalize, SIGTERM) saves it under that tag
        self.step = self.engine.global_steps

    def info(self) -> Dict[str, Any]:
        return {"dp_world_size": dp_size(self.engine)}

    def collect(self) -> List[ShardSpec]:
        step = self.step
        shards = native_shards(self.engine, NAMING.dir_name(step), client_state=self.client_state)
        shards.append(ShardSpec(_rng_file(self.ckpt.rank), {"iteration": step, "rng": rng.capture()}))
        return shards

    def snapshot_bytes(self) -> int:
        """About what the first snapshot holds (the slots are reserved ahead, engine/save/estimate.py)."""
        return ds_snapshot_bytes(self.engine)

    @as_reads
    def needed(self, manifest: Manifest) -> List[Tuple[str, bool]]:
        files = needed_files("", dp_rank(self.engine), dp_size(self.engine), manifest)
        return [f for f in files if not f[0].startswith(RNG_DIR)] + [(_rng_file(self.ckpt.rank), True)]

    def restore(self, loaded: Loaded) -> Tuple[str, Dict[str, Any]]:
        ckpt, kwargs = self.ckpt, self.load_kwargs or {}
        tag = NAMING.dir_name(loaded.step)
        if same_layout(self.engine, loaded.manifest):    # a memory snapshot always has the current layout
            client_state = restore_native(self.engine, loaded.trees, tag, **kwargs)
        else:
            work, converts = universal.where(ckpt.config, loaded, ckpt.rank)
            ckpt.emit("convert", step=loaded.step, path=loaded.path, into=work,
                      message=f"data-parallel size {loaded.manifest.info.get('dp_world_size') if loaded.manifest else None} → "
                              f"{dp_size(self.engine)}: loading through DeepSpeed's universal checkpoint")
            ckpt.converting("through DeepSpeed's universal checkpoint")
            # only a committed step can have another layout
            assert loaded.path is not None and loaded.manifest is not None
            cfg = ckpt.config
            # DeepSpeed's converter opens paths: a step in an object store is read through a checked local copy
            with scratch.local_step(loaded.path, loaded.manifest,
                                    scratch.path(cfg.node_dir, "restore", cfg.job_id, ckpt.rank)) as step_dir:
                client_state = restore_universal(self.engine, step_dir, tag, work, converts, ckpt.world_size,
                                                 **kwargs)
        per_rank = loaded.trees.get(_rng_file(ckpt.rank))
        if per_rank is not None:
            rng.restore(per_rank["rng"])
        client_state.pop(UNIVERSAL_INFO, None)
        return loaded.path or os.path.join(ckpt.config.save_dir, tag), client_state


def initialize_easyckpt(save_dir: Union[str, Config, None] = None, save_mem_interval: int = 1,
                        save_storage_interval: int = STORAGE_DEFAULT, max_ckpt_num: Optional[int] = 5,
                        log_file_path: Union[str, bool, None] = None, *, config: Optional[Config] = None,
                        **advanced: Any) -> None:
    """Validate the settings and attach to this node's agent; call after ``deepspeed.initialize``.
    ``advanced``: see easyckpt.config.ADVANCED (e.g. ``exit_after_ondemand_checkpoint=True``); or one
    ``Config`` instead of the keywords: ``initialize_easyckpt(config)`` / ``initialize_easyckpt(config=config)``."""
    if isinstance(save_dir, Config):
        config, save_dir = save_dir, None
    cpu.advise()
    _default.start(adapter_config("initialize_easyckpt", NAMING, config, dict(
        save_dir=save_dir, save_mem_interval=save_mem_interval, save_storage_interval=save_storage_interval,
        max_ckpt_num=max_ckpt_num, log_file_path=log_file_path), advanced))


def save_checkpoint_if_needed(ds_engine: "DeepSpeedEngine", client_state: Optional[Dict[str, Any]] = None) -> None:
    """Call after every ``engine.step()``; the step is ``engine.global_steps``. ``client_state`` is
    stored as DeepSpeed stores it (in the model-states file) and returned by load_checkpoint."""
    ckpt = _default.require()
    state = DeepSpeedState(ckpt, ds_engine, client_state)
    ckpt.save(state.step, state, info=state.info(), optimizer=ds_engine.optimizer)


def save_checkpoint_now(ds_engine: "DeepSpeedEngine", client_state: Optional[Dict[str, Any]] = None) -> None:
    """Snapshot the current step (unless it already is) and have it persisted, without waiting for storage."""
    ckpt = _default.require()
    state = DeepSpeedState(ckpt, ds_engine, client_state)
    ckpt.save_now(state.step, state, info=state.info())


def load_checkpoint(ds_engine: "DeepSpeedEngine", load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Restore the newest complete state (memory or storage) into ``ds_engine``; DeepSpeed's return
    value: ``(load_path, client_state)``, ``(None, None)`` when there is nothing to resume from."""
    ckpt = _default.require()
    kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                  load_lr_scheduler_states=load_lr_scheduler_states)
    restored = ckpt.load(DeepSpeedState(ckpt, ds_engine, load_kwargs=kwargs))
    return (None, None) if restored is None else restored


def checkpoint_metrics() -> Dict[str, float]:
    """This rank's checkpointing figures, ``{"easyckpt/<name>": number}`` (docs/metrics.md), e.g. for
    DeepSpeed's ``monitor.write_events([(name, value, step), ...])``; after finalize_easyckpt, the run's final ones."""
    return _default.metrics()


def finalize_easyckpt(timeout: Optional[float] = None) -> Optional[int]:
    """Make the newest state durable (persisted and committed), then release shared memory."""
    return _default.finalize(timeout)


__all__ = ["initialize_easyckpt", "save_checkpoint_if_needed", "save_checkpoint_now", "load_checkpoint",
           "finalize_easyckpt", "NAMING", "DeepSpeedState"]
