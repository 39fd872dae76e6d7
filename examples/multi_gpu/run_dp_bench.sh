#!/usr/bin/env bash
# Data-parallel serving on DP H200s: the full 43-layer V4-Flash-width model with random weights (FP8 linears,
# FP4 routed experts as the checkpoint ships them, kept FP4 by the server: --fp4-experts) served by
# `python -m deepinfer_core.serve` over DP data-parallel ranks with expert parallelism (rank r on GPU r);
# benchmarks/serve_bench.py measures output throughput (total and per GPU), TPOT and TTFT at concurrency
# 1, 64, 256, 512 with 8192-token prompts and 1024 output tokens, and records each rank's weight and
# state-cache bytes and device; benchmarks/dp_report.py prints the table (at DP=4 beside SGLang's published
# 4xH200 V4-Flash figures). Writes benchmarks/results/serve_bench_dp${DP}_h200.json (every figure) and
# dp_bench_dp${DP}_h200.json (the report).
#   examples/multi_gpu/run_dp_bench.sh 2               # 2x H200 (or DP=2 examples/multi_gpu/run_dp_bench.sh)
#   examples/multi_gpu/run_dp_bench.sh 4               # 4x H200
#   DRY_RUN=1 examples/multi_gpu/run_dp_bench.sh 4     # print the two commands, run nothing
# Every setting below can be changed from the environment (tests/benchmarks/test_dp_bench.py runs a 2-layer
# tiny model on CPU ranks so); arguments after DP go to serve_bench.py. Interrupted (Ctrl-C, SIGTERM), the
# JSON keeps every finished concurrency and the report is still written.
#
# GPU time, estimated from the one-GPU 4-layer sweep (benchmarks/results/sweep_NVIDIA_H200.json):
# * prefill ~9k tok/s per GPU at 43 layers (a 16k-token chunk of 4 layers: 165 ms); at concurrency C each
#   rank prefills C x 8192 / DP tokens. One round of C prompts (PROMPTS_PER_CONCURRENCY=1, not the default
#   4 x C: the JSON's workload_notes say so) is the least that keeps C requests in flight, and the prefill of
#   1+64+256+512 such prompts is 6.8M tokens: ~190 s per rank at DP=4, ~380 s at DP=2. That is the floor.
# * decode ~1024 steps per concurrency. With CUDA graphs ~15-40 ms a step (the sweep's 4-layer step is
#   1.5-9.5 ms at batch 1-256 with every expert FP8 on one GPU; a rank here holds 1/(2 DP) of those expert
#   bytes): ~2 min for the four. Eager (expert parallelism without graphs) it is launch-bound at ~115 ms a
#   step (the sweep's eager 4-layer step: 11-14 ms): ~8 min for the four.
# * warm-ups of WARMUP_INPUT_LEN=512-token prompts (the batch shapes, not a second 8k prefill): ~10 s;
#   start-up (random fill of ~45-80 GB per GPU, the engine's own warm-up): ~1-2 min.
# DP=4: ~7 min with decode graphs, ~12 min eager; DP=2: ~10 min with graphs, ~16 min eager. Over a
# per-command limit, split the concurrencies (CONCURRENCY=1,64,256 LABEL=dp2_h200_a, then CONCURRENCY=512
# LABEL=dp2_h200_b) and join them: python benchmarks/dp_report.py <both JSONs> --label dp2_h200.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "${1:-}" =~ ^[0-9]+$ ]]; then DP=$1; shift; fi
DP=${DP:-2}
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
LAYERS=${LAYERS:-43}
DUMMY_CONFIG=${DUMMY_CONFIG:-}              # default: the real V4-Flash config.json kept in tests/data
EXPERT_DTYPE=${EXPERT_DTYPE:-fp4}
INPUT_LEN=${INPUT_LEN:-8192}
OUTPUT_LEN=${OUTPUT_LEN:-1024}
CONCURRENCY=${CONCURRENCY:-1,64,256,512}
PROMPTS_PER_CONCURRENCY=${PROMPTS_PER_CONCURRENCY:-1}
WARMUP_INPUT_LEN=${WARMUP_INPUT_LEN:-512}
LABEL=${LABEL:-dp${DP}_h200}
OUT_DIR=${OUT_DIR:-benchmarks/results}
EXTRA_SERVE_ARGS=${EXTRA_SERVE_ARGS:-}      # more server flags, e.g. "--max-num-batched-tokens 16384"

