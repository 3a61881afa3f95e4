"""``import easyckpt.megatron.hook`` — one line at the top of Megatron-LM's pretrain_gpt.py.

What it replaces (in both ``megatron.training.training`` and ``megatron.training.checkpointing``, since
training.py imports the names at import time):

- ``load_checkpoint``            → ``easyckpt.megatron.load_checkpoint``: the newest complete state from
                                   memory or ``--save``, Megatron's own checkpoints there included, in
                                   either layout, ``torch`` or ``torch_dist`` (adopted: engine/load/adopt.py);
                                   when easyckpt finds nothing and ``--load`` names another directory,
                                   Megatron's own loader reads that one (fine-tuning from a native
                                   checkpoint keeps working), and likewise when easyckpt resumed nothing and
                                   the iteration Megatron's tracker names in ``--load`` is Megatron's own in a
                                   distributed-checkpoint format without an easyckpt manifest (no mp_rank_*
                                   files: torch_dcp, say), as Megatron alone would have (with Megatron's
                                   checks, not easyckpt's safe loader); the console says so.
- ``checkpoint_and_decide_exit`` → first ``save_checkpoint_if_needed`` (a memory snapshot every
                                   ``EASYCKPT_SAVE_MEM_INTERVAL`` iterations, default 1, persisted every
                                   ``--save-interval``), then Megatron's own function (exit signal,
                                   ``--exit-interval``, ``--exit-duration-in-mins``).
- ``save_checkpoint``            → no blocking write: the iteration is snapshotted (if it is not already)
                                   and handed to the agent; at process exit the newest state is committed
                                   before the process ends (atexit), so the saves Megatron makes before it
                                   exits (SIGTERM with ``--exit-signal-handler``, end of training) are durable.

Settings: ``--save`` (the checkpoint directory, also where easyckpt loads from), ``--save-interval``
(storage interval), and the environment: EASYCKPT_SAVE_MEM_INTERVAL (1), EASYCKPT_MAX_CKPT_NUM (5),
EASYCKPT_LOG_FILE (SAVE_DIR/easyckpt.log; 0 turns it off), EASYCKPT_GRACE_DEADLINE (300 s), EASYCKPT_EXIT_AFTER_ONDEMAND_CHECKPOINT
(default: on with ``--exit-signal-handler``). SIGTERM is handled by easyckpt whether or not Megatron's
own handler is on (it is chained): the ranks agree on a step, save it, and exit or train on. Checkpoints
use the layout ``--ckpt-format`` names: ``torch_dist`` (Megatron's default; a resume on another TP/PP/DP
layout reads it, and so does Megatron's own loader) or ``torch``; rank 0 says which. The formats easyckpt
does not write (torch_dcp, fsdp_dtensor) are refused at the start with a ``ConfigError`` naming the two it does.
"""
from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType
from typing import Any, Callable, Optional, Tuple, Type


def _import_problem(exc: ImportError) -> str:
    """What to say when Megatron-LM's training loop does not import: the module that is really missing
    (megatron.training itself, or one of its own imports, such as triton)."""
    missing = exc.name or str(exc)
    if missing == "megatron" or missing.startswith("megatron.training"):
        return ("easyckpt.megatron.hook patches Megatron-LM's training loop (megatron.training), which cannot be "
                f"imported here ({exc}): it comes with a Megatron-LM checkout (PYTHONPATH=<Megatron-LM>) and with "
                "the megatron-core wheels that ship it (0.19 does); or use easyckpt.megatron's functions directly in your own loop")
    return (f"easyckpt.megatron.hook patches Megatron-LM's training loop (megatron.training), and importing it "
            f"failed: {exc}. Install {missing!r}, which Megatron-LM needs (not easyckpt)")


try:
    from megatron.training import checkpointing as _ckpt
    from megatron.training import training as _training
    from megatron.training.global_vars import get_args
except ImportError as exc:
    raise ImportError(_import_problem(exc)) from exc

from easyckpt import console
from easyckpt import megatron as _em
from easyckpt.megatron import logs as _logs

_orig_load = _ckpt.load_checkpoint
_orig_save = _ckpt.save_checkpoint
_orig_decide = _training.checkpoint_and_decide_exit
_state = {"initialized": False}


