"""The Hugging Face Trainer's state as easyckpt sees it (the FrameworkState of easyckpt.transformers), and the
Trainer methods one ``train`` call swaps for easyckpt's: where the snapshots are taken, what replaces the
Trainer's own save, and how a resume feeds the Trainer's own load path. TrainerWrapper and EasyCkptCallback
both run the Trainer under one _Session (easyckpt/transformers/__init__.py); nothing here is public."""
from __future__ import annotations

import contextlib
import io
import json
import os
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Optional,
    Set,
    Tuple,
)

import torch

import easyckpt.deepspeed.state as ds
import easyckpt.deepspeed.universal as universal
from easyckpt.config import NAMINGS
from easyckpt.engine import scratch
from easyckpt.engine.checkpointer import Checkpointer, FrameworkState
from easyckpt.engine.load.reads import as_reads
from easyckpt.engine.load.sources import Loaded
from easyckpt.engine.save.snapshot import ShardSpec
from easyckpt.errors import CheckpointError
from easyckpt.formats.layout import deepspeed_tag
from easyckpt.formats.manifest import Manifest
from easyckpt.formats.shardformat import ShardFormat
from easyckpt.transformers import fsdp, logs, peftmodel, rng
from easyckpt.transformers.statejson import TrainerStateJson

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

# the Trainer keeps no tracker file: it finds checkpoints by their names
NAMING = NAMINGS["transformers"]
STATE, ARGS, MODEL, OPTIM, SCHED, SCALER = ("trainer_state.json", "training_args.bin", "model.safetensors",
                                            "optimizer.pt", "scheduler.pt", "scaler.pt")


