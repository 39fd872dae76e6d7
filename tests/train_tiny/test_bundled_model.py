"""The bundled model is the trained one: built from the shipped artifact into an empty user cache, it
predicts held-out Shakespeare (The Tempest, never trained on) far better than a random model, and
`LLM()` with no model configured runs it."""
from __future__ import annotations

import math

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.tools import bundled_model

# The Tempest, I.2 (public domain; the play is the training tool's held-out split).
HELD_OUT = """ARIEL.
Full fathom five thy father lies;
Of his bones are coral made;
Those are pearls that were his eyes:
Nothing of him that doth fade
But doth suffer a sea-change
Into something rich and strange.
"""


@pytest.fixture(scope="module")
def bundled_llm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        mp.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
        yield LLM(dtype="float32", max_model_len=256)


def test_llm_without_a_model_runs_the_bundled_trained_model(bundled_llm):
    assert bundled_model.is_complete(bundled_llm.model_dir, bundled_model.fingerprint())
    assert bundled_llm.vocab_size == 129280


def test_it_predicts_held_out_text_far_better_than_chance(bundled_llm):
    out = bundled_llm.generate([HELD_OUT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    nll = -sum(entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])) / (len(ids) - 1)
    assert nll < 0.6 * math.log(129280), nll          # the shipped run: ~5.5 nats over the held-out plays


def test_greedy_text_is_made_of_english_words(bundled_llm):
    text = bundled_llm.generate(["HAMLET.\nTo be, or not to be,"], SamplingParams(temperature=0.0, max_tokens=24),
                                use_tqdm=False)[0].outputs[0].text
    words = [w.strip(".,;:!?[]'\"").lower() for w in text.split()]
    common = {"the", "and", "i", "a", "to", "of", "you", "my", "not", "is", "in", "it", "that", "will", "me",
              "be", "he", "his", "your", "with", "for", "so", "have", "this", "what", "exeunt", "enter", "scene"}
    assert sum(w in common for w in words) >= 3, text
