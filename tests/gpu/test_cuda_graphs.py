"""Decode and verification CUDA graphs on the nvidia backend: captured once per (batch bucket, tokens
per sequence), used for decode steps and speculative-verification batches (q tokens per sequence,
every row's logits), and the same greedy tokens and logprobs as eager execution (`enforce_eager=True`).
Run on a GPU machine: `python -m pytest -q -s -m gpu tests/gpu`."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_graph_decode_equals_eager_decode(tiny_ckpt_dir):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    # float32, QAT off: padding changes GEMM shapes (tile choice) and so the last bits; bf16 on the
    # random tiny model turns such bits into different tokens (see test_nvidia_backend.py)
    opts = dict(dtype="float32", simulate_qat=False, max_num_seqs=32, kv_cache_memory_bytes=1 << 30)
    graphs = LLM(model=str(tiny_ckpt_dir), **opts)
    eager = LLM(model=str(tiny_ckpt_dir), enforce_eager=True, **opts)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (3, 17, 40, 140, 9, 64, 200, 25) * 2]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
    got = graphs.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    want = eager.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert graphs.runner.graphs.failed is None, graphs.runner.graphs.failed
    assert graphs.runner.graphs.graphs, "no decode graph was captured"
    print(f"[gpu] captured decode graphs for batch sizes {sorted(graphs.runner.graphs.graphs)}")
    same = sum(o.outputs[0].token_ids == w.outputs[0].token_ids for o, w in zip(got, want))
    worst = 0.0
    for o, w in zip(got, want):
        for lo, lw in zip(o.outputs[0].logprobs, w.outputs[0].logprobs):
            shared = set(lo) & set(lw)
            worst = max([worst] + [abs(lo[t].logprob - lw[t].logprob) for t in shared])
    print(f"[gpu] graph vs eager: {same}/{len(prompts)} prompts identical for 64 tokens; "
          f"max logprob difference {worst:.2e}")
    assert same == len(prompts)


def test_graph_verify_steps_equal_eager_verify_steps(tiny_ckpt_dir):
    """Verification batches of q = 2 and 4 tokens per sequence (all rows' logits) driven through the
    runners directly: 5 sequences -> bucket 8 (3 padding
    sequences), one of them crossing positions 127/128. Both runners get the same tokens (the eager
    runner's greedy token, then random drafts): same argmax at every row, logprobs within 1e-3."""
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    # rollback room for 3 drafts: verify graphs go up to q = max_backtracking_tokens (the suite runs with
    # DEEPINFER_USE_NEXTN_DECODE=0, whose default room is 1)
    opts = dict(dtype="float32", simulate_qat=False, max_num_seqs=8, kv_cache_memory_bytes=1 << 30,
                max_backtracking_tokens=4)
    graphs = LLM(model=str(tiny_ckpt_dir), **opts)
    eager = LLM(model=str(tiny_ckpt_dir), enforce_eager=True, **opts)
    runners = (graphs.runner, eager.runner)
    assert runners[0].graphs is not None and runners[0].graphs.max_query_len >= 4
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (3, 17, 125, 40, 9)]
    seqs = [[r.new_sequence() for _ in prompts] for r in runners]
    worst = 0.0
    try:
        # prefill (ragged: eager on both), then verify steps starting from the eager greedy token
        last = runners[1].forward_batch(prompts, seqs[1]).argmax(-1).tolist()
        runners[0].forward_batch(prompts, seqs[0])
        for q in (2, 4, 4, 2):
            drafts = torch.randint(2, 129280, (len(prompts), q - 1), generator=g).tolist()
            toks = [[t] + d for t, d in zip(last, drafts)]
            got, want = (r.forward_batch(toks, s, all_logits=True).float() for r, s in zip(runners, seqs))
            assert got.shape == want.shape == (len(prompts) * q, want.shape[-1])
            assert [s.num_tokens for s in seqs[0]] == [s.num_tokens for s in seqs[1]]
            assert torch.equal(got.argmax(-1), want.argmax(-1)), q
            diff = (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
            assert diff < 1e-3, (q, diff)
            worst = max(worst, diff)
            last = want.view(len(prompts), q, -1)[:, -1].argmax(-1).tolist()
    finally:
        for r, ss in zip(runners, seqs):
            for s in ss:
                r.release(s)
    assert runners[0].graphs.failed is None, runners[0].graphs.failed
    assert {(8, 2), (8, 4)} <= set(runners[0].graphs.graphs), sorted(runners[0].graphs.graphs)
    print(f"[gpu] verify graphs {sorted(runners[0].graphs.graphs)}: max logprob difference {worst:.2e}")