class _Session(FrameworkState[Any]):
    """One ``train`` call: the Trainer's hooks swapped for easyckpt's, and the state they share; the
    FrameworkState of this adapter (collect, needed, restore)."""

    def __init__(self, trainer: "Trainer", engine: Checkpointer):
        self.fsdp = bool(getattr(trainer, "is_fsdp_enabled", False))      # FSDP2: fsdp.py's layout
        if self.fsdp:
            fsdp.check_supported(trainer)
        self.trainer, self.engine = trainer, engine
        self.trees: Optional[Dict[str, Any]] = None      # what a resume feeds the Trainer's load hooks
        self.loaded_manifest: Optional[Manifest] = None
        self.loaded_path: Optional[str] = None
        self.virtual_dir: Optional[str] = None
        self.local_dir: Optional[str] = None             # a loaded step copied from an object store (_local)
        self.stage: Optional[scratch.Stage] = None        # how DCP's reader opens the loaded step (FSDP)
        self.saved_now = False
        self.requested: Set[int] = set()                # steps handed to the agent in this run
        # a PeftModel's checkpoint holds its adapter; the frozen weights are checked by their checksum
        self.peft = peftmodel.peft_model(trainer.model)
        self.peft_base = peftmodel.base_checksum(self.peft) if self.peft is not None else None
        self.static = self._static_files()
        self.state_json = TrainerStateJson()        # trainer_state.json, its log history encoded once per entry
        if not self.fsdp and not trainer.is_deepspeed_enabled:     # (their readers open a path after restore)
            self.needed_in_memory = self.needed     # another world size's step from memory, decoded (resharded.py)

    # ---- what goes into checkpoint-N --------------------------------------------------------------

    @property
    def args(self) -> "TrainingArguments":
        return self.trainer.args

    @property
    def ds_engine(self) -> Any:
        return self.trainer.model_wrapped if self.trainer.is_deepspeed_enabled else None

    def _rng_file(self) -> str:
        return "rng_state.pth" if self.args.world_size <= 1 else f"rng_state_{self.args.process_index}.pth"

    def _static_files(self) -> List[Tuple[str, bytes]]:
        """Files that do not change during training, serialised once: arguments, model config,
        tokenizer/processor files."""
        out: List[Tuple[str, bytes]] = []
        buf = io.BytesIO()
        torch.save(self.args, buf)
        out.append((ARGS, buf.getvalue()))
        model: Any = self.trainer.model       # any model class: its files are found by duck typing
        config = getattr(model, "config", None)
        if self.peft is not None:           # what PeftModel.save_pretrained writes in place of the model's files
            out.append((peftmodel.ADAPTER_CONFIG, peftmodel.config_json(self.peft)))
        elif config is not None and hasattr(config, "to_json_string"):
            # as save_pretrained writes it (it sets these on the live config at each Trainer save)
            config.architectures, config.dtype = [type(model).__name__], getattr(model, "dtype", config.dtype)
            out.append(("config.json", config.to_json_string(use_diff=True).encode()))
        gen = getattr(model, "generation_config", None)
        if self.peft is None and gen is not None and hasattr(model, "can_generate") and model.can_generate():
            out.append(("generation_config.json", gen.to_json_string(use_diff=True).encode()))
        processor = getattr(self.trainer, "processing_class", None)
        if processor is not None and hasattr(processor, "save_pretrained") and self.args.should_save:
            assert self.args.output_dir is not None     # TrainingArguments fills in its default
            tmp = scratch.path(self.args.output_dir, "processor", self.engine.config.job_id)
            out.extend(scratch.files_written_by(processor.save_pretrained, tmp))
        if self.ds_engine is not None:
            from deepspeed.utils import zero_to_fp32
            out.append(("zero_to_fp32.py", scratch.file_bytes(zero_to_fp32.__file__)))
        return out

    def _model_state(self) -> Dict[str, torch.Tensor]:
        """The model's weights without the duplicates of tied parameters (what save_pretrained keeps)."""
        out, seen = {}, set()
        model = self.trainer.model
        assert model is not None        # the Trainer holds its model (model_init runs before training)
        for name, t in model.state_dict().items():
            key = _storage_id(t)
            if key is not None and key in seen:
                continue
            seen.add(key)
            out[name] = t
        return out

    def _weights(self) -> Tuple[str, Dict[str, torch.Tensor]]:
        """The model file of checkpoint-N and its tensors: a PeftModel's adapter, else the whole model."""
        if self.peft is not None:
            return peftmodel.ADAPTER, peftmodel.adapter_state(self.peft)
        return MODEL, self._model_state()

    def collect(self) -> List[ShardSpec]:
        trainer, args, writer = self.trainer, self.args, self.args.should_save
        trainer.store_flos()          # as the Trainer does before each save (a sum across ranks)
        shards: List[ShardSpec] = [ShardSpec(name, data, persist=writer, fmt=ShardFormat.RAW) for name, data in self.static]
        dse = self.ds_engine
        if self.fsdp:
            shards.extend(fsdp.shards(trainer, args.process_index))
        elif dse is None:
            shards.append(ShardSpec(*self._weights(), persist=writer))
            assert trainer.optimizer is not None    # train() creates it before the first save
            shards.append(ShardSpec(OPTIM, trainer.optimizer.state_dict(), persist=writer, fmt=ShardFormat.TORCH))
        else:
            tag = deepspeed_tag(dse.global_steps)
            if not dse.zero_optimization_partition_weights():
                shards.append(ShardSpec(MODEL, self._model_state(), persist=writer))
            shards.extend(ds.native_shards(dse, tag, prefix=tag + "/"))
            shards.append(ShardSpec("latest", tag, persist=writer, fmt=ShardFormat.RAW))
        if trainer.lr_scheduler is not None and not _is_ds_scheduler(trainer.lr_scheduler):
            shards.append(ShardSpec(SCHED, trainer.lr_scheduler.state_dict(), persist=writer, fmt=ShardFormat.TORCH))
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            shards.append(ShardSpec(SCALER, scaler.state_dict(), persist=writer, fmt=ShardFormat.TORCH))
        shards.append(ShardSpec(self._rng_file(), rng.states(args), persist=True, fmt=ShardFormat.TORCH))
        shards.append(ShardSpec(STATE, self.state_json.text(self.trainer), persist=writer, fmt=ShardFormat.RAW))
        return shards

    def snapshot_bytes(self) -> int:
        """About what the first snapshot holds (the slots are reserved ahead, engine/save/estimate.py). The
        Trainer creates its optimizer inside train(), after the resume point is chosen: without one
        yet, an Adam-family ``args.optim`` counts two moments of every trainable parameter. Under
        DeepSpeed the engine, and with it how ZeRO partitions the state, does not exist yet: no estimate
        (the first snapshot allocates)."""
        from easyckpt.engine.save import estimate

        if self.trainer.is_deepspeed_enabled or self.fsdp:     # (FSDP shards the model inside train())
            return 0
        total = estimate.tensor_bytes(self._weights()[1])
        opt = self.trainer.optimizer
        if opt is not None:
            return total + estimate.optimizer_bytes(opt)
        if "adam" in str(getattr(self.args.optim, "value", self.args.optim)).lower():
            model = self.trainer.model
            assert model is not None        # as in _model_state, just above
            total += estimate.adam_moments(p for p in model.parameters() if p.requires_grad)
        return total

    def info(self) -> Dict[str, Any]:
        state = self.trainer.state
        best = _step_of(state.best_model_checkpoint)
        out: Dict[str, Any] = {"protect": [best] if best is not None else []}
        if self.ds_engine is not None:
            out["dp_world_size"] = ds.dp_size(self.ds_engine)
        if self.peft_base is not None:
            out[peftmodel.BASE_KEY] = self.peft_base
        return out

    # ---- the Trainer's hooks ----------------------------------------------------------------------

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        import transformers.trainer as trainer_module
        t = self.trainer
        # instance attributes that shadow the Trainer's methods for this call (popped again below)
        t._maybe_log_save_evaluate = self._maybe_log_save_evaluate(  # type: ignore[method-assign]
            t._maybe_log_save_evaluate)
        t._save_checkpoint = self._save_checkpoint  # type: ignore[method-assign]
        t._load_best_model = self._load_best_model(t._load_best_model)  # type: ignore[method-assign]
        t.log = logs.with_metrics(t.log, self.engine)  # type: ignore[method-assign]
        saved_limit = t.args.save_total_limit
        # easyckpt prunes (logged, never the newest); the Trainer's end-of-training deletion must not
        t.args.save_total_limit = None
        ds_load = trainer_module.deepspeed_load_checkpoint
        trainer_module.deepspeed_load_checkpoint = self._deepspeed_load(ds_load)
        try:
            yield
        finally:
            trainer_module.deepspeed_load_checkpoint = ds_load
            t.args.save_total_limit = saved_limit
            for name in ("_maybe_log_save_evaluate", "_save_checkpoint", "_load_best_model", "_load_from_checkpoint",
                         "log", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state"):
                t.__dict__.pop(name, None)

    def _maybe_log_save_evaluate(self, original: Callable[..., None]) -> Callable[..., None]:
        def wrapped(*args: Any, **kwargs: Any) -> None:
            self.saved_now = False
            original(*args, **kwargs)
            step = self.trainer.state.global_step
            if step > 0 and not self.saved_now:
                self.engine.save(step, self, info=self.info(), persist=False, optimizer=self.trainer.optimizer)
            elif step > 0:     # saved by the Trainer just now; still a safe point for a SIGTERM agreement
                self.engine.safe_point(step, self, info=self.info())
        return wrapped

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save points: snapshot this step now (the state may have changed since the last
        snapshot of the same step: evaluation, best metric) and hand it to the agent."""
        state, args = self.trainer.state, self.args
        config = self.engine.config     # checkpoint-N go to the save_dir (output_dir, or an object store)
        run_dir = config.save_dir if config.in_store else self.trainer._get_output_dir(trial=trial)
        if args.save_strategy in ("steps", "epoch", "best") and state.best_global_step:
            best = state.best_global_step
            if best in self.requested or best == state.global_step or self.engine.is_committed(best, run_dir):
                state.best_model_checkpoint = os.path.join(run_dir, NAMING.dir_name(best))
        self.engine.save_now(state.global_step, self, info=self.info(), fresh=True)
        self.requested.add(state.global_step)
        self.saved_now = True

    def _load_best_model(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # the Trainer loads the best weights in place: the last snapshot's background copy ends first (else
            # it would be torn, and the user told to turn the overlap off for what the Trainer did)
            self.engine.settle()
            state = self.trainer.state
            where, best = state.best_model_checkpoint, _step_of(state.best_model_checkpoint)
            if best is not None and best in self.requested:
                self.engine.wait_committed(best)      # its persist may still be under way
            if where is None or best is None or not self.engine.config.in_store:
                return original(*args, **kwargs)
            # the Trainer reads the best weights by path: from an object store, a verified copy on this node
            with scratch.local_committed(where, best, self._scratch("best")) as here:
                state.best_model_checkpoint = here
                try:
                    return original(*args, **kwargs)
                finally:
                    state.best_model_checkpoint = where
        return wrapped

    def _scratch(self, kind: str) -> str:
        assert self.args.output_dir is not None     # TrainingArguments fills in its default
        return scratch.path(self.args.output_dir, kind, self.engine.config.job_id, self.engine.rank)

    def _local(self) -> Optional[str]:
        """The loaded step for readers that open paths (DCP's, DeepSpeed's universal checkpoint): the step
        itself, or a verified copy of it from an object store (removed by cleanup); None: from memory."""
        if self.loaded_path is None or not self.engine.config.in_store:
            return self.loaded_path
        if self.local_dir is None:
            assert self.loaded_manifest is not None     # restore() set it with the path
            self.local_dir = scratch.local_copy(self.loaded_path, self.loaded_manifest, self._scratch("restore"))
        return self.local_dir

    # ---- resume -----------------------------------------------------------------------------------

    def resume_point(self) -> Optional[str]:
        """Choose what to resume from (a plain Trainer's checkpoint-N included: source "adopted"); install
        the load hooks that feed it. None: from scratch."""
        return self.engine.load(self)

    def restore(self, loaded: Loaded) -> str:
        engine = self.engine
        self.trees, self.loaded_path = loaded.trees, loaded.path
        self.loaded_manifest = loaded.manifest
        self.stage = engine.staging(loaded)     # DCP's reader (FSDP): each rank's items only, from an object store
        t = self.trainer
        # the Trainer's load hooks, shadowed by instance attributes (hooks() pops them)
        t._load_from_checkpoint = engine.timed_hook(self._load_model)  # type: ignore[method-assign]
        # the Trainer's last load of any weight (the scaler's and the RNG states are small): the resume line after it
        t._load_optimizer_and_scheduler = engine.timed_hook(  # type: ignore[method-assign]
            self._load_optimizer_and_scheduler, say_after=True)
        t._load_scaler = self._load_scaler  # type: ignore[method-assign]
        t._load_rng_state = self._load_rng_state  # type: ignore[method-assign]
        if loaded.path is not None and not engine.config.in_store:
            return loaded.path
        # from memory or an object store: the Trainer reads trainer_state.json by path; give it just that file
        self.virtual_dir = os.path.join(self._scratch("resume"), NAMING.dir_name(loaded.step))
        state = loaded.trees[STATE]
        if engine.config.in_store:    # a best checkpoint in the store is no directory to the Trainer: kept aside
            state = json.dumps(dict(json.loads(state), best_model_checkpoint=None)).encode()
        return scratch.staged_file(self.virtual_dir, STATE, state)

    @as_reads
    def needed(self, manifest: Manifest) -> List[Tuple[str, bool]]:
        files = [(STATE, False), (self._rng_file(), True)]
        sharded = fsdp.needed(manifest, self.fsdp, self.args.process_index, self.args.world_size)
        if sharded is not None:
            files += sharded
        elif not self.trainer.is_deepspeed_enabled:     # (its engine does not exist yet)
            # a PeftModel's adapter (a checkpoint written before adapters were saved alone holds the model)
            weights = peftmodel.ADAPTER if self.peft is not None and MODEL not in manifest.files else MODEL
            if self.peft_base is not None:
                peftmodel.check_base(manifest.info.get(peftmodel.BASE_KEY), self.peft_base, manifest.step)
            files += [(weights, False), (OPTIM, False)]
        else:
            tag = deepspeed_tag(manifest.step)
            files += ds.needed_files(tag + "/", self.args.process_index, self.args.world_size, manifest)
        for optional in (SCHED, SCALER):
            files.append((optional, True))
        return files

    def loads_later(self) -> bool:
        return True         # the Trainer calls the load hooks below after restore(): they are timed, then said

    def _load_model(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        model = model if model is not None else self.trainer.model
        assert model is not None and self.trees is not None    # the Trainer's model; restore() set the trees
        if self.fsdp:        # the model is sharded by now (the Trainer loads it after accelerate's prepare)
            # (loaded_path is None for a snapshot in memory: dtensor reads it there)
            self.engine.converting("by DCP's resharding")      # said only where the world size changed
            fsdp.load_model(model, self.trees, self.loaded_path, self.args.process_index, self.stage)
            return
        if peftmodel.ADAPTER in self.trees:
            peftmodel.restore_adapter(model, self.trees[peftmodel.ADAPTER])
            return
        result = model.load_state_dict(self.trees[MODEL], strict=False)
        tied = _tied(model, result.missing_keys, self.trees[MODEL])
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"checkpoint does not match the model: missing {missing}, "
                                  f"unexpected {result.unexpected_keys}")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        t = self.trainer
        assert self.trees is not None       # restore() set them before the Trainer calls its load hooks
        self._keep_remote_best()
        if self.fsdp:
            fsdp.load_optimizer(t, self.trees, self.loaded_path, self.args.process_index, self.stage)
        elif self.ds_engine is None:
            assert t.optimizer is not None  # the Trainer loads into the optimizer it just created
            t.optimizer.load_state_dict(self.trees[OPTIM])
        if SCHED in self.trees and not _is_ds_scheduler(t.lr_scheduler):
            assert t.lr_scheduler is not None
            t.lr_scheduler.load_state_dict(self.trees[SCHED])

    def _keep_remote_best(self) -> None:
        """The resumed state's best checkpoint in an object store, which the Trainer would drop as missing (it
        looks with os.path.isdir; restore() hid it from that check): kept when committed there. This hook is the
        Trainer's next call after it loads the state."""
        best = json.loads(self.trees[STATE]).get("best_model_checkpoint") if self.trees else None
        config = self.engine.config
        if not (config.in_store and isinstance(best, str) and os.path.dirname(best) == config.save_dir.rstrip("/")):
            return
        step = _step_of(best)
        if step is not None and self.engine.is_committed(step, config.save_dir):
            self.trainer.state.best_model_checkpoint = best

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is None:
            return
        assert self.trees is not None       # restore() set them before the Trainer calls its load hooks
        if SCALER in self.trees:
            scaler.load_state_dict(self.trees[SCALER])

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        self.engine.say_resumed()       # unless said already: a Trainer that skipped the optimizer's hook
        state = (self.trees or {}).get(self._rng_file())
        if state is None:
            self.engine.missing_rng("this process")
            return
        rng.restore(state)

    def _deepspeed_load(self, original: Callable[..., None]) -> Callable[..., None]:
        def load(ds_engine: Any, checkpoint_path: str, load_module_strict: bool = True) -> None:
            if self.trees is None:          # an explicit path or a plain Trainer's checkpoint
                return original(ds_engine, checkpoint_path, load_module_strict=load_module_strict)
            step = int(json.loads(self.trees[STATE])["global_step"])
            tag = deepspeed_tag(step)
            kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=True,
                          load_lr_scheduler_states=True)
            with self.engine.loading():
                if self.loaded_path is None or ds.same_layout(ds_engine, self.loaded_manifest):
                    ds.restore_native(ds_engine, self.trees, tag, prefix=tag + "/", **kwargs)
                    return
                self.engine.emit("convert", step=step, path=self.loaded_path,
                                 message="data-parallel size changed: loading through DeepSpeed's universal checkpoint")
                self.engine.converting("through DeepSpeed's universal checkpoint")
                ds.restore_universal(ds_engine, os.path.join(str(self._local()), tag), tag,
                                     universal.work_dir(self.engine.config), self.engine.rank == 0,
                                     self.engine.world_size, **kwargs)
        return load

    def cleanup(self) -> None:
        self.engine.say_resumed()       # a resume whose load hooks the Trainer never called is still said
        if self.virtual_dir is not None:
            scratch.remove(os.path.dirname(self.virtual_dir))
            self.virtual_dir = None
        if self.local_dir is not None:
            scratch.remove(self.local_dir)
            self.local_dir = None
        self.trees = None


def _is_ds_scheduler(scheduler: Any) -> bool:
    return type(scheduler).__name__ == "DeepSpeedSchedulerWrapper"


def _storage_id(t: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """What makes two state-dict entries one tensor (tied weights: saved once, under the first name)."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None


def _tied(model: Any, missing: List[str], loaded: Dict[str, Any]) -> Set[str]:
    """The missing keys that are tied to a loaded one: the same tensor in the live model (found by storage,
    as the save dropped them, so that a PeftModel's prefixed names are covered too), or named so by the
    model (``_tied_weights_keys``)."""
    named = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    live = model.state_dict()
    present = {_storage_id(live[k]) for k in loaded if k in live} - {None}
    return {k for k in missing if k in named or (k in live and _storage_id(live[k]) in present)}


def _step_of(path: Optional[str]) -> Optional[int]:
    return NAMING.parse(os.path.basename(str(path).rstrip("/"))) if path else None
