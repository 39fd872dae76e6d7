"""Host-side processing of sampled tokens: append, stop checks, text, logprob entries.

Text is only decoded during generation for a completion that needs it then (stop strings, or a
streamed request whose deltas carry text): an `IncrementalDetokenizer` per such completion decodes a
small window per token. Every other completion is decoded once, when it finishes.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from ..api.outputs import Logprob
from ..api.tokenizer import Tokenizer
from .detokenizer import IncrementalDetokenizer, find_stop
from .sequence import Sequence


def wants_text(seq: Sequence, tokenizer: Tokenizer | None) -> bool:
    return tokenizer is not None and seq.request.params.detokenize


def start_detokenizer(seq: Sequence, tokenizer: Tokenizer | None) -> None:
    """Give `seq` an incremental detokenizer when its text is needed while it grows."""
    params = seq.request.params
    if wants_text(seq, tokenizer) and (params.stop or seq.request.stream):
        seq.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                                 prompt_ids=seq.prompt_ids)


def append_token(seq: Sequence, token: int) -> bool:
    """Record one sampled token; True when the completion is finished (reason set on `seq`).

    Stop tokens (EOS, stop_token_ids) and stop strings count only once min_tokens are out (the
    sampler also masks stop tokens before that)."""
    params = seq.request.params
    seq.token_ids.append(token)
    seq.num_tokens += 1
    n = len(seq.token_ids)
    if n >= params.min_tokens and token in seq.stop_ids:
        seq.finish_reason = "stop"
        # vLLM: EOS leaves stop_reason None; a stop_token_ids hit records the id.
        seq.stop_reason = token if token in params.stop_token_ids else None
        return True
    if seq.detokenizer is not None:
        before = len(seq.text)
        seq.text += seq.detokenizer.append([token])
        if params.stop and n >= params.min_tokens:
            hit = find_stop(seq.text, params.stop, before)
            if hit is not None:
                pos, s = hit
                seq.finish_reason, seq.stop_reason = "stop", s
                seq.text = seq.text[:pos + len(s)] if params.include_stop_str_in_output else seq.text[:pos]
                seq.detokenizer = None
                return True
    if n >= seq.max_tokens:
        seq.finish_reason = "length"
        return True
    return False


def finalize_text(seq: Sequence, tokenizer: Tokenizer | None) -> None:
    """The finished completion's text: one decode of its tokens (a stop token's text is cut unless
    include_stop_str_in_output; a stop string already cut the text)."""
    params = seq.request.params
    seq.detokenizer = None
    if not wants_text(seq, tokenizer) or isinstance(seq.stop_reason, str):
        return
    ids = seq.token_ids
    if seq.finish_reason == "stop" and ids and ids[-1] in seq.stop_ids and not params.include_stop_str_in_output:
        ids = ids[:-1]
    seq.text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


def logprobs_entry(top_values: Seq[float], top_ids: Seq[int], token_id: int | None, token_logprob: float,
                   token_rank: int, tokenizer: Tokenizer | None) -> dict[int, Logprob]:
    """token id -> Logprob for one position: `token_id` (sampled or actual prompt token, with its true
    rank) first, then the top-K with ranks 1..K."""
    def decoded(t: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)

    out: dict[int, Logprob] = {}
    if token_id is not None:
        out[token_id] = Logprob(token_logprob, token_rank, decoded(token_id))
    for rank, (lp, t) in enumerate(zip(top_values, top_ids), 1):
        if t not in out:
            out[t] = Logprob(lp, rank, decoded(t))
    return out


def advance_constraint(seq: Sequence, token: int, stopped: bool) -> bool:
    """Feed the completion's constraint its new token; whether the completion stops now (a grammar
    that is complete ends it with "stop", its stop token even with ignore_eos)."""
    done = seq.request.constraint.processor.advance([seq.constraint_state], [token])[0]
    if done and not stopped:
        seq.finish_reason, seq.stop_reason = "stop", None
        return True
    return stopped
