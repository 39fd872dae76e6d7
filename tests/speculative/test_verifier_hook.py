"""A plugin's draft verifier (hook deepinfer_verifier) is the one the engine's speculative steps
use; one without the core's exact greedy rule keeps every verdict on the host path."""
from __future__ import annotations

import pytest
from spec_cases import OPTIONS

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.ops.verify import ExactVerifier


class CountingVerifier:
    """The core's rule, counted; `exact_greedy = False` keeps every verdict on the host path."""

    exact_greedy = False

    def __init__(self):
        self.calls, self.core = 0, ExactVerifier()

    def verify(self, *args):
        self.calls += 1
        return self.core.verify(*args)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_verifies_with_the_plugins_verifier(trained_dir, temperature):
    """The bundled model drafts with its MTP block; every verify step goes through the verifier
    the runner resolved, and the outputs stay those of the lossless rule."""
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True)
    prompts = ["HAMLET.\nTo be, or not", "KING.\nMy lord"]
    reference = LLM(model=trained_dir, num_speculative_tokens=2, **OPTIONS)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    llm = LLM(model=trained_dir, num_speculative_tokens=2, **OPTIONS)
    llm.runner.loaded.verifier = counting = CountingVerifier()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert counting.calls > 0 and got == expected
