"""Decode CUDA graphs on the nvidia backend: captured once per batch bucket, used for decode steps,
and the same greedy tokens and logprobs as eager execution (`enforce_eager=True`).
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
    opts = dict(dtype="float32", simulate_qat=False, max_num_seqs=32, gpu_memory_utilization=0.05)
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
