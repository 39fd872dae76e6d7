"""Sampling on the GPU: the whole sampler (greedy, temperature, top-k/top-p/min-p, the seeded
counter-based RNG, logprobs) runs without one host synchronisation, and draws the same tokens as the
CPU sampler at the real vocabulary size; so do its whole-batch fast paths with positions and seeds
staged as device tensors, and the device-resident penalty state (start / add / apply), whose results
are bitwise those of the CPU reference `apply_penalties`.
Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu`."""
from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.ops.penalties import PenaltyState, apply_penalties
from deepinfer_core.ops.sampler import Sampler, compute_logprobs, seed_bits
from deepinfer_core.ops.transfer import to_device

pytestmark = pytest.mark.gpu
VOCAB = 129280


def params(i: int) -> SimpleNamespace:
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=50),
             dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, min_p=0.05),
             dict(temperature=0.8, top_k=200, top_p=0.95, min_p=0.01)]
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    return SimpleNamespace(**{**base, **kinds[i % len(kinds)]})


@contextlib.contextmanager
def no_sync():
    """Any implicit device->host synchronisation inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def batch(seed: int, rows: int) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """[rows, VOCAB] CPU logits and one of each sampling kind per row, in turn."""
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    return logits, [params(i) for i in range(rows)]


def test_sampling_on_the_gpu_never_syncs_and_equals_the_cpu():
    logits, ps = batch(0, rows=48)
    positions, seeds = list(range(7, 7 + 48)), [1000 + 13 * i for i in range(48)]
    sampler = Sampler()
    want = sampler.sample(logits, ps, positions, seeds)
    want_lp = compute_logprobs(logits, 5, want)
    dev = logits.cuda()
    with no_sync():
        got = sampler.sample(dev, ps, positions, seeds)
        got_lp = compute_logprobs(dev, 5, got)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got_lp.top_ids.cpu(), want_lp.top_ids)
    assert torch.allclose(got_lp.top_logprobs.cpu(), want_lp.top_logprobs, atol=1e-5)
    assert torch.equal(got_lp.sampled_ranks.cpu(), want_lp.sampled_ranks)


def test_fast_paths_with_device_positions_and_seeds():
    rows = 40
    logits, ps = batch(1, rows)
    positions = list(range(3, 3 + rows))
    seeds = [(1 << 64) - 1 - i if i % 4 == 0 else 77 + 5 * i for i in range(rows)]   # some >= 2^63
    sampler = Sampler()
    want = sampler.sample(logits, ps, positions, seeds)                   # CPU, mixed batch
    rand = [i for i, p in enumerate(ps) if p.temperature > 0]
    greedy = [i for i, p in enumerate(ps) if p.temperature == 0]
    dev = logits.cuda()
    with no_sync():
        pos_t = to_device(positions, torch.int64, "cuda")
        seed_t = to_device([seed_bits(s) for s in seeds], torch.int64, "cuda")
        r = to_device(rand, torch.int64, "cuda")
        gr = to_device(greedy, torch.int64, "cuda")
        mixed = sampler.sample(dev, ps, pos_t, seed_t)
        mixed_lists = sampler.sample(dev, ps, positions, seeds)
        all_rand = sampler.sample(dev.index_select(0, r), [ps[i] for i in rand], pos_t.index_select(0, r),
                                  seed_t.index_select(0, r))
        all_greedy = sampler.sample(dev.index_select(0, gr), [ps[i] for i in greedy],
                                    pos_t.index_select(0, gr), seed_t.index_select(0, gr))
    assert torch.equal(mixed.cpu(), want) and torch.equal(mixed_lists.cpu(), want)
    assert torch.equal(all_rand.cpu(), want[rand]) and torch.equal(all_greedy.cpu(), want[greedy])


def test_logprobs_at_max_k_on_the_gpu():
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 4, (8, VOCAB), generator=g).float()       # masses of exact ties
    logits[1] = torch.randn(VOCAB, generator=g)
    dev = logits.cuda()
    sampled = torch.randint(0, VOCAB, (8,), generator=g).cuda()
    with no_sync():
        big = compute_logprobs(dev, 20, sampled)
        small = compute_logprobs(dev, 5, sampled)
    assert torch.equal(big.top_ids[:, :5], small.top_ids)
    assert torch.equal(big.top_logprobs[:, :5], small.top_logprobs)
    assert torch.equal(big.top_ids.cpu(), compute_logprobs(logits, 20).top_ids)     # CPU partial sort


PEN_KINDS = [SimpleNamespace(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
             SimpleNamespace(repetition_penalty=1.3, presence_penalty=0.0, frequency_penalty=0.0),
             SimpleNamespace(repetition_penalty=0.8, presence_penalty=0.4, frequency_penalty=0.0),
             SimpleNamespace(repetition_penalty=1.0, presence_penalty=-0.3, frequency_penalty=0.7),
             SimpleNamespace(repetition_penalty=1.17, presence_penalty=1.1, frequency_penalty=-0.45)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalty_state_on_the_gpu_never_syncs_and_equals_the_cpu_reference(dtype):
    rng = random.Random(0)
    g = torch.Generator().manual_seed(3)
    num_slots, rows = 64, 24
    slot_of = rng.sample(range(num_slots), rows)
    ps = [PEN_KINDS[i % len(PEN_KINDS)] for i in range(rows)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 300))] for _ in range(rows)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 50))] if i % 3 == 0 else []
               for i in range(rows)]                                  # some restarted after preemption
    state = PenaltyState(num_slots, VOCAB, "cuda")
    slots_t = torch.tensor(slot_of).cuda()
    active = [i for i, p in enumerate(ps) if p is not PEN_KINDS[0]]
    with no_sync():
        state.start([slot_of[i] for i in active], [prompts[i] for i in active], [outputs[i] for i in active])
    for step in range(5):
        logits = (torch.randn(rows, VOCAB, generator=g) * 3).to(dtype)
        logits[:, ::9] = 0
        want = apply_penalties(logits, ps, outputs, prompts)             # CPU reference
        # Tokens from a small alphabet half of the time: counts well above one.
        tokens = [rng.randrange(VOCAB if step % 2 else 40) for _ in range(rows)]
        dev = logits.cuda()
        with no_sync():
            got = state.apply(dev, slots_t, ps)
            state.add(slots_t, to_device(tokens, torch.int64, "cuda"))
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(got.cpu().view(bits), want.view(bits)), step
        for i, t in enumerate(tokens):
            outputs[i].append(t)
