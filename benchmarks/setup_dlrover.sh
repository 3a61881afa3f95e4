#!/usr/bin/env bash
# DLRover's environment for the head-to-head (benchmarks/bench_peer.py): a venv of its own, .venv-dlrover,
# with dlrover[k8s,torch] 0.6.1 from the package registry (its launcher's local master needs the k8s extra: grpcio, kubernetes) and the same pinned CPU torch as ours
# (constraints.txt), so that both run on the same torch. Kept apart from .venv: DLRover is a peer we
# measure against, not a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv-dlrover/bin/python ] || "$PYTHON" -m venv .venv-dlrover
.venv-dlrover/bin/pip install --quiet --disable-pip-version-check -c constraints.txt "dlrover[k8s,torch]==0.6.1" numpy protobuf
