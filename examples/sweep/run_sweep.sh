#!/usr/bin/env bash
# The whole prefill/decode sweep on one GPU (written for an H200; ~6-8 minutes): a 4-layer V4-Flash-width
# model with random weights in the checkpoint's formats (FP8 linears, FP4 routed experts: the roofline
# counts the bytes the checkpoint ships; the backend re-encodes the experts to FP8 unless --fp4-experts
# keeps them FP4), decode at batch 1..256 x context 1k..32k, prefill of 4k and 16k tokens,
# transformers' DeepseekV4ForCausalLM on the same weights where it fits, CUDA-graph decode when it captures.
# Writes benchmarks/results/sweep_<gpu>.json and .png (the PNG needs matplotlib). Extra flags go to
# benchmarks/sweep.py (e.g. --reps 10, --batches 1,4,16,64,256, --no-hf; --help lists them).
#   examples/sweep/run_sweep.sh [sweep.py flags]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-python}" benchmarks/sweep.py \
    --layers 4 \
    --expert-dtype fp4 \
    --batches 1,8,64,256 \
    --contexts 1k,4k,16k,32k \
    --prefill 4k,16k \
    --warmup 2 --reps 5 --max-shape-seconds 15 \
    --cuda-graph \
    --time-budget 420 \
    "$@"
