#!/usr/bin/env bash
# The GPU checks of one lent device session, as one command (they must fit one call: at most 9 minutes on an
# H100/H200): the machine, the device-to-host copy probe (gpu_copy_probe.py), the overlapped copy as shipped and
# as fed until 2026-11-30, the overhead benchmark against torch DCP and DLRover on the same device, then
# the CUDA tests. Run from the repository root on the GPU machine; output under $OUT (or ./gpu-out).
#
#   bash benchmarks/dlrover_site.sh                     # here, once: packs .dlsite/dlsite.tgz (carry .dlsite)
#   DLROVER_SITE=.dlsite bash benchmarks/gpu_check.sh   # there
#
# DLROVER_SITE: a folder holding dlsite.tgz, the pure-Python packages DLRover's flash checkpoint needs beyond the
# machine's own, with DLRover's dist-info (its launcher reads its version there); without it DLRover is not
# compared. On 2026-11-30's H200 its launcher's local master did not answer: see docs/benchmarks.md.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi -L; nproc; "$py" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
timeout 60 "$py" benchmarks/gpu_copy_probe.py 2>&1 | tee "$out/copy_probe.txt"
# issue 50 item 7: the overlapped copy as shipped (each copy call made while its stream is idle), then as it was
# shipped until 2026-11-30 (two pieces in flight, fed at once)
for v in "" "--feed-at-once"; do
    echo "=== overlap/1 ${v:-as shipped}" | tee -a "$out/variants.txt"
    timeout 60 "$py" benchmarks/bench_gpu.py --gb 4 --steps 10 --rounds 1 --trace --modes overlap/1 $v 2>&1 \
        | grep -E 'GPU:|host time|overlap/1 ' | tee -a "$out/variants.txt"
done
dl=()
if [ -n "${DLROVER_SITE:-}" ]; then
    site=$(mktemp -d)
    tar xzf "$DLROVER_SITE/dlsite.tgz" -C "$site" && dl=(--dlrover "$site" --dlrover-timeout 120)
fi
timeout 300 "$py" benchmarks/bench_gpu.py --gb 4 --steps 15 --rounds 1 --trace --peers "${dl[@]}" \
    --out "$out/gpu.json" 2>&1 | tee "$out/bench.txt"
echo "bench_gpu: exit ${PIPESTATUS[0]}"
timeout 250 "$py" -m pytest -q -rs -n 3 --dist load -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -25 \
    | tee "$out/tests.txt"
