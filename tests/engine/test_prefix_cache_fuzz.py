"""Prefix caching under fuzz (tiny V4, batch-invariant ops; float32 on the CPU, bf16 on a GPU with
`-m gpu`): requests drawn from a random tree of shared prefixes, submitted in random groups to an
engine with a small cache (blocks and checkpoint slots evicted all along), give exactly the outputs
of the same requests with caching off; afterwards, with the cache reset, every block and checkpoint
slot is free. The CI-sized run takes 16 requests up to 400 tokens; the full one (`-m slow`) 1,000
requests up to 3,000 tokens."""
from __future__ import annotations

import random

import pytest

from deepinfer_core import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def prefix_tree_requests(n: int, max_len: int, seed: int) -> list[list[int]]:
    """`n` prompts: each a random node of a random tree of token runs (its whole path from the root)
    plus a tail of its own, cut to a random length of 1..max_len tokens."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(3, 129000) for _ in range(k)]
    nodes: list[list[int]] = [[]]
    for _ in range(max(2, n // 4)):                 # each node extends a random earlier one
        parent = rng.choice(nodes)
        nodes.append(parent + tokens(rng.randint(1, max(1, max_len - len(parent)))))
    return [(rng.choice(nodes) + tokens(40))[:rng.randint(1, max_len)] for _ in range(n)]


def run(base: LLM, prompts, caching: bool, seed: int, **opts) -> tuple[list[list[int]], LLM]:
    llm = LLM.from_runner(base.runner, tokenizer=base.tokenizer, enable_prefix_caching=caching,
                          **opts)
    rng, outs, i = random.Random(seed), [], 0
    while i < len(prompts):                 # groups of 1..8 requests, one generate call each
        k = rng.randint(1, 8)
        group = [{"prompt_token_ids": p} for p in prompts[i:i + k]]
        res = llm.generate(group, PARAMS, use_tqdm=False)
        outs += [o.outputs[0].token_ids for o in res]
        i += k
    return outs, llm


def fuzz(tiny_ckpt_dir, n: int, max_len: int, seqs: int, blocks: int, device: str) -> None:
    opts = dict(max_model_len=max_len + 8, max_num_seqs=seqs, num_cache_blocks=blocks,
                max_num_batched_tokens=1024)
    dtype = "float32" if device == "cpu" else "bfloat16"
    base = LLM(model=str(tiny_ckpt_dir), dtype=dtype, device=device, batch_invariant=True, **opts)
    prompts = prefix_tree_requests(n, max_len, seed=n)
    cold, _ = run(base, prompts, False, seed=1, **opts)
    warm, llm = run(base, prompts, True, seed=1, prefix_checkpoint_slots=3, **opts)
    assert warm == cold
    st = llm.engine.scheduler.prefix.stats
    assert st.hits > 0 and st.evicted_blocks > 0 and st.evicted_checkpoints > 0, st
    assert llm.reset_prefix_cache()
    assert llm.engine.scheduler.blocks.allocator.empty, "blocks or checkpoints left after a reset"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]   # cuda: bf16, the nvidia kernels


@pytest.mark.parametrize("device", DEVICES)
def test_fuzzed_prefix_trees_under_eviction_pressure(tiny_ckpt_dir, device):
    fuzz(tiny_ckpt_dir, 16, 400, seqs=2, blocks=8, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_fuzzed_prefix_trees_full_size(tiny_ckpt_dir, device):
    fuzz(tiny_ckpt_dir, 1000, 3000, seqs=4, blocks=4 * 24 + 16, device=device)
