"""Reference measurements for the checkpoint savers people use instead of easyckpt.

Every function here times one existing way of writing a training checkpoint,
so that a benchmark can put easyckpt's numbers next to them.  Each one is
self-contained: it builds what it needs, times ``repeats`` saves, deletes
every checkpoint it wrote, tears down whatever it started (process groups,
background processes, patches, environment variables) and drops its large
objects before returning, so that a driver can call them one after another
for states of several gigabytes in one process.

What is measured, and why that way
----------------------------------

``torch_save``
    The stall of a classic blocking save, i.e. what Megatron-LM's
    ``--ckpt-format torch`` costs the training loop: ``torch.save`` of the
    whole state followed by ``flush`` and ``os.fsync``.  The fsync belongs in
    the stall because a checkpoint that is still in the page cache is lost
    with the machine; without it the number would mostly measure a memory
    copy into the page cache.

``dcp_async_save``
    ``torch.distributed.checkpoint.async_save`` in the configuration that
    gives it the shortest stall on a CPU host: one ``DefaultStager`` kept for
    all saves (its shared-memory staging buffers are allocated on the first
    save and only refilled afterwards), synchronous staging, the dedicated
    checkpoint process (``AsyncCheckpointerType.PROCESS``) and a
    ``FileSystemWriter`` that fsyncs its files.  Two times per save:
    ``blocking`` (until ``async_save`` returns: the training stall, which here
    is the copy into the staging buffers) and ``total`` (until the returned
    future resolves: the checkpoint is durable).  Staging is synchronous on
    purpose: with ``use_async_staging=True`` the call returns sooner, but
    training still may not modify parameters until the staging future
    resolves, so the stall would only move and become harder to attribute.
    The first save spawns the checkpoint process and allocates the buffers;
    it is reported separately as a warm-up because a long run pays it once.

``hf_trainer_save``
    The Hugging Face ``Trainer``'s own checkpoint (``Trainer._save_checkpoint``:
    ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
    ``rng_state.pth``, ``trainer_state.json``) for a GPT-2 model whose
    parameters plus AdamW moments have about the requested size.  The Trainer
    does not fsync, so both the bare save (``save``) and the save followed by
    an fsync of everything written (``save_fsync``) are reported; only the
    latter is comparable with savers that guarantee durability.

``deepspeed_save``
    DeepSpeed's ``engine.save_checkpoint`` for a stack of linear layers
    trained with ZeRO (stage 1 by default) in fp32, again without and with
    fsync.  Note that ZeRO checkpoints hold an fp32 master copy of the
    parameters besides the module weights, so they are larger than
    ``state_bytes``; ``checkpoint_bytes`` reports what was actually written.

Sizes: ``state_bytes`` / ``nbytes`` always mean parameters plus the two Adam
moment buffers in fp32, i.e. 12 bytes per parameter, which is what
``make_state`` produces for the savers that take a ready-made state.

Times are wall-clock seconds from ``time.perf_counter``.  Each repeat starts
from an empty target and ends with the checkpoint deleted, so no repeat
benefits from, or is slowed down by, the files of the previous one.

Caveats for a caller:

* Start-up: importing ``transformers`` or ``deepspeed`` takes several
  seconds on first use, and the first DCP save spawns a Python process that
  imports torch (a few seconds, counted in the warm-up's ``total`` only).
* DCP's checkpoint process is started with the ``spawn`` method, so a
  script calling ``dcp_async_save`` must guard its entry point with
  ``if __name__ == "__main__":``.  That process logs each request at INFO
  level to the inherited stderr (lines starting with ``[0]``); torch offers
  no way to silence it from the parent.
* The ``Trainer`` reseeds the global ``random``/NumPy/torch generators
  (``TrainingArguments.seed``) when it is built.
* Peak memory is a multiple of the state: DCP keeps a staging copy in
  shared memory, the Trainer and DeepSpeed also hold gradients, and ZeRO
  keeps an fp32 master copy of the parameters.
"""

from __future__ import annotations

import contextlib
import gc
import getpass
import importlib
import math
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "dcp_async_save",
    "deepspeed_save",
    "fsync_tree",
    "hf_trainer_save",
    "make_state",
    "torch_save",
]

