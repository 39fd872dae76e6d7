"""The NVIDIA attention backend (batched kernels over device metadata) inside the whole tiny model,
against the portable backend: same greedy tokens and near-identical logits through chunked prefill,
decode across compressor block boundaries (ratio 4 and 128) and a ragged continuous batch.
Runs under TRITON_INTERPRET=1 on CPU in CI and compiled on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.model.attention import Attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
from deepinfer_nvidia.attention import NvidiaAttentionBackend  # noqa: E402
from deepinfer_nvidia.plugin import model_ratios  # noqa: E402


def use_nvidia_attention(llm: LLM) -> None:
    backend = NvidiaAttentionBackend(model_ratios(llm.runner.model_config))
    for m in llm.runner.model.modules():
        if isinstance(m, Attention):
            m.backend = backend


@pytest.fixture(scope="module")
def pair(tiny_ckpt_dir, kdev):
    opts = dict(dtype="float32", simulate_qat=False, device=kdev, max_num_batched_tokens=96,
                num_cache_blocks=16, max_num_seqs=4, async_scheduling=False)
    ref, ours = LLM(model=str(tiny_ckpt_dir), **opts), LLM(model=str(tiny_ckpt_dir), **opts)
    use_nvidia_attention(ours)
    return ref, ours


def test_greedy_tokens_and_logprobs_match_the_portable_backend(pair):
    ref, ours = pair
    g = torch.Generator().manual_seed(3)
    # 130 tokens: chunked at 96, closes the first ratio-128 block; decode closes a ratio-4 block
    # (position 131) beside a short sequence's decode
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (130, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    want = ref.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    got = ours.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    for w, o in zip(want, got):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lo in zip(w.outputs[0].logprobs, o.outputs[0].logprobs):
            for tok, v in lw.items():
                assert abs(lo[tok].logprob - v.logprob) < 1e-3


def test_padded_static_decode_batches_equal_eager_decode(tiny_ckpt_dir, kdev):
    """What a decode CUDA graph runs, without the graph: batches padded to their bucket with padding
    sequences in the cache's spare slot, fixed-shape metadata refilled in place (closed-block lists
    padded with -1, block tables to the longest). Same logits as the plain eager path, step by step,
    from two identical caches."""
    from deepinfer_core.cache.state_cache import StateCache
    from deepinfer_core.runner.cuda_graphs import DecodeGraphs

    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, device=kdev,
              num_cache_blocks=8, max_num_seqs=4, async_scheduling=False)
    use_nvidia_attention(llm)
    runner = llm.runner
    backend = runner.model.layers[0].attn.backend
    layout = runner.cache_layout()
    eager_cache = StateCache(layout, 4, 8, kdev)
    static_cache = StateCache(layout, 4, 8, kdev, spare=True)
    graphs = DecodeGraphs(runner.model, static_cache, backend, max_seqs=4, max_blocks=3, capture=False)
    g = torch.Generator().manual_seed(11)
    # decode positions 7..9 / 6..8 close ratio-4 blocks in some steps and not in others
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (7, 6, 3)]
    blocks = [[5], [3], [7]]               # shuffled physical blocks
    eager = [eager_cache.bind(i, b) for i, b in enumerate(blocks)]
    static = [static_cache.bind(i, b) for i, b in enumerate(blocks)]
    want = runner.forward_batch(prompts, eager)
    runner.forward_batch(prompts, static)
    for step in range(3):                  # 3 sequences -> bucket 4 (one padding sequence)
        toks = [[int(t)] for t in want.argmax(-1)]
        want = runner.forward_batch(toks, eager)
        got = graphs.run(toks, static)
        for st in static:
            st.num_tokens += 1
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), step
    assert sorted(graphs.graphs) == [4]
