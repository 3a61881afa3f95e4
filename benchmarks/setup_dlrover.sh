#!/usr/bin/env bash
# DLRover's environment for the head-to-head (benchmarks/bench_peer.py): a venv of its own, .venv-dlrover,
# with dlrover[k8s,torch] 0.6.1 from the package registry (its launcher's local master needs the k8s extra: grpcio, kubernetes) and the same pinned CPU torch as ours
# (constraints.txt), so that both run on the same torch. Kept apart from .venv: DLRover is a peer we
# measure against, not a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv-dlrover/bin/python ] || "$PYTHON" -m venv .venv-dlrover
# transformers and accelerate for the HF Trainer regime of bench_overhead.py (DLRover's flash checkpoint called from
# a Trainer callback), at the versions .venv has, so that both sides run the same Trainer
hf=("transformers>=5" "accelerate>=1")
if [ -x .venv/bin/python ]; then
    hf=($(.venv/bin/python -c 'import transformers as t, accelerate as a
print(f"transformers=={t.__version__}", f"accelerate=={a.__version__}")' 2>/dev/null \
        || echo "transformers>=5 accelerate>=1"))
fi
.venv-dlrover/bin/pip install --quiet --disable-pip-version-check -c constraints.txt "dlrover[k8s,torch]==0.6.1" numpy protobuf \
    "${hf[@]}"
