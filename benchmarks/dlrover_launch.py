"""``dlrover-run``, DLRover's own launcher, with one shim so that DLRover 0.6.1 starts under torch 2.13.

DLRover's launcher starts its local master through torch's ``SubprocessHandler`` with six arguments;
torch 2.13 added a seventh, ``numa_options``, without a default. The shim passes None (no NUMA binding,
which is what the six-argument call meant); an older torch without it (2.11, a GPU machine's) gets no shim.
Everything else is DLRover's own code, run as its users run it:

    <dlrover venv>/bin/python benchmarks/dlrover_launch.py --standalone --nproc_per_node=2 script.py ...
"""
import inspect
import sys

from dlrover.trainer.torch import elastic_run
from dlrover.trainer.torch.main import main


class _Handler(elastic_run.SubprocessHandler):   # type: ignore[misc, name-defined]
    def __init__(self, *args, numa_options=None):  # type: ignore[no-untyped-def]
        super().__init__(*args, numa_options=numa_options)


if "numa_options" in inspect.signature(elastic_run.SubprocessHandler.__init__).parameters:
    elastic_run.SubprocessHandler = _Handler

if __name__ == "__main__":
    sys.exit(main())
