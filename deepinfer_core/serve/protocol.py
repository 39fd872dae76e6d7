"""OpenAI-compatible request bodies (pydantic) and their mapping onto `SamplingParams`.

Fields are spelled as OpenAI and vLLM spell them. Unknown fields are refused (400 naming them), never
ignored; values are checked by `SamplingParams`, whose ValueError names the field.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..api.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or token ids, one per entry of a batched `prompt`."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if not p:
            raise ValueError("prompt: empty; give a string, a list of strings, token ids or lists of them")
        return [x if isinstance(x, str) else list(x) for x in p]

    def sampling_params(self) -> SamplingParams:
        fields: dict[str, Any] = {k: getattr(self, k) for k in (
            "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
            "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
            "skip_special_tokens", "include_stop_str_in_output")}
        return SamplingParams(**fields)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
