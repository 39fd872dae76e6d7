"""Prefix caching with speculative decoding (the trained model, float32, batch-invariant ops, CPU):
after a hit, MTP and DSpark draft from the restored drafter state and the tokens equal greedy
decoding without caching or drafting; a decode checkpoint taken while verifying (the output passes a
block boundary) is hit by the next turn."""
from __future__ import annotations

import pytest
from spec_cases import OPTIONS, PROMPTS

from deepinfer_core import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def turns(llm: LLM, history: list[int], extra: list[int]):
    """Three requests: a ~200-token prompt, the same again, then the history + its output + more."""
    outs = []
    for prompt in (history, history, None):
        if prompt is None:
            prompt = history + outs[0].outputs[0].token_ids + extra
        outs.append(llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0])
    accepted = sum(o.metrics.spec.num_accepted_tokens for o in outs if o.metrics.spec is not None)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], accepted


@pytest.mark.parametrize("drafter", ["mtp", pytest.param("dspark", marks=pytest.mark.slow)])
def test_a_hit_then_drafting_gives_the_greedy_tokens(drafter, trained_dir, dspark_trained_dir):
    path = trained_dir if drafter == "mtp" else dspark_trained_dir
    opts = {**OPTIONS, "max_model_len": 512}
    ref = LLM(model=path, num_speculative_tokens=0, enable_prefix_caching=False, **opts)
    history = ref.tokenizer.encode("".join(PROMPTS) * 2)[:200]
    extra = ref.tokenizer.encode(PROMPTS[0])
    want, _, _ = turns(ref, history, extra)
    llm = LLM(model=path, enable_prefix_caching=True, num_speculative_tokens=3, **opts)
    got, cached, accepted = turns(llm, history, extra)
    assert got == want
    # the third hits the first one's output end (200 + 64 > 256)
    assert cached == [0, 128, 256], llm.engine.scheduler.prefix.stats
    assert accepted > 0
