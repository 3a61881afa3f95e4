#!/usr/bin/env bash
# Packs what DLRover's flash checkpoint needs beyond a GPU machine's own packages (torch, grpcio, psutil, numpy,
# protobuf are there) into .dlsite/dlsite.tgz, from .venv-dlrover (benchmarks/setup_dlrover.sh), for
# benchmarks/gpu_check.sh: its dist-info too, which DLRover's launcher reads its version from.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(echo .venv-dlrover/lib/python3*/site-packages)
mkdir -p .dlsite
grep -qx "/.dlsite/" "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo "/.dlsite/" >> "$(git rev-parse --git-dir)/info/exclude"
out=$PWD/.dlsite/dlsite.tgz
(cd "$site" && tar czf "$out" --exclude=__pycache__ dlrover dlrover-*.dist-info kubernetes durationpy deprecated \
    websocket requests_oauthlib oauthlib dateutil)
ls -l .dlsite/dlsite.tgz