# Adam(W) keeps two fp32 moments per fp32 parameter: 4 + 4 + 4 bytes.
BYTES_PER_PARAM_WITH_ADAM = 12

_SHM_DIR = "/dev/shm"
# Files of this prefix belong to easyckpt (possibly another process running
# at the same time); cleanup code must never touch them.
_EASYCKPT_SHM_PREFIX = "easyckpt-"
# Name prefix of the segments created by DeepSpeed's CPU shared-memory
# all-reduce (see deepspeed/ops/csrc/cpu/comm/shm.cpp).
_DEEPSPEED_SHM_PREFIX = "deepspeed_"


# --------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------


def fsync_tree(path: str) -> None:
    """Flush every file and directory under ``path`` (and ``path``'s entry in
    its parent) to stable storage.

    Directories are synced as well as files because a file whose directory
    entry is not durable can vanish after a crash even though its data blocks
    were written.
    """
    if os.path.isfile(path):
        _fsync_fd_of(path, directory=False)
    else:
        # Bottom-up, so that a directory is synced after the entries in it.
        for root, _dirs, files in os.walk(path, topdown=False):
            for name in files:
                _fsync_fd_of(os.path.join(root, name), directory=False)
            _fsync_fd_of(root, directory=True)
    parent = os.path.dirname(os.path.abspath(path))
    _fsync_fd_of(parent, directory=True)


def _fsync_fd_of(path: str, *, directory: bool) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_state(nbytes: int) -> dict:
    """Return a synthetic training state of about ``nbytes`` bytes.

    The layout mimics ``{"model": model.state_dict(), "optimizer":
    adam.state_dict()}``: eight square fp32 weight matrices, and for each an
    ``exp_avg`` and ``exp_avg_sq`` of the same shape plus a scalar ``step``,
    i.e. 24 large tensors.  The values are random so that no saver can profit
    from runs of zeros (compression, sparse files).  A seeded generator makes
    the state identical from call to call.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    n_layers = 8
    side = max(1, round(math.sqrt(nbytes / (n_layers * BYTES_PER_PARAM_WITH_ADAM))))
    generator = torch.Generator().manual_seed(0)

    def random_matrix() -> torch.Tensor:
        return torch.randn(side, side, generator=generator, dtype=torch.float32)

    model = {f"layers.{i}.weight": random_matrix() for i in range(n_layers)}
    optimizer_state = {
        i: {
            "exp_avg": random_matrix(),
            "exp_avg_sq": random_matrix(),
            "step": torch.tensor(1.0, dtype=torch.float32),
        }
        for i in range(n_layers)
    }
    return {"model": model, "optimizer": {"state": optimizer_state}}


def _free_port() -> int:
    # Binding to port 0 lets the kernel pick an unused port.  It could in
    # principle be taken again before the caller binds it; that race is
    # acceptable for a single-host benchmark.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _patched_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then put back
    exactly what was there before (including absence)."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in previous.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


@contextlib.contextmanager
def _no_stray_inductor_cache_dir() -> Iterator[None]:
    """Undo torch's compile-cache side effect of importing the libraries.

    The first import of ``torch._inductor`` (which ``transformers.Trainer``
    and DeepSpeed pull in) creates ``$TMPDIR/torchinductor_<user>`` and
    exports ``TORCHINDUCTOR_CACHE_DIR`` even though nothing gets compiled.
    On exit the directory is removed if the block created it and it is
    still empty, and the variable is restored.  A directory that existed
    before or holds files is kept: it is a cache other processes may share.
    The path is worked out here rather than asked of torch, because asking
    (importing ``torch._inductor``) is what creates it.
    """
    variable = "TORCHINDUCTOR_CACHE_DIR"
    previous = os.environ.get(variable)
    path = previous or os.path.join(tempfile.gettempdir(), f"torchinductor_{_user_name()}")
    existed = os.path.exists(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = previous
        if not existed:
            with contextlib.suppress(OSError):  # not empty, or already gone
                os.rmdir(path)


def _user_name() -> str:
    # Same naming torch uses for its default cache directory.
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", name)


# --------------------------------------------------------------------------
# 1. Blocking torch.save
# --------------------------------------------------------------------------


def torch_save(state: dict, directory: str, repeats: int) -> list[float]:
    """Seconds per repeat for ``torch.save(state)`` + flush + ``os.fsync``.

    This is the stall of a classic synchronous checkpoint: training cannot go
    on until the state is serialized and on disk.  The file is deleted after
    every repeat.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "torch_save.pt")
    times: list[float] = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with open(path, "wb") as stream:
                torch.save(state, stream)
                stream.flush()
                os.fsync(stream.fileno())
            times.append(time.perf_counter() - start)
            _remove(path)
    finally:
        _remove(path)
        gc.collect()
    return times


