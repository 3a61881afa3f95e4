#!/usr/bin/env bash
# Set up a development environment from nothing: .venv with easyckpt (editable), its test tools and
# the frameworks. torch is pinned through constraints.txt to the CPU build: an unpinned torch pulls
# several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# EXTRAS=all,test,bench adds what benchmarks/bench_checkpoint.py needs for its chart
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[${EXTRAS:-all,test}]"
