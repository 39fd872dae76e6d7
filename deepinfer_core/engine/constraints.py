"""Request constraints: the interface between the engine and a `deepinfer_logits_processors` plugin.

A processor claims requests by their SamplingParams (structured outputs claim `so_args`). At
submission (`LLM.generate`, host) it validates the request, raising a ValueError that names the
problem, and starts any slow preparation off the step loop (grammar compilation); it returns a
`RequestConstraint`. The scheduler admits a sequence only once its constraint is ready, so a slow
grammar never holds up the other requests; the engine refuses a request whose preparation failed
or timed out. Each completion then gets its own state (`new_state`), which the step executor
creates and advances on the device side of the step: `mask` edits the sampled rows' logits in
place before logprobs and sampling, `advance` feeds each state its sampled token.

Everything here is resolved once per request or called once per step for the whole batch; nothing
calls pluggy on the per-token path.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RequestConstraint(Protocol):
    """One request's prepared constraint (e.g. its compiled grammar, maybe still compiling)."""

    processor: LogitsProcessor

    def ready(self) -> bool:
        """True once states can be made (cheap: the scheduler asks every step)."""

    def error(self) -> str | None:
        """Why this constraint can never become ready (compile error, timeout), else None."""

    def wait(self, timeout: float) -> None:
        """Block until ready or failed, or until `timeout` seconds have passed."""

    def new_state(self, params: Any, eos_token_id: int | None) -> Any:
        """A fresh per-completion state (after `ready()`)."""


@runtime_checkable
class LogitsProcessor(Protocol):
    """What `deepinfer_logits_processors` returns: one object serving every request it claims."""

    name: str

    def claims(self, params: Any) -> bool:
        """Whether this processor constrains a request with these SamplingParams."""

    def prepare(self, params: Any, *, tokenizer: Any, vocab_size: int,
                eos_token_id: int | None) -> RequestConstraint:
        """Validate the request (ValueError naming the field) and start its preparation."""

    def mask(self, logits: Any, rows: Sequence[int], states: Sequence[Any]) -> None:
        """Mask `logits[rows[i]]` in place by `states[i]` (disallowed tokens -> -inf)."""

    def advance(self, states: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        """Feed each state its sampled token; True where the constraint is complete, which ends
        that completion with finish_reason "stop"."""

    # Optional, for speculative decoding (a processor without it keeps its requests from drafting):
    # def mask_drafts(self, logits, first_rows, states, drafts) -> list[int]:
    #     """Mask request i's verify rows first_rows[i] .. + len(drafts[i]) in place: row + j by the
    #     state after drafts[i][:j], leaving the state as it was; returns how many drafts each allows."""


def drafts_under(processor: LogitsProcessor) -> bool:
    """Whether `processor` can mask speculative verify rows, so its requests may draft."""
    return callable(getattr(processor, "mask_drafts", None))


def attach_constraint(processors: Sequence[LogitsProcessor], params: Any, *, tokenizer: Any,
                      vocab_size: int, eos_token_id: int | None) -> RequestConstraint | None:
    """The constraint of the one processor that claims `params`, or None when none does.

    so_args that no processor claims is an error: dropping it silently would return unconstrained
    text to a user who asked for a grammar."""
    claiming = [p for p in processors if p.claims(params)]
    if len(claiming) > 1:
        raise ValueError(f"generate: several logits processors claim this request "
                         f"({', '.join(p.name for p in claiming)}); disable all but one with "
                         f"DEEPINFER_DISABLE_PLUGINS")
    if claiming:
        return claiming[0].prepare(params, tokenizer=tokenizer, vocab_size=vocab_size,
                                   eos_token_id=eos_token_id)
    if getattr(params, "so_args", None) is not None:
        raise ValueError("SamplingParams: so_args needs the structured-outputs feature, which is not "
                         "active" + _feature_state("structured_outputs")
                         + "; install it with ./build.sh (distribution deepinfer-structured-outputs)")
    return None


def _feature_state(name: str) -> str:
    from ..plugins import get_plugin_manager
    rec = get_plugin_manager().record(name)
    if rec is None:
        return f" (plugin {name!r} is not installed)"
    return f" (plugin {name!r} is {rec.status}{': ' + rec.error if rec.error else ''})"