def _ensure_initialized() -> bool:
    if _state["initialized"]:
        return True
    args = get_args()
    if not args.save:
        return False
    mem = int(os.environ.get("EASYCKPT_SAVE_MEM_INTERVAL", "1"))
    storage = args.save_interval or mem
    if storage % mem:
        storage = (storage // mem + 1) * mem
    max_num = os.environ.get("EASYCKPT_MAX_CKPT_NUM", "5")
    # Megatron's --exit-signal-handler asks to exit after a SIGTERM save: easyckpt's own SIGTERM
    # checkpoint then exits too (EASYCKPT_EXIT_AFTER_ONDEMAND_CHECKPOINT=0|1 overrides)
    exit_env = os.environ.get("EASYCKPT_EXIT_AFTER_ONDEMAND_CHECKPOINT")
    exit_after = bool(getattr(args, "exit_signal_handler", False)) if exit_env is None else exit_env == "1"
    log = os.environ.get("EASYCKPT_LOG_FILE") or None
    # torch_dcp and fsdp_dtensor are refused at the start (initialize_easyckpt's ConfigError names the
    # layouts easyckpt writes): writing another layout than asked would leave checkpoints that Megatron's
    # own loader, run with the same flags, cannot read
    fmt = getattr(args, "ckpt_format", "torch_dist")
    _em.initialize_easyckpt(mem, storage, None if max_num in ("", "0", "none") else int(max_num),
                            False if log == "0" else log, save_dir=args.save, args=args,
                            exit_after_ondemand_checkpoint=exit_after, ckpt_format=fmt,
                            grace_deadline=float(os.environ.get("EASYCKPT_GRACE_DEADLINE", "300")))
    _state["initialized"] = True
    atexit.register(_finalize_at_exit)
    if _rank() == 0:   # never silently: the layout in --save is what the user's other tools will read
        console.info(f"checkpoints in {args.save} use Megatron's {fmt} layout (--ckpt-format {fmt})")
    return True


def _finalize_at_exit() -> None:
    # after an uncaught exception the other ranks are being torn down: waiting here for a commit that
    # needs their shards would only stall; the agent persists the newest snapshot once all are gone
    if _state["initialized"] and not _state.get("crashed"):
        _state["initialized"] = False
        _em.finalize_easyckpt()


ExceptHook = Callable[[Type[BaseException], BaseException, Optional[TracebackType]], Any]


def _note_crash(excepthook: ExceptHook) -> ExceptHook:
    def hook(*exc_info: Any) -> None:
        _state["crashed"] = True
        excepthook(*exc_info)
    return hook


sys.excepthook = _note_crash(sys.excepthook)


def load_checkpoint(model: _em.Model, optimizer: _em.Optimizer, opt_param_scheduler: _em.Scheduler,
                    load_arg: str = "load", strict: bool = True, **kwargs: Any) -> Tuple[int, float]:
    args = get_args()
    if not _ensure_initialized():
        return _orig_load(model, optimizer, opt_param_scheduler, load_arg=load_arg, strict=strict, **kwargs)
    other = getattr(args, load_arg, None)
    # --load in another directory: when this job has nothing in --save, Megatron's own loader reads it (said so,
    # not "training starts from the beginning")
    elsewhere = other if other and os.path.realpath(other) != os.path.realpath(args.save) else None
    # concat: a run resumed on other parallel sizes reshards (Megatron-LM's torch_dist loader does too)
    iteration, flops = _em.load_checkpoint(
        model, optimizer, opt_param_scheduler, load_arg=load_arg, strict=strict, concat=True,
        elsewhere=f"Megatron's own loader resumes from --{load_arg} {other}, if it holds a checkpoint"
        if elsewhere else None)
    if iteration == 0 and other and (elsewhere or _megatron_only(other)):
        return _orig_load(model, optimizer, opt_param_scheduler, load_arg=load_arg, strict=strict, **kwargs)
    return iteration, flops


def _megatron_only(load_dir: str) -> bool:
    """Whether the iteration Megatron's tracker names in ``load_dir`` is Megatron's own checkpoint in a
    format only Megatron reads (engine/load/foreign.py); the console says so."""
    from easyckpt.engine.load.foreign import megatron_only_step
    from easyckpt.megatron.state import NAMING
    step_dir = megatron_only_step(load_dir, NAMING)
    if step_dir is None:
        return False
    if _rank() == 0:
        console.info(f"{os.path.basename(step_dir)} is Megatron's own checkpoint in a format easyckpt does not "
                     f"read ({getattr(get_args(), 'ckpt_format', 'torch_dist')}): Megatron's own loader resumes "
                     f"from it")
    return True


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(iteration: int, model: _em.Model, optimizer: _em.Optimizer, opt_param_scheduler: _em.Scheduler,
                    num_floating_point_operations_so_far: float, *args: Any, **kwargs: Any) -> None:
    if not _ensure_initialized():
        return _orig_save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                          *args, **kwargs)
    _em.save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far)


def checkpoint_and_decide_exit(model: _em.Model, optimizer: _em.Optimizer, opt_param_scheduler: _em.Scheduler,
                               iteration: int,
                               num_floating_point_operations_so_far: float, *args: Any, **kwargs: Any) -> bool:
    if _ensure_initialized():
        _em.save_checkpoint_if_needed(iteration, model, optimizer, opt_param_scheduler,
                                      num_floating_point_operations_so_far)
        # beside Megatron's own scalars, in its TensorBoard / W&B writers (logs.py)
        _logs.write_if_due(iteration, _em.checkpoint_metrics)
    return _orig_decide(model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far,
                        *args, **kwargs)


for _module in (_ckpt, _training):
    for _name, _fn in (("load_checkpoint", load_checkpoint), ("save_checkpoint", save_checkpoint)):
        if hasattr(_module, _name):
            setattr(_module, _name, _fn)
_training.checkpoint_and_decide_exit = checkpoint_and_decide_exit
