"""Per-token output processing: the request record, one completion's growing state, stop checks
and logprob entries. Host-side only; shared by the engine and the API."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..api.outputs import CompletionOutput, Logprob, RequestMetrics
from ..api.sampling_params import SamplingParams
from ..api.tokenizer import Tokenizer
from ..ops.sampler import LogprobsResult


def _find_stop_string(text: str, stops: Sequence[str], search_from: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


@dataclass
class Request:
    """One validated request: prompt, its own copy of the params, and its base seed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                          # completion j samples with completion_seed(seed, j)
    metrics: RequestMetrics
    constraint: Any = None             # a RequestConstraint (structured outputs) or None


@dataclass
class CompletionState:
    """One completion being generated: tokens, text, logprobs and the finish state."""

    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)


def check_stop(state: CompletionState, params: SamplingParams, *, eos_token_id: int | None,
               max_tokens: int, tokenizer: Tokenizer | None) -> bool:
    """Update `state.text` for the newest token and set finish/stop reasons; True when finished.

    Stop tokens (EOS, stop_token_ids) and stop strings count only once min_tokens are out (the
    sampler also masks stop tokens before that). Their text is cut unless include_stop_str_in_output.
    """
    ids, last = state.token_ids, state.token_ids[-1]
    detok = tokenizer is not None and params.detokenize
    prev_len = len(state.text.rstrip("\ufffd"))   # a partial UTF-8 char may still change
    if detok:
        state.text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if len(ids) >= params.min_tokens:
        stop_token = last in params.all_stop_token_ids(eos_token_id)
        if stop_token:
            state.finish_reason = "stop"
            # vLLM: EOS leaves stop_reason None; a stop_token_ids hit records the id.
            state.stop_reason = last if last in params.stop_token_ids else None
            if detok and not params.include_stop_str_in_output:
                state.text = tokenizer.decode(ids[:-1], skip_special_tokens=params.skip_special_tokens)
            return True
        hit = _find_stop_string(state.text, params.stop, prev_len) if detok and params.stop else None
        if hit is not None:
            pos, s = hit
            state.finish_reason, state.stop_reason = "stop", s
            state.text = state.text[:pos + len(s)] if params.include_stop_str_in_output else state.text[:pos]
            return True
    if len(ids) >= max_tokens:
        state.finish_reason = "length"
        return True
    return False


def logprobs_entry(res: LogprobsResult, row: int, token_id: int | None,
                   tokenizer: Tokenizer | None) -> dict[int, Logprob]:
    """token id -> Logprob for one position: `token_id` (sampled or actual prompt token, with its true
    rank) first, then the top-K with ranks 1..K."""
    def decoded(t: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)

    out: dict[int, Logprob] = {}
    if token_id is not None:
        out[token_id] = Logprob(float(res.sampled_logprobs[row]), int(res.sampled_ranks[row]),
                                decoded(token_id))
    for rank, (lp, t) in enumerate(zip(res.top_logprobs[row].tolist(), res.top_ids[row].tolist()), 1):
        if t not in out:
            out[t] = Logprob(lp, rank, decoded(t))
    return out
