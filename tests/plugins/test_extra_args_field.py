"""The server's request bodies carry `extra_args` (alias `vllm_xargs`, vLLM's name) into
`SamplingParams.extra_args` on both routes; a value that is not an object, or both spellings at
once, is refused naming the field."""
from __future__ import annotations

import pydantic
import pytest

from deepinfer_core.serve.protocol import ChatRequest, CompletionRequest

XARGS = {"banned_words": ["thee"], "note": 1}


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt="Hello", **fields)


def chat(**fields) -> ChatRequest:
    return ChatRequest(model="tiny", messages=[{"role": "user", "content": "Hi"}], **fields)


@pytest.mark.parametrize("spelling", ["extra_args", "vllm_xargs"])
def test_both_routes_hand_the_object_to_sampling_params(spelling):
    assert completion(**{spelling: XARGS}).sampling_params().extra_args == XARGS
    assert chat(**{spelling: XARGS}).sampling_params(None).extra_args == XARGS
    assert completion().sampling_params().extra_args is None


def test_not_an_object_or_both_spellings_are_refused():
    with pytest.raises(pydantic.ValidationError) as e:
        completion(extra_args=["thee"])
    assert e.value.errors()[0]["loc"] == ("extra_args",)
    with pytest.raises(ValueError, match=r"^vllm_xargs: give it or extra_args \(its alias\)"):
        chat(extra_args=XARGS, vllm_xargs=XARGS).sampling_params(None)