# Each rank holds up to max(C) / DP requests (the front end places every request on the least-loaded
# rank); a request needs INPUT_LEN + OUTPUT_LEN positions (8192 + 1024: 77 MB of state at V4-Flash width,
# bf16 KV), and max-model-len gives one 128-position block more so no request runs at the limit. The state
# cache takes what the weights leave of gpu_memory_utilization (0.9): at DP=2 ~80 GB of weights per H200
# leave ~40 GB, enough for 256 such requests (~20 GB).
MAX_C=$(tr ',' '\n' <<< "$CONCURRENCY" | sort -n | tail -1)
MAX_NUM_SEQS=${MAX_NUM_SEQS:-$(( (MAX_C + DP - 1) / DP ))}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-$(( INPUT_LEN + OUTPUT_LEN + 128 ))}
if [[ "$DEVICE" == cuda* ]]; then DTYPE=${DTYPE:-bfloat16}; else DTYPE=${DTYPE:-float32}; fi
FP4_FLAG=""
if [[ "$EXPERT_DTYPE" == fp4 ]]; then
    if [[ "$DEVICE" == cuda* ]]; then
        FP4_FLAG="--fp4-experts"          # the nvidia MoE keeps them FP4 (without it: re-encoded to FP8)
    else
        echo "[run_dp_bench] DEVICE=$DEVICE: no --fp4-experts (only the nvidia backend keeps FP4 experts FP4)"
    fi
fi
# EP_CUDA_GRAPHS=1 (default on a GPU): decode steps replay CUDA graphs holding the fixed-size expert
# exchange (--enable-ep-cuda-graphs, not yet run on GPUs: run tests/parallel/test_dp_cuda.py first);
# EP_CUDA_GRAPHS=0 measures the eager path
GRAPH_FLAG=""
if [[ "$DEVICE" == cuda* && "${EP_CUDA_GRAPHS:-1}" == 1 ]]; then GRAPH_FLAG="--enable-ep-cuda-graphs"; fi
LAUNCH="--data-parallel-size $DP --enable-expert-parallel --device $DEVICE --dtype $DTYPE $GRAPH_FLAG"
LAUNCH+=" --max-model-len $MAX_MODEL_LEN --max-num-seqs $MAX_NUM_SEQS $FP4_FLAG $EXTRA_SERVE_ARGS"
read -r -a LAUNCH_WORDS <<< "$LAUNCH"
LAUNCH="${LAUNCH_WORDS[*]}"                 # single spaces (empty settings leave none)

BENCH_JSON="$OUT_DIR/serve_bench_${LABEL}.json"
BENCH=("$PYTHON" benchmarks/serve_bench.py --dummy-layers "$LAYERS" --expert-dtype "$EXPERT_DTYPE"
       --launch "$LAUNCH" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --concurrency "$CONCURRENCY"
       --prompts-per-concurrency "$PROMPTS_PER_CONCURRENCY" --warmup-input-len "$WARMUP_INPUT_LEN"
       --label "$LABEL" --out "$BENCH_JSON")
if [[ -n "$DUMMY_CONFIG" ]]; then BENCH+=(--dummy-config "$DUMMY_CONFIG"); fi
if [[ -n "${SERVER_LOG:-}" ]]; then BENCH+=(--server-log "$SERVER_LOG"); fi
BENCH+=("$@")
REPORT=("$PYTHON" benchmarks/dp_report.py "$BENCH_JSON" --label "$LABEL" --out "$OUT_DIR/dp_bench_${LABEL}.json")
COMPARE=${COMPARE:-$([[ "$DP" == 4 ]] && echo sglang-4xh200 || echo none)}
if [[ "$COMPARE" != none ]]; then REPORT+=(--compare "$COMPARE"); fi

if [[ -n "${DRY_RUN:-}" ]]; then
    for cmd in BENCH REPORT; do                  # one shell-quoted line each
        declare -n words=$cmd
        "$PYTHON" -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' "${words[@]}"
    done
    exit 0
fi
# Ctrl-C or a time limit's SIGTERM reaches the whole process group: serve_bench writes what it measured and
# stops the server; this shell (its trap runs once serve_bench has exited) then still writes the report.
trap 'echo "[run_dp_bench] interrupted; reporting what was measured"' INT TERM
status=0
"${BENCH[@]}" || status=$?
if [[ -f "$BENCH_JSON" ]]; then "${REPORT[@]}"; fi
exit $status
