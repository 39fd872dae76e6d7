"""After the engine's warm-up, serving never compiles a Triton kernel: requests of every length arrive
while others decode (mixed prefill + decode batches of changing sizes, speculative verification, the
bundled model as `LLM()` runs it, bf16 + QAT). A new kernel variant mid-serving costs seconds (the
stall this test was written for: a wave of requests waited 5.5 s behind compiles at concurrency 64).
Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu/test_no_late_compiles.py`."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint

pytestmark = pytest.mark.gpu


def serve_mixed(llm: LLM, steps: int, seed: int, shared: bool = False) -> int:
    """Staggered arrivals: 0-4 new requests before each step (prompts 1-700 tokens, 1-48 new tokens,
    greedy or sampled), stepped until all finish; returns the requests served. `shared`: half the
    prompts continue one of three 300-token prefixes (prefix-cache hits)."""
    rng, engine, n = random.Random(seed), llm.engine, 0
    vocab = llm.runner.model_config.vocab_size
    prefixes = [[rng.randrange(2, vocab) for _ in range(300)] for _ in range(3)]
    for step in range(steps):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            ids = [rng.randrange(2, vocab) for _ in range(rng.choice([1, 5, 17, 64, 130, rng.randrange(1, 700)]))]
            if shared and rng.random() < 0.5:
                ids = rng.choice(prefixes) + ids[:400]
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 48),
                                    ignore_eos=True, seed=n)
            engine.add_request(f"r{seed}-{n}", ids, params)
            n += 1
        if engine.has_unfinished_requests():
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return n


def serve_wave(llm: LLM, n: int, seed: int) -> int:
    """`n` requests at once (concurrency n: prompts 8-80 tokens, 4-40 new tokens, greedy or
    sampled), stepped until all finish: prefill steps of many prompts' chunks, then verify steps of
    k + 1 rows per sequence while the batch shrinks; returns the requests served."""
    rng, engine = random.Random(seed), llm.engine
    vocab = llm.runner.model_config.vocab_size
    for i in range(n):
        ids = [rng.randrange(2, vocab) for _ in range(rng.randrange(8, 81))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(4, 41),
                                ignore_eos=True, seed=i)
        engine.add_request(f"w{seed}-{i}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    return n


@pytest.mark.parametrize("simulate_qat,prefix_caching", [(True, False), (False, False), (True, True)])
def test_no_compiles_after_warmup(simulate_qat, prefix_caching, tmp_path):
    """Run in this order, the QAT-off engine is the second of the process: its start-up (memory profile,
    warm-up) compiles its own variants after the first engine armed the watch, as in
    benchmarks/backend_agreement.py --greedy; those compiles are start-up, not serving."""
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    # imported here, not at collection: importing triton before tests/kernels' conftest sets
    # TRITON_INTERPRET=1 would leave every kernel compiled-only in a CPU run
    from deepinfer_kernels.compile_watch import compile_watch
    watch = compile_watch()                   # installed before the engine compiles anything
    model = make_trained_checkpoint(tmp_path / "trained", ARTIFACT)    # the model LLM() runs
    before = watch.mark()
    llm = LLM(model=str(model), dtype="bfloat16", simulate_qat=simulate_qat, device="cuda", max_num_seqs=64,
              max_model_len=1024, enable_prefix_caching=prefix_caching)
    unexpected = [e for e in watch.since(before) if not e.expected]
    start = watch.mark()
    served = serve_mixed(llm, steps=300, seed=0, shared=prefix_caching)
    late = watch.since(start)
    if prefix_caching:
        assert llm.engine.scheduler.prefix.stats.hit_tokens > 0
    print(f"[gpu] QAT {simulate_qat}, prefix caching {prefix_caching}: {start - before} compiles at start-up "
          f"({len(unexpected)} outside it), "
          f"{served} requests after the warm-up; {len(late)} compiles")
    assert not unexpected, "Triton compiled outside the start-up:\n" + "\n".join(map(str, unexpected))
    assert not late, "Triton compiled after the warm-up:\n" + "\n".join(map(str, late))
    del llm
    torch.cuda.empty_cache()


@pytest.mark.parametrize("num_drafts,simulate_qat", [(3, True), (5, True), (5, False)])
def test_no_compiles_after_warmup_speculating_at_concurrency_64(num_drafts, simulate_qat, tmp_path):
    """MTP speculation, 64 requests at once (benchmarks/spec_replay.py --concurrency 64 compiled
    the MoE's 32-row tiles mid-serving: `_schedule_kernel` BM1/BM2 and the grouped GEMMs' BLOCK_M
    16 -> 32). The MoE picks its tiles by a step's tokens, and with a short max_model_len one
    sequence holds fewer of them than a step of many: here 128 tokens (one block), below the trained
    model's larger tile sets, which steps of 64 prompts' prefill chunks and 64 x (k + 1)-row verify
    steps reach. A fixed cache budget, as in the benchmark: no memory-profile forward of the whole
    token budget warms them up."""
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    from deepinfer_kernels.compile_watch import compile_watch  # after the conftest (see above)
    watch = compile_watch()
    model = make_trained_checkpoint(tmp_path / "trained", ARTIFACT)
    before = watch.mark()
    llm = LLM(model=str(model), dtype="bfloat16", simulate_qat=simulate_qat, device="cuda",
              max_num_seqs=64, max_model_len=128, num_speculative_tokens=num_drafts,
              kv_cache_memory_bytes=1 << 30)
    unexpected = [e for e in watch.since(before) if not e.expected]
    start = watch.mark()
    served = sum(serve_wave(llm, 64, seed) for seed in range(2))
    late = watch.since(start)
    assert llm.engine.spec_metrics is not None and llm.engine.spec_metrics.num_steps > 0
    print(f"[gpu] MTP-{num_drafts}, QAT {simulate_qat}, concurrency 64: {start - before} compiles "
          f"at start-up ({len(unexpected)} outside it), {served} requests after the warm-up; "
          f"{len(late)} compiles")
    assert not unexpected, ("Triton compiled outside the start-up:\n"
                            + "\n".join(map(str, unexpected)))
    assert not late, "Triton compiled after the warm-up:\n" + "\n".join(map(str, late))
    del llm
    torch.cuda.empty_cache()
