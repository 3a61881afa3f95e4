"""DeepSpeed's universal-checkpoint converter, run on listed and verified files only (universal.py runs it
when a job resumes on another data-parallel size).

DeepSpeed's universal-checkpoint converter (``ds_to_universal``, run when a job resumes on another
data-parallel size) gets the same treatment, in ``to_universal``: it globs its input folder and
``torch.load(weights_only=False)``s whatever it finds, so it never sees the step directory. The listed
DeepSpeed files, each read through the manifest (inside the step, size and checksum verified), are staged
into a folder of their own; the converter runs in a subprocess of ours whose DeepSpeed checkpoint modules
see a ``torch`` whose ``load`` is ``safe_torch_load``. An unlisted file is never staged (so never read);
a listed one that is not plain data is refused, and nothing is converted.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, List

import torch

from easyckpt.engine.shards.safeload import safe_torch_load
from easyckpt.errors import CheckpointError
from easyckpt.formats.layout import DS_MODEL_STATES, DS_OPTIM_STATES
from easyckpt.storage import stepfiles
from easyckpt.storage.posix import PosixStorage
from easyckpt.storage.stepfiles import damaged_message


def to_universal(step_dir: str, tag: str, work_dir: str, timeout: float = 3600, prefix: str = "") -> str:
    """Convert the DeepSpeed files of committed step ``step_dir`` (those its manifest lists directly under
    ``prefix``: the top level for the plain engine's ``global_stepN/``, ``global_stepN/`` inside the
    Trainer's ``checkpoint-N/``) into a universal checkpoint ``work_dir/tag``; returns that folder.
    ValueError naming the file when one is damaged or not plain data; nothing of the step directory is read
    but its listed files."""
    try:
        man = stepfiles.load(step_dir)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{step_dir}: no valid manifest ({exc})") from None
    staged = os.path.join(work_dir, "input", tag)
    storage = PosixStorage()
    storage.makedirs(staged)
    for rel in sorted(man.files):
        name = rel[len(prefix):]
        if not rel.startswith(prefix) or "/" in name or not (DS_MODEL_STATES.match(name) or DS_OPTIM_STATES.match(name)):
            continue                        # easyckpt's own files (RNG, derived outputs) are no input of it
        try:
            data = stepfiles.read_verified(step_dir, rel, man)
        except OSError as exc:
            raise CheckpointError(damaged_message(step_dir, [f"{rel}: unreadable ({exc})"])) from exc
        except ValueError as exc:
            raise CheckpointError(damaged_message(step_dir, [str(exc)])) from exc
        with storage.open_writer(os.path.join(staged, name), direct=False) as out:
            out.write(data)
            out.finish()
    output = os.path.join(work_dir, tag)
    cmd = [sys.executable, "-m", "easyckpt.deepspeed.convert", "ds-to-universal", "--input_folder", staged,
           "--output_folder", output, "--num_extract_workers", "1", "--num_merge_workers", "1",
           "--inject_missing_state"]
    import subprocess
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ValueError(f"DeepSpeed's universal-checkpoint converter failed on the listed files of {step_dir}: "
                         f"{done.stderr[-2000:]}")
    return output


class _SafeTorchFiles:
    """``torch`` as DeepSpeed's checkpoint modules see it inside the converter subprocess: ``load`` reads
    the file and unpickles it with safe_torch_load (weights_only and the allow-list)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(f, "read"):
            data = f.read()
        else:
            with open(os.fspath(f), "rb") as fh:
                data = fh.read()
        try:
            return safe_torch_load(data)
        except ValueError as exc:
            raise ValueError(f"{getattr(f, 'name', f)}: {exc}") from exc


def _ds_to_universal_main(argv: List[str]) -> int:
    """The converter's ``main`` with every ``torch`` global of DeepSpeed's checkpoint modules swapped for
    _SafeTorchFiles; its worker processes are forked, so they inherit the swap."""
    import multiprocessing
    with contextlib.redirect_stdout(sys.stderr):
        # imported lazily or indirectly by main(): imported now, so that their ``torch`` is swapped too
        from deepspeed.checkpoint import (  # noqa: F401
            autoep_universal,
            deepspeed_checkpoint,
            ds_to_universal,
            reshape_3d_utils,
            universal_checkpoint,
            zero_checkpoint,
        )
    multiprocessing.set_start_method("fork", force=True)
    shim = _SafeTorchFiles()
    for name, module in list(sys.modules.items()):
        if name.startswith("deepspeed.checkpoint") and getattr(module, "torch", None) is torch:
            module.torch = shim  # type: ignore[attr-defined]  # patching deepspeed's modules
    ds_to_universal.main(_parse(ds_to_universal, argv))
    return 0


def _parse(ds_to_universal: Any, argv: List[str]) -> Any:
    saved = sys.argv
    sys.argv = ["ds_to_universal", *argv]
    try:
        return ds_to_universal.parse_arguments()
    finally:
        sys.argv = saved


__all__ = ["to_universal"]


if __name__ == "__main__":
    if sys.argv[1:2] != ["ds-to-universal"]:
        sys.exit("usage: python -m easyckpt.deepspeed.convert ds-to-universal --input_folder ... --output_folder ...")
    sys.exit(_ds_to_universal_main(sys.argv[2:]))
