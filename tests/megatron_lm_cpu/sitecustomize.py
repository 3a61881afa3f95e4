"""CPU switches for running Megatron-LM's own training loop (pretrain_gpt.py) in tests.

Python imports ``sitecustomize`` at start-up from the first directory of sys.path that has one, so
every process started with this directory on PYTHONPATH runs this file: the torchrun workers and also
the children that Megatron's torch_dist checkpoint writer starts with multiprocessing "spawn" (they
must see the same CUDA -> CPU switches). It does nothing unless ``EASYCKPT_MEGATRON_CPU=1``.

With the variable set it installs, from ``mlm_cpu_switches.py`` next to this file, an import hook that
  * calls the project's ``examples/megatron/cpu_compat.py`` ``enable()`` (megatron-core on CPU) plus the
    ``torch.cuda`` stand-ins Megatron-LM's training code needs, as soon as megatron is imported, and
  * neutralises the GPU-only steps of megatron.training (fused kernel build, dataset helper build, JIT
    warm-up, the CUDA assertion in initialize_megatron) and the triton-only module it imports.
See ``mlm_cpu_switches.py`` for why each switch is there, and ``run_megatron_lm.sh`` for a launcher.
"""
import os
import sys

if os.environ.get("EASYCKPT_MEGATRON_CPU") == "1":
    _here = os.path.dirname(os.path.abspath(__file__))
    if _here not in sys.path:
        sys.path.append(_here)
    # cpu_compat.py lives in the project's examples/megatron (../../examples/megatron from here);
    # mlm_cpu_switches imports it from there once megatron.core is imported.
    _compat_dir = os.path.normpath(os.path.join(_here, "..", "..", "examples", "megatron"))
    if _compat_dir not in sys.path:
        sys.path.append(_compat_dir)

    import mlm_cpu_switches

    mlm_cpu_switches.install()
    del _here, _compat_dir
