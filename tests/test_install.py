"""`pip install` of the checkout: a real wheel, built by setup.py, installed into a brand-new venv.

What a user gets from `pip install /path/to/checkout` must be the whole package: every module, the
`easyckpt` console script, py.typed, one version. The wheel is built with this interpreter's setuptools and
installed without dependencies (offline and fast); the frameworks it imports (torch, transformers, ...)
are made visible afterwards through a .pth line naming this interpreter's site-packages, which comes after
the venv's own on sys.path, so every `easyckpt` module must resolve to the venv's copy. .ci/run installs
the checkout with its real dependencies into a fresh venv as well.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List

from harness import ROOT

import easyckpt

# the adapters and both processes' entry points: each imports its framework, so this also proves that the
# installed package finds its dependencies, not only its own files
IMPORTS = ["easyckpt", "easyckpt.cli", "easyckpt.agent", "easyckpt.pytorch", "easyckpt.transformers",
           "easyckpt.deepspeed", "easyckpt.megatron"]


def _run(cmd: List[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    # no PYTHONPATH: the test runner's points at the checkout, which would hide what was installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _package_files(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_pip_install_of_the_checkout_is_the_whole_package_with_its_script_types_and_version(tmp_path):
    # a copy of what setup.py packages: an in-tree build would leave build/ and *.egg-info in the checkout
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy2(ROOT / "setup.py", src)
    shutil.copytree(ROOT / "easyckpt", src / "easyckpt", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
          str(tmp_path / "dist"), str(src)], tmp_path, 120)
    wheels = list((tmp_path / "dist").glob("easyckpt-*.whl"))
    assert [w.name for w in wheels] == [f"easyckpt-{easyckpt.__version__}-py3-none-any.whl"], wheels

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, 60)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
          str(wheels[0])], tmp_path, 120)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path, 30).stdout.strip())
    assert site.is_relative_to(venv), site

    installed = site / "easyckpt"
    assert (installed / "py.typed").is_file(), "py.typed is not in the wheel: type checkers would ignore the package"
    assert _package_files(installed) == _package_files(ROOT / "easyckpt"), "the wheel lacks or adds modules"

    # the frameworks, from this interpreter's site-packages (after the venv's own on sys.path)
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_frameworks_from_the_test_interpreter.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))

    version = _run([str(venv / "bin" / "easyckpt"), "--version"], tmp_path, 60)
    assert version.stdout.strip() == f"easyckpt {easyckpt.__version__}", version.stdout + version.stderr
    where = _run([str(python), "-c", "import importlib, json, sys; "
                  "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))", *IMPORTS],
                 tmp_path, 180)
    files = json.loads(where.stdout.strip().splitlines()[-1])
    outside = {m: f for m, f in files.items() if not Path(f).is_relative_to(installed)}
    assert not outside, f"modules imported from outside the venv's install: {outside}"
    meta = _run([str(python), "-c", "import importlib.metadata as m, easyckpt; "
                 "print(m.version('easyckpt'), easyckpt.__version__)"], tmp_path, 60)
    assert meta.stdout.split() == [easyckpt.__version__] * 2, "the wheel's version is not easyckpt.__version__"
