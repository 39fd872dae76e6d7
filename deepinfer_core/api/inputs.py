"""What `generate` takes, normalised once for the in-process `LLM` and the data-parallel front end
alike: the prompts, one SamplingParams per prompt, and the model directory."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from .sampling_params import SamplingParams


def parse_prompts(prompts: Any, prompt_token_ids: Any) -> list[Any]:
    """Normalise the `generate` inputs to [(prompt text or None, token ids or None, cache_salt or
    None)]; an entry that is malformed on its own becomes a ValueError in its place (the call itself
    raises)."""
    if prompts is None and prompt_token_ids is None:
        raise ValueError("generate: pass prompts or prompt_token_ids")
    texts: list[Any] = []
    if prompts is not None:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"generate: prompts must be a str, a dict with 'prompt_token_ids', or a list "
                            f"of those; got {type(prompts).__name__}")
        texts = list(prompts)
    ids: list[Any] = []
    if prompt_token_ids is not None:
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise TypeError(f"generate: prompt_token_ids must be a list of lists of int, "
                            f"got {type(prompt_token_ids).__name__}")
        ids = list(prompt_token_ids)
        if ids and all(isinstance(t, int) for t in ids):
            ids = [ids]      # one prompt given as a flat list
    if prompts is not None and prompt_token_ids is not None and len(texts) != len(ids):
        raise ValueError(f"generate: prompts has {len(texts)} entries but prompt_token_ids has {len(ids)}")
    out: list[Any] = []
    for i in range(max(len(texts), len(ids))):
        try:
            out.append(_parse_one(i, texts[i] if texts else None, ids[i] if ids else None))
        except ValueError as e:
            out.append(e)
    return out


def _parse_one(i: int, text: Any, toks: Any) -> tuple[str | None, list[int] | None, str | None]:
    salt = None
    if isinstance(text, dict):
        if "prompt_token_ids" not in text and "prompt" not in text:
            raise ValueError(f"generate: prompts[{i}] is a dict without 'prompt_token_ids' or 'prompt'")
        salt = text.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"generate: prompts[{i}]['cache_salt'] must be a str, got {type(salt).__name__}")
        text, toks = text.get("prompt"), (toks if toks is not None else text.get("prompt_token_ids"))
    if text is not None and not isinstance(text, str):
        raise ValueError(f"generate: prompts[{i}] must be a str or a dict with 'prompt_token_ids', "
                         f"got {type(text).__name__}")
    if toks is not None and not isinstance(toks, (list, tuple)):
        raise ValueError(f"generate: prompt_token_ids[{i}] must be a list of int, "
                         f"got {type(toks).__name__}")
    return text, None if toks is None else list(toks), salt


def resolve_model_dir(model: str) -> Path:
    """A local directory, an HF cache snapshot or a repo id in the local HF cache (never downloads)."""
    from ..model.weights import resolve_model_path  # lazy: the model package is heavy
    return Path(resolve_model_path(model))


def per_request_params(sp: Any, n: int) -> list[SamplingParams]:
    """`generate`'s sampling_params as one SamplingParams per prompt (deep copies: requests never share
    state)."""
    if sp is None:
        sp = SamplingParams()
    if isinstance(sp, SamplingParams):
        return [copy.deepcopy(sp) for _ in range(n)]
    if not isinstance(sp, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in sp):
        raise TypeError(f"generate: sampling_params must be a SamplingParams or a list of them, "
                        f"got {type(sp).__name__}")
    if len(sp) != n:
        raise ValueError(f"generate: sampling_params has {len(sp)} entries for {n} prompts")
    return [copy.deepcopy(p) for p in sp]
