"""The import rules of .importlinter hold: the agent never imports torch, pickle or trainer-side code; formats
stay torch-free and shared; adapters never import the agent or the storage layer, nor each other; storage
never imports torch or either process's code. The contracts live in .importlinter; this runs them.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    try:
        import importlinter  # noqa: F401
    except ImportError:
        pytest.fail("import-linter is missing: install the test extra (pip install -e '.[test]'); "
                    "the import contracts are part of the test run")
    # lint-imports' own entry point, run by this interpreter so that it sees the same packages; --no-cache:
    # nothing written into the source tree
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                                 "sys.exit(lint_imports_command())",
           "--config", str(ROOT / ".importlinter"), "--no-cache"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "BROKEN" not in out, f"an import contract is broken:\n{out[-8000:]}"
