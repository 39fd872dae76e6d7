"""Sampling on the GPU: the whole sampler (greedy, temperature, top-k/top-p/min-p, the seeded
counter-based RNG, logprobs) runs without one host synchronisation, and draws the same tokens as the
CPU sampler at the real vocabulary size. Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.ops.sampler import Sampler, compute_logprobs

pytestmark = pytest.mark.gpu
VOCAB = 129280


def params(i: int) -> SimpleNamespace:
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=50),
             dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, min_p=0.05),
             dict(temperature=0.8, top_k=200, top_p=0.95, min_p=0.01)]
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    return SimpleNamespace(**{**base, **kinds[i % len(kinds)]})


def test_sampling_on_the_gpu_never_syncs_and_equals_the_cpu():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    g = torch.Generator().manual_seed(0)
    rows = 48
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    ps = [params(i) for i in range(rows)]
    positions, seeds = list(range(7, 7 + rows)), [1000 + 13 * i for i in range(rows)]
    sampler = Sampler()
    want = sampler.sample(logits, ps, positions, seeds)
    want_lp = compute_logprobs(logits, 5, want)
    dev = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")       # any implicit device->host sync raises
    try:
        got = sampler.sample(dev, ps, positions, seeds)
        got_lp = compute_logprobs(dev, 5, got)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got_lp.top_ids.cpu(), want_lp.top_ids)
    assert torch.allclose(got_lp.top_logprobs.cpu(), want_lp.top_logprobs, atol=1e-5)
    assert torch.equal(got_lp.sampled_ranks.cpu(), want_lp.sampled_ranks)