# --------------------------------------------------------------------------
# 2. torch.distributed.checkpoint.async_save
# --------------------------------------------------------------------------


def dcp_async_save(state: dict, directory: str, repeats: int) -> list[dict]:
    """Stall and end-to-end time of ``dcp.async_save`` in process mode.

    Configuration (the fastest DCP offers on a CPU-only host):

    * one ``DefaultStager`` reused for all saves, with shared-memory staging
      buffers (``use_shared_memory=True``) so the checkpoint process reads
      the staged tensors without another copy; pinned memory and
      non-blocking copies need an accelerator and are off; staging is
      synchronous (see the module docstring for why);
    * ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``: the
      serialization and writes run in a separate daemon process, so they do
      not compete with training for the GIL;
    * ``FileSystemWriter(sync_files=True)``: data and metadata files are
      fsynced before the future resolves.

    Returns one dict per save with ``blocking`` (seconds until
    ``async_save`` returned) and ``total`` (seconds until the future's
    result was available).  The first element is the warm-up save
    (``"warmup": True``), which also spawns the checkpoint process and
    allocates the staging buffers; ``repeats`` measured saves follow.

    A single-rank gloo process group is created if none exists and destroyed
    at the end.  The checkpoint process is stopped at the end if this call
    started it (torch 2.13 has no public API for that, so the private
    module-level handle is used).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _async_process_executor as dcp_process
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncCheckpointerType,
        AsyncSaveResponse,
    )

    os.makedirs(directory, exist_ok=True)
    create_group = not dist.is_initialized()
    starts_process = dcp_process._CHECKPOINT_PROCESS is None

    env: dict[str, str] = {}
    # The checkpoint process rendezvouses at MASTER_ADDR (falling back to the
    # host name, which need not resolve in a sandbox).
    if "MASTER_ADDR" not in os.environ or create_group:
        env["MASTER_ADDR"] = "127.0.0.1"
    if create_group:
        env["MASTER_PORT"] = str(_free_port())

    results: list[dict] = []
    stager: Any = None
    group_created = False
    with _patched_env(env), _reap_multiprocessing_helpers():
        try:
            if create_group:
                dist.init_process_group(backend="gloo", rank=0, world_size=1)
                group_created = True
            stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=True,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )

            def timed_save(name: str) -> dict:
                target = os.path.join(directory, name)
                writer = dcp.FileSystemWriter(target, sync_files=True)
                try:
                    start = time.perf_counter()
                    returned = dcp.async_save(
                        state,
                        storage_writer=writer,
                        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                        async_stager=stager,
                    )
                    blocking = time.perf_counter() - start
                    upload = (
                        returned.upload_completion
                        if isinstance(returned, AsyncSaveResponse)
                        else returned
                    )
                    upload.result()
                    total = time.perf_counter() - start
                finally:
                    _remove(target)
                return {"blocking": blocking, "total": total}

            results.append({"warmup": True, **timed_save("dcp-warmup")})
            for i in range(repeats):
                results.append(timed_save(f"dcp-r{i}"))
        finally:
            if stager is not None:
                stager.close()
                stager = None  # also empties the cell timed_save closes over
            if starts_process:
                _stop_dcp_checkpoint_process()
            if group_created:
                dist.destroy_process_group()
            gc.collect()
    return results


@contextlib.contextmanager
def _reap_multiprocessing_helpers() -> Iterator[None]:
    """Undo the process-wide side effects of starting a ``spawn`` child.

    Spawning DCP's checkpoint process also starts, for the rest of the
    interpreter's life, multiprocessing's resource-tracker process, and
    sending it shared-memory tensors starts the resource-sharer thread with
    a Unix socket in a ``pymp-*`` temporary directory.  Whatever of these
    did not exist on entry is stopped and removed on exit, so the caller is
    left with no extra child process and no file outside its directory.
    Anything that already existed is left alone: it belongs to the caller.
    """
    import multiprocessing.process as mp_process
    import multiprocessing.resource_sharer as mp_sharer
    import multiprocessing.resource_tracker as mp_tracker
    import multiprocessing.util as mp_util

    tracker = mp_tracker._resource_tracker
    tracker_was_running = tracker._pid is not None
    sharer_was_running = mp_sharer._resource_sharer._address is not None
    tempdir_before = mp_process.current_process()._config.get("tempdir")
    try:
        yield
    finally:
        if not sharer_was_running:
            mp_sharer.stop(timeout=10)
        if not tracker_was_running and tracker._pid is not None:
            tracker._stop()
        tempdir = mp_process.current_process()._config.get("tempdir")
        if tempdir_before is None and tempdir is not None:
            # Run (and thereby unregister) the exit-time finalizer that
            # multiprocessing registered for this directory, rather than
            # deleting it behind multiprocessing's back.
            for finalizer in list(mp_util._finalizer_registry.values()):
                if (
                    getattr(finalizer, "_callback", None) is mp_util._remove_temp_dir
                    and tempdir in getattr(finalizer, "_args", ())
                ):
                    finalizer()


def _stop_dcp_checkpoint_process() -> None:
    """Terminate DCP's checkpoint daemon and forget it.

    DCP keeps the daemon in a module global and only stops it from the
    handle's ``__del__``, i.e. normally at interpreter exit.  Stopping it
    here frees its memory and its shared-memory mappings now, and clearing
    the global makes a later ``dcp_async_save`` start a fresh daemon bound to
    that call's process group.
    """
    from torch.distributed.checkpoint import _async_process_executor as dcp_process

    handle = dcp_process._CHECKPOINT_PROCESS
    if handle is None:
        return
    dcp_process._CHECKPOINT_PROCESS = None
    child = handle._save_process
    try:
        if child.is_alive():
            handle._send(dcp_process._CheckpointSaveProcessControlOpts.TERMINATE)
            child.join(timeout=30)
    except (BrokenPipeError, EOFError, OSError):
        pass  # The child is already gone; terminate/join below settles it.
    finally:
        if child.is_alive():
            child.terminate()
            child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()
        handle._process_pipe.close()


# --------------------------------------------------------------------------
# 3. Hugging Face Trainer
# --------------------------------------------------------------------------


def _gpt2_width(nbytes: int, n_layer: int, vocab_size: int, n_positions: int) -> int:
    """Pick ``n_embd`` so that GPT-2's parameters with Adam moments are about
    ``nbytes``.

    Per block GPT-2 has 12*E^2 + 13*E parameters (attention 4*E^2, MLP
    8*E^2, biases and two layer norms); embeddings add (V + P)*E and the
    final layer norm 2*E (the LM head is tied to the token embedding).  The
    width is rounded to a multiple of the 32-wide attention heads.
    """
    target = nbytes / BYTES_PER_PARAM_WITH_ADAM
    a = 12 * n_layer
    b = vocab_size + n_positions + 13 * n_layer + 2
    width = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    return max(32, 32 * round(width / 32))


def hf_trainer_save(nbytes: int, directory: str, repeats: int) -> dict:
    """Time the Hugging Face ``Trainer``'s own checkpoint save.

    A GPT-2 model (4 layers, 1024-token vocabulary, width scaled to hit
    ``nbytes`` of parameters + AdamW moments) is trained for one step on CPU
    so that the optimizer state exists, then ``Trainer._save_checkpoint`` is
    timed ``repeats`` times.  Each run reports ``save`` (the call alone) and
    ``save_fsync`` (the call plus fsync of every file and directory it
    wrote, from the same start).  Each ``checkpoint-N`` directory is deleted
    after its run.

    Returns ``{"state_bytes": 12 * parameters, "checkpoint_bytes": size of
    one checkpoint on disk, "runs": [{"save": s, "save_fsync": s}, ...]}``.
    """
    with _patched_env({"HF_HUB_OFFLINE": "1"}), _no_stray_inductor_cache_dir():
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        from transformers.utils import logging as hf_logging

        os.makedirs(directory, exist_ok=True)
        n_layer, vocab_size, n_positions, seq_len = 4, 1024, 64, 8
        width = _gpt2_width(nbytes, n_layer, vocab_size, n_positions)
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=n_positions,
            n_embd=width,
            n_layer=n_layer,
            n_head=width // 32,
            # GPT-2's default special-token ids lie outside a small vocabulary.
            bos_token_id=vocab_size - 1,
            eos_token_id=vocab_size - 1,
        )
        model: Any = GPT2LMHeadModel(config)
        state_bytes = BYTES_PER_PARAM_WITH_ADAM * sum(p.numel() for p in model.parameters())

        generator = torch.Generator().manual_seed(0)
        dataset = []
        for _ in range(4):
            ids = torch.randint(0, vocab_size, (seq_len,), generator=generator).tolist()
            dataset.append({"input_ids": ids, "labels": ids})

        args = TrainingArguments(
            output_dir=directory,
            use_cpu=True,
            per_device_train_batch_size=1,
            max_steps=1,
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            # ``optim`` keeps its default (fused AdamW on recent torch): that
            # is what Trainer users get, and its state is AdamW's.
        )
        trainer: Any = Trainer(model=model, args=args, train_dataset=dataset)
        runs: list[dict] = []
        checkpoint_bytes = 0
        checkpoint_dir = ""
        progress_bars_were_on = hf_logging.is_progress_bar_enabled()
        # save_pretrained draws a progress bar per save; keep the benchmark's
        # output readable (drawing it costs microseconds, not the timing).
        hf_logging.disable_progress_bar()
        try:
            trainer.train()
            checkpoint_dir = os.path.join(
                directory, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
            )
            for _ in range(repeats):
                start = time.perf_counter()
                trainer._save_checkpoint(trainer.model, trial=None)
                saved = time.perf_counter() - start
                fsync_tree(checkpoint_dir)
                durable = time.perf_counter() - start
                runs.append({"save": saved, "save_fsync": durable})
                checkpoint_bytes = _tree_bytes(checkpoint_dir)
                _remove(checkpoint_dir)
        finally:
            if progress_bars_were_on:
                hf_logging.enable_progress_bar()
            if checkpoint_dir:
                _remove(checkpoint_dir)
            # The Trainer holds the model, optimizer and scheduler; drop all
            # of them before collecting.
            del trainer, model
            gc.collect()
    return {"state_bytes": state_bytes, "checkpoint_bytes": checkpoint_bytes, "runs": runs}


# --------------------------------------------------------------------------
# 4. DeepSpeed
# --------------------------------------------------------------------------


def _linear_width(nbytes: int, n_layers: int) -> int:
    """Width ``h`` of ``n_layers`` Linear(h, h) layers (h*h + h parameters
    each) whose parameters with Adam moments total about ``nbytes``."""
    per_layer = nbytes / (BYTES_PER_PARAM_WITH_ADAM * n_layers)
    return max(1, round((-1 + math.sqrt(1 + 4 * per_layer)) / 2))


def deepspeed_save(nbytes: int, directory: str, repeats: int, stage: int = 1) -> dict:
    """Time DeepSpeed's ``engine.save_checkpoint`` in a single CPU process.

    The model is eight ``nn.Linear(h, h)`` layers sized so that parameters
    plus AdamW moments are about ``nbytes``; it is wrapped by
    ``deepspeed.initialize`` with ``{"train_batch_size": 1,
    "zero_optimization": {"stage": stage}}`` in fp32, using
    ``torch.optim.AdamW`` (DeepSpeed's own Adam would first compile a C++
    extension).  One training step creates the optimizer state, then each
    run times ``save_checkpoint(dir, tag=f"r{i}")`` (``save``) and the same
    plus fsync of everything written (``save_fsync``); the checkpoint is
    deleted after each run.

    DeepSpeed's CPU communication backend would build a shared-memory
    all-reduce extension on initialization (about half a minute, and it
    leaves segments in /dev/shm); a single rank never uses it, so its
    builder is replaced by a stub for the duration of the call.  Any
    DeepSpeed shared-memory segment that still appears is removed at the
    end; other new /dev/shm entries are reported with a warning but left
    alone, since they may belong to other processes.

    Returns ``{"state_bytes": 12 * parameters, "checkpoint_bytes": size of
    one checkpoint on disk, "runs": [{"save": s, "save_fsync": s}, ...]}``.
    """
    import torch.distributed as dist

    os.makedirs(directory, exist_ok=True)
    n_layers = 8
    width = _linear_width(nbytes, n_layers)
    save_root = os.path.join(directory, "deepspeed_ckpt")
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    shm_before = _list_shm()
    create_group = not dist.is_initialized()
    runs: list[dict] = []
    checkpoint_bytes = 0
    state_bytes = 0

    with _patched_env(env), _no_stray_inductor_cache_dir():
        import deepspeed
        import deepspeed.comm as ds_comm

        # ``import deepspeed.comm.torch as m`` would bind the ``torch`` name
        # that deepspeed.comm re-exports, not the submodule.
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
        original_build_shm_op = ds_comm_torch.build_shm_op
        ds_comm_torch.build_shm_op = _no_shm_op
        engine: Any = None
        model: Any = None
        optimizer: Any = None
        group_created = False
        try:
            model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(n_layers)))
            state_bytes = BYTES_PER_PARAM_WITH_ADAM * sum(p.numel() for p in model.parameters())
            optimizer = torch.optim.AdamW(model.parameters())
            config = {"train_batch_size": 1, "zero_optimization": {"stage": stage}}
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            group_created = create_group and dist.is_initialized()

            loss = engine(torch.randn(1, width)).square().mean()
            engine.backward(loss)
            engine.step()
            del loss

            for i in range(repeats):
                start = time.perf_counter()
                engine.save_checkpoint(save_root, tag=f"r{i}")
                saved = time.perf_counter() - start
                fsync_tree(save_root)
                durable = time.perf_counter() - start
                runs.append({"save": saved, "save_fsync": durable})
                checkpoint_bytes = _tree_bytes(save_root)
                _remove(save_root)
        finally:
            _remove(save_root)
            if engine is not None:
                engine.destroy()
            del engine, optimizer, model
            gc.collect()
            if group_created:
                # Through DeepSpeed rather than torch, so that DeepSpeed also
                # drops its references to the destroyed groups and a later
                # call can initialize afresh.
                ds_comm.destroy_process_group()
            ds_comm_torch.build_shm_op = original_build_shm_op
            _clean_new_shm(shm_before)
    return {"state_bytes": state_bytes, "checkpoint_bytes": checkpoint_bytes, "runs": runs}


def _no_shm_op() -> None:
    """Stand-in for ``deepspeed.comm.torch.build_shm_op``: no shared-memory
    all-reduce, so DeepSpeed falls back to plain gloo collectives."""
    return None


def _list_shm() -> set[str]:
    try:
        return set(os.listdir(_SHM_DIR))
    except FileNotFoundError:
        return set()


def _clean_new_shm(before: set[str]) -> None:
    """Remove DeepSpeed segments that appeared since ``before``; warn about
    other new entries instead of deleting what may be someone else's."""
    foreign: list[str] = []
    for name in sorted(_list_shm() - before):
        if name.startswith(_EASYCKPT_SHM_PREFIX):
            continue
        if name.startswith(_DEEPSPEED_SHM_PREFIX):
            _remove(os.path.join(_SHM_DIR, name))
        else:
            foreign.append(name)
    if foreign:
        warnings.warn(
            f"new entries in {_SHM_DIR} not removed (not DeepSpeed's): {foreign}",
            RuntimeWarning,
            stacklevel=3,
        )
