"""Run under torchrun: examples/deepspeed/train.py's own loop with plain DeepSpeed checkpointing instead of
easyckpt: every EVERY steps ``engine.save_checkpoint(save_dir, client_state=...)`` (DeepSpeed writes
global_stepN/, ``latest`` and zero_to_fp32.py itself); nothing is loaded at the start.

    torchrun ... tests/deepspeed_native_save.py EVERY -- <train.py arguments>
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "deepspeed"))
import train  # noqa: E402


def main() -> int:
    every = int(sys.argv[1])
    argv = sys.argv[3:]
    save_dir = train.parse(argv).save_dir

    def save_checkpoint_if_needed(engine, client_state=None):
        if engine.global_steps % every == 0:
            engine.save_checkpoint(save_dir, client_state=client_state)

    train.eds = types.SimpleNamespace(
        initialize_easyckpt=lambda *a, **k: None, load_checkpoint=lambda engine: (None, None),
        save_checkpoint_if_needed=save_checkpoint_if_needed, finalize_easyckpt=lambda *a, **k: None)
    sys.argv = [sys.argv[0], *argv]
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
