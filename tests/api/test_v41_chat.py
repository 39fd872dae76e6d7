"""DeepSeek-V4.1 is served text-only: a request with an image part is refused with an error that
names the part; a V4 model keeps the official format's "[Unsupported ...]" text."""

from __future__ import annotations

import pytest

from deepinfer_core.api.chat import chat_prompts
from deepinfer_core.api.llm import LLM
from deepinfer_core.api.sampling_params import SamplingParams
from deepinfer_core.model.weights import CheckpointError, resolve_model_path

IMAGE_TURN = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "x.png"}},
        ],
    }
]


def test_chat_with_an_image_is_refused_on_v41(tiny_v41_dir):
    llm = LLM(str(tiny_v41_dir), dtype="float32")
    assert llm.model_config.vision
    with pytest.raises(
        ValueError, match=r"messages\[0\]\.content\[1\]\.type='image_url'.*allowed: 'text'"
    ):
        llm.chat(IMAGE_TURN, SamplingParams(max_tokens=2), use_tqdm=False)
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    assert llm.chat(text_only, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_v4_format_keeps_unsupported_parts_as_text():
    assert "[Unsupported image_url]" in chat_prompts(IMAGE_TURN)[0]


def test_a_missing_repo_names_the_env_variable_and_the_reference_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError) as ei:
        resolve_model_path("deepseek-ai/DeepSeek-V4.1-Flash-1017")
    msg = str(ei.value)
    assert "DEEPINFER_HF_MODEL_DIR" in msg and "not found locally" in msg
