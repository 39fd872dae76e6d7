"""Continuous batching on the tiny model: batched greedy tokens equal one-at-a-time generation;
chunked prefill at several budgets equals unchunked; preemption under a small cache finishes every
request with the unconstrained outputs and returns the allocator to empty."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def prompts(n: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_ckpt_dir):
    return LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False)


def run(llm, ps, params=GREEDY, **opts) -> list[list[int]]:
    """Generate through `llm`, or through another LLM front end over its runner with `opts`."""
    if opts:
        llm = LLM.from_runner(llm.runner, tokenizer=llm.tokenizer, **opts)
    out = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    eng = llm.engine
    assert eng.scheduler.blocks.allocator.reclaim() and not eng.has_unfinished_requests()
    run.last = llm
    return [o.outputs[0].token_ids for o in out]


def test_batched_equals_one_at_a_time_for_32_mixed_prompts(llm):
    # lengths span several CSA blocks, the 16-token window and (140) an HCA block
    ps = prompts(32, [3, 17, 40, 9, 140, 25, 64, 1], seed=1)
    batched = run(llm, ps, max_num_seqs=32, max_num_batched_tokens=512)
    alone = [run(llm, [p], max_num_seqs=1)[0] for p in ps]
    assert batched == alone


@pytest.mark.parametrize("budget", [1, 3, 4, 7, 128])
def test_chunked_prefill_equals_unchunked(llm, budget):
    ps = prompts(3, [21, 9, 34], seed=2)
    assert run(llm, ps, max_num_batched_tokens=budget) == run(llm, ps, max_num_batched_tokens=8192)


def test_preemption_under_a_small_cache(llm):
    ps = prompts(6, [120, 100, 90], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = run(llm, ps, params)
    tight = run(llm, ps, params, num_cache_blocks=3, max_num_batched_tokens=256)   # 384 positions
    assert run.last.engine.scheduler.num_preemptions > 0
    assert tight == free


def test_request_larger_than_the_cache_is_refused_not_hung(llm):
    with pytest.raises(ValueError, match="cache blocks"):
        run(llm, prompts(1, [200], seed=4), SamplingParams(max_tokens=100), num_cache_blocks=2)
