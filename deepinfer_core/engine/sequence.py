"""One completion being generated: the single host-side record of everything the engine knows about
it: scheduling facts (status, one position counter, one slot, its blocks), the output so far, and
its per-completion constraint state. Plain Python: the scheduler and the output processor read it,
the device side never does (it keeps only tensors indexed by slot).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from ..api.outputs import CompletionOutput, Logprob, RequestMetrics
from ..api.sampling_params import SamplingParams
from ..ops.sampler import GREEDY_EPS
from .constraints import drafts_under


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


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
    stream: bool = True                # step() reports deltas (text decoded as it grows); else final only
    cache_salt: str | None = None      # prefix caching: only requests with the same salt share a prefix
    prompt_filler: Any = None          # prefix caching, n > 1: the completion computing the prompt
                                       # its siblings wait for, to share it


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    request: Request
    index: int                            # completion index within its request
    seed: int
    max_tokens: int                       # output tokens allowed (params and max_model_len)
    stop_ids: frozenset[int] = frozenset()   # EOS (unless ignore_eos) + stop_token_ids, resolved once
    want_prompt_logprobs: bool = False
    # ---- scheduling (the scheduler's) ----
    status: SeqStatus = SeqStatus.WAITING
    num_tokens: int = 0                   # prompt + known outputs (set from the prompt at creation)
    num_computed: int = 0                 # positions scheduled into the cache (= next position)
    num_pending: int = 0                  # tokens being sampled by steps not yet post-processed
    slot: int = -1                        # state slot while resident (-1: none)
    block_ids: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)   # drafts for the next verify step (speculation)
    draft_conf: list[float] = field(default_factory=list)  # their cumulative confidences (VARLEN)
    draft_source: Any = None              # (step, row) whose host copy holds the drafts while draft_ids
                                          # are still the device codes that name them (engine._host_drafts)
    # ---- prefix caching (cache/prefix_cache.py) ----
    first_start: int = 0                  # where its prefill starts when (re)admitted: 0 or its hit
    num_cached_tokens: int = -1           # the first admission's hit (-1: not admitted yet)
    prefix_nodes: list = field(default_factory=list)    # cached blocks it holds, from the first
    block_hashes: list = field(default_factory=list)    # chain keys of its whole blocks so far
    cuts: list[int] = field(default_factory=list)       # kept boundaries its prefill still reaches
    decode_checkpoint: Any = None         # the newest checkpoint it took while decoding
    unnamed_checkpoint: Any = None        # (position, slot, decoding): copied, its tokens in flight
    # ---- output (the output processor's) ----
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None
    detokenizer: Any = None               # IncrementalDetokenizer while text is needed per step
    constraint_state: Any = None          # this completion's matcher (structured outputs)
    num_reported: int = 0                 # tokens already returned by Engine.step (deltas)
    text_reported: int = 0                # characters of `text` already returned

    # ---- facts of the params, resolved once (the step loop reads them for every row) ----
    params: SamplingParams | None = None
    penalised: bool = False               # repetition / presence / frequency penalty
    may_draft: bool = True                # speculation: its constraint (if any) can mask verify rows
    min_tokens: int = 0
    wants_logprobs: bool = False
    verifies_on_device: bool = False      # greedy, no penalty, grammar or logprobs: a verdict the host
                                          # need not see before the next step (device_verdict.py)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.request.prompt_token_ids) + len(self.token_ids)
        p = self.params = self.request.params
        self.penalised = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self.min_tokens = p.min_tokens
        cons = self.request.constraint
        self.may_draft = cons is None or drafts_under(cons.processor)
        self.wants_logprobs = p.logprobs is not None
        self.verifies_on_device = (p.temperature < GREEDY_EPS and not self.penalised and cons is None
                                   and not self.wants_logprobs)

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def ready(self) -> bool:
        """False while the request's constraint (e.g. its grammar) is still being prepared."""
        c = self.request.constraint
        return c is None or c.ready()

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def num_outputs_scheduled(self) -> int:
        """Output tokens known plus those still being sampled."""
        return len(self.token_ids) + self.num_pending

    @property
    def max_total_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + self.max_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt = self.request.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        p = len(prompt)
        return prompt[start:] + self.token_ids[max(0, start - p):end - p]

    def to_output(self, delta: bool = False) -> CompletionOutput:
        """The completion so far, or (delta) what was not reported yet; marks it reported."""
        if not delta:
            return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                    None if self.logprobs is None else list(self.logprobs),
                                    self.finish_reason, self.stop_reason)
        n, t = self.num_reported, self.text_reported
        self.num_reported, self.text_reported = len(self.token_ids), len(self.text)
        return CompletionOutput(self.index, self.text[t:], self.token_ids[n:], self.cumulative_logprob,
                                None if self.logprobs is None else self.logprobs[n:],
                                self.finish_reason, self.stop_reason)
