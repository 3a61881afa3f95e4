#!/usr/bin/env bash
# Run Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1) on a CPU-only machine: 2 processes, gloo, a
# tiny GPT on mock data, checkpointing with --ckpt-format torch.
#
#   EASYCKPT_MEGATRON_LM=/path/to/Megatron-LM tests/megatron_lm_cpu/run_megatron_lm.sh [extra args...]
#
# Extra arguments are appended, so they override the defaults below (argparse keeps the last value):
#   --tensor-model-parallel-size 2, --use-distributed-optimizer, --train-iters N,
#   --save DIR --load DIR, --save-interval K, --ckpt-format torch_dist, ...
# Environment:
#   EASYCKPT_MEGATRON_LM   Megatron-LM source tree (required; never inside this project)
#   CKPT_DIR               default for --save/--load (default: /tmp/easyckpt-mlm-ckpt)
#   TORCHRUN               torchrun to use (default: the project's .venv/bin/torchrun, else torchrun on PATH)
#   MLM_SCRIPT             the training script (default: the tree's pretrain_gpt.py, which has no easyckpt;
#                          a copy with "import easyckpt.megatron.hook" as its first line runs the hooked loop)
#   NPROC                  processes (default 2)
#   NO_LOAD=1              leave --load out (a job that starts from scratch; it still saves to --save)
#   CKPT_FORMAT            --ckpt-format (default torch; "default" leaves the flag out: Megatron's torch_dist)
# The CPU switches come from sitecustomize.py in this directory (EASYCKPT_MEGATRON_CPU=1).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
project="$(cd "$here/../.." && pwd)"

: "${EASYCKPT_MEGATRON_LM:?set EASYCKPT_MEGATRON_LM to a Megatron-LM source tree (tag core_v0.16.1)}"
mlm="$(cd "$EASYCKPT_MEGATRON_LM" && pwd)"
if [[ ! -f "$mlm/pretrain_gpt.py" ]]; then
    echo "run_megatron_lm.sh: no pretrain_gpt.py in $mlm" >&2
    exit 2
fi

default_torchrun="$project/.venv/bin/torchrun"
[[ -x "$default_torchrun" ]] || default_torchrun="$(command -v torchrun || echo torchrun)"
torchrun="${TORCHRUN:-$default_torchrun}"
ckpt_dir="${CKPT_DIR:-/tmp/easyckpt-mlm-ckpt}"
nproc="${NPROC:-2}"

# This directory first: its sitecustomize.py installs the CPU switches in every Python process
# (torchrun workers and the torch_dist writer's spawned children). The Megatron-LM tree provides
# megatron.training (megatron.core then also comes from the tree: same release as the installed wheel).
export PYTHONPATH="$here:$mlm${PYTHONPATH:+:$PYTHONPATH}"
export EASYCKPT_MEGATRON_CPU=1
# One thread per rank on this 2-core box; also makes CPU reductions run in a fixed order.
export OMP_NUM_THREADS=1
# --deterministic-mode asserts that NCCL_ALGO names a deterministic algorithm; NCCL is not used (gloo).
export NCCL_ALGO="${NCCL_ALGO:-Ring}"
# megatron.training reads this for the distributed optimizer's sizes; harmless on CPU.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONUNBUFFERED=1

args=(
    # Model: 2-layer GPT, hidden 64, 4 heads, sequence 32, on mock data. NullTokenizer adds an EOD
    # token to --vocab-size: 127 + 1 = 128, padded to a multiple of 64 x TP = 128 for TP=1 and TP=2.
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4
    --seq-length 32 --max-position-embeddings 32
    --mock-data --tokenizer-type NullTokenizer --vocab-size 127 --make-vocab-size-divisible-by 64
    # Batches: 2 ranks x micro batch 2 x 2 micro-batches (TP=1) = global batch 8.
    --micro-batch-size 2 --global-batch-size 8
    # No Transformer Engine / Apex / CUDA kernels: local layers, every fusion off.
    --transformer-impl local
    --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
    --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
    --use-cpu-initialization
    --distributed-backend gloo
    # Reproducibility: no dropout (the "CUDA" and CPU RNG are one generator under the switches),
    # fixed seed, deterministic embedding backward, data loaded in the main process.
    --attention-dropout 0.0 --hidden-dropout 0.0
    --seed 1234 --deterministic-mode --num-workers 0
    # Optimizer and schedule.
    --lr 1e-3 --min-lr 1e-3 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0
    --train-iters 10
    # The scheduler's step counts derive from --train-iters (lr decay, weight-decay increments) and a
    # resume asserts that they match the checkpoint: take them from the checkpoint instead, so a
    # resumed launch may raise --train-iters (with a constant LR and no weight decay nothing changes).
    --use-checkpoint-opt_param-scheduler
    # Checkpoints.
    --save "$ckpt_dir" --save-interval 5
    # Logging; --eval-iters 0 skips validation and test.
    --log-interval 1 --eval-iters 0 --eval-interval 1000
)

fmt="${CKPT_FORMAT:-torch}"
if [[ "$fmt" != "default" ]]; then
    args+=(--ckpt-format "$fmt")
fi
if [[ -z "${NO_LOAD:-}" ]]; then
    args+=(--load "$ckpt_dir")
fi

exec "$torchrun" --standalone --nproc_per_node "$nproc" "${MLM_SCRIPT:-$mlm/pretrain_gpt.py}" "${args[@]}" "$@"
