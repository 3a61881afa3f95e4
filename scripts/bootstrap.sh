#!/usr/bin/env bash
# Set up a development environment from nothing: .venv with easyckpt (editable), its test tools and
# the frameworks. torch is pinned through constraints.txt to the CPU build: an unpinned torch pulls
# several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# VENV: where (default .venv). CI also builds .venv312 with PYTHON=python3.12 EXTRAS=megatron,test: the
# newest megatron-core (0.19) needs Python 3.12, for which the package index has only torch's CUDA wheels
# (several GB: pip's cache keeps them for the next run)
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# EXTRAS=all,test,bench adds what benchmarks/bench_checkpoint.py needs for its chart
"$VENV/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt -e ".[${EXTRAS:-all,test}]"
