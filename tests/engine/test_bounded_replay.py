"""V4.1 SWA bounded replay (the swa_replay feature): 'mask' and 'compact' agree bitwise in a
batch-invariant run, the exactness bound of spec §8.3 holds row by row, and the options are
checked at start-up and per request."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.api.llm import LLM
from deepinfer_core.api.sampling_params import SamplingParams
from deepinfer_core.model.forward_batch import ForwardBatch
from deepinfer_core.runner.model_loader import load_model

KEEP = 40  # >= window 16 + the backtracking room


def _prompts(lengths, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128000, (n,), generator=gen).tolist() for n in lengths]


def _run(path, mode, prompts, **kw):
    llm = LLM(
        str(path),
        dtype="float32",
        simulate_qat=False,
        batch_invariant=True,
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=KEEP,
        **kw,
    )
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
        for o in outs
    ]


def test_mask_and_compact_are_bitwise_equal(tiny_v41_dir):
    """Same rectangle, two executions: 'mask' computes every row, 'compact' only the kept ones;
    with batch-invariant ops every kept row's numbers are the same bits (chunked prefill too)."""
    prompts = _prompts((9, 70, 181))
    mask = _run(tiny_v41_dir, "mask", prompts, max_num_batched_tokens=64)
    compact = _run(tiny_v41_dir, "compact", prompts, max_num_batched_tokens=64)
    assert mask == compact


def _consumer_rows(model, prompt, truncation, depth):
    """The streams leaving consumer layer n_prefill + depth - 1, one sequence, one forward."""
    from deepinfer_core.cache.state_cache import new_sequence_state

    layer, seen = model.layers[model.cfg.n_prefill_layer + depth - 1], {}
    run = layer.forward_shifted

    def spy(*args, **kw):
        out = run(*args, **kw)
        seen["h"] = out[0]
        return out

    layer.forward_shifted = spy
    st = new_sequence_state(model.cfg, torch.float32, max_tokens=len(prompt) + 8)
    batch = ForwardBatch.build([prompt], [st])
    batch.truncation = truncation
    try:
        with torch.no_grad():
            model(batch)
    finally:
        del layer.forward_shifted
    return seen["h"]


def test_rows_far_enough_inside_the_rectangle_are_exact(tiny_v41_dir):
    """Spec §8.3: at consumer depth d a kept row at pos >= rect_lo + d*(window-1) equals the
    'off' value bit for bit; rows nearer the rectangle's start do not (else the bound says
    nothing)."""
    from deepinfer_core.config import ModelConfig

    cfg = ModelConfig.from_file(tiny_v41_dir)
    W, P = cfg.sliding_window, 120
    prompt = _prompts((P,), seed=3)[0]
    rect_lo = P - KEEP
    consumers = cfg.num_hidden_layers - cfg.n_prefill_layer
    model = load_model(
        tiny_v41_dir, dtype="float32", simulate_qat=False, batch_invariant=True
    ).model
    for depth in (1, 2, consumers):
        off = _consumer_rows(model, prompt, None, depth)
        kept = _consumer_rows(model, prompt, ("compact", [rect_lo]), depth)
        assert kept.shape[0] == KEEP
        bound = rect_lo + depth * (W - 1)
        exact = slice(bound - rect_lo, KEEP)
        assert torch.equal(kept[exact], off[bound:])
        assert not torch.equal(kept[: bound - rect_lo], off[rect_lo:bound])


def test_keep_below_window_plus_backtracking_is_refused(tiny_v41_dir):
    with pytest.raises(
        ValueError, match=r"yoco_prefill_keep_tokens=10; allowed: >= sliding_window"
    ):
        LLM(str(tiny_v41_dir), yoco_prefill_truncation_mode="compact", yoco_prefill_keep_tokens=10)


def test_truncation_on_a_v4_model_is_refused(tiny_ckpt_dir):
    with pytest.raises(ValueError, match="no YOCO consumer layers"):
        LLM(str(tiny_ckpt_dir), yoco_prefill_truncation_mode="mask")


def test_compact_refuses_prompt_logprobs_per_request(tiny_v41_dir):
    llm = LLM(
        str(tiny_v41_dir),
        dtype="float32",
        yoco_prefill_truncation_mode="compact",
        yoco_prefill_keep_tokens=KEEP,
    )
    with pytest.raises(ValueError, match="prompt_logprobs is not available with"):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, prompt_logprobs=0)
        )
    assert (
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
