"""torchrun whose workers are forked from the launcher (torchrun's own ``--run-path --start-method fork``)
after it imported what the training script imports anyway: a worker then starts without importing torch
(about 1.4 CPU-seconds here), the Trainer (4.7) or megatron-core again. The default tier starts about 300
torchrun workers; with this launcher it took about 1570 CPU-seconds instead of 1930 on a 2-core machine.

    python tests/warm_torchrun.py [--preload=MODULE,...] TORCHRUN_OPTIONS... SCRIPT.py SCRIPT_ARGS...

tests/forked_worker.py runs SCRIPT in each worker, started as an exec'd worker is (signal dispositions,
no parent-death signal, its own exit handlers run at its end). harness.script_cmd and harness.train_cmd
use this launcher; the tests whose subject is the process model (SIGTERM to the process tree, a killed
launcher, DataLoader workers, the user's own command line, several nodes) launch torchrun as users do.
harness.run and harness.start fork the launcher itself from a server that imported torch and the third-party
PRELOADs once (tests/zygote.py): then the ``--preload`` imports here cost only easyckpt's own modules.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from typing import List

WORKER = Path(__file__).resolve().with_name("forked_worker.py")


def main(argv: List[str]) -> None:
    preload: List[str] = []
    while argv and argv[0].startswith("--preload="):
        preload += [m for m in argv.pop(0).split("=", 1)[1].split(",") if m]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # import-time warnings the script filters before its own imports
        for name in preload:
            importlib.import_module(name)
    from torch.distributed.run import main as torchrun
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))    # torchrun's options come before it
    torchrun([*argv[:script], "--run-path", "--start-method", "fork", str(WORKER),
              str(Path(argv[script]).resolve()), *argv[script + 1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
