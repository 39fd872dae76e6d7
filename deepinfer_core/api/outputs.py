"""Request outputs with vLLM-compatible field names.

Logprobs layout (vLLM): `CompletionOutput.logprobs` is a list with one dict per generated token,
mapping token id -> `Logprob`; it holds the top-K tokens (rank 1..K) plus the sampled token with its
true rank when it is not among them. `RequestOutput.prompt_logprobs` has one entry per prompt token,
`None` for the first (nothing predicts it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# Request timestamps are epoch seconds read off the monotonic clock: they line up with time.time()
# as it was when the process started, but a wall-clock step (NTP, a VM's clock sync) in the middle
# of a request cannot make a latency negative or longer than the run that held it.
_EPOCH_AT_START = time.time() - time.perf_counter()


def timestamp() -> float:
    """Now, in epoch seconds on the monotonic clock (the clock of every RequestMetrics field)."""
    return _EPOCH_AT_START + time.perf_counter()


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None            # 1 = most likely token
    decoded_token: str | None = None   # None when not detokenising


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None   # None unless logprobs were requested
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None   # "stop" | "length" | None while running
    stop_reason: int | str | None = None   # the stop token id or stop string that matched (not EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpecMetrics:
    """Speculative decoding counts: one request's (all its completions) or the engine's (all requests)."""

    num_steps: int = 0                 # verify steps
    num_drafted_tokens: int = 0        # drafts the drafter proposed
    num_verified_tokens: int = 0       # drafts the target verified (fewer near max_tokens or min_tokens)
    num_accepted_tokens: int = 0       # drafts accepted
    accepted_per_position: list[int] = field(default_factory=list)   # [i]: steps that accepted draft i

    @property
    def acceptance_length(self) -> float | None:
        """tau: tokens committed per verify step (the accepted drafts + the one verification adds)."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else None

    def per_position(self) -> list[float]:
        """The fraction of verify steps that accepted draft i."""
        return [a / max(self.num_steps, 1) for a in self.accepted_per_position]

    def record(self, verified: int, accepted: int) -> None:
        """One verify step of `verified` drafts that accepted the first `accepted`."""
        self.num_steps += 1
        self.num_verified_tokens += verified
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < verified:
            self.accepted_per_position.extend([0] * (verified - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


@dataclass
class RequestMetrics:
    """Timestamps (`timestamp()`: epoch seconds, monotonic) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # one per generated token, all completions
    spec: SpecMetrics | None = None    # speculative decoding counts (None: the request did not draft)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0         # prefix-cache hits (no prefix cache yet)


class InvalidRequestError(ValueError):
    """Some requests of a generate call were invalid; the valid ones completed (`outputs`, with None
    at the invalid indices); `errors` maps each invalid index to its ValueError."""

    def __init__(self, errors: dict[int, ValueError], outputs: list):
        self.errors, self.outputs = errors, outputs
        lines = "; ".join(f"request {i}: {e}" for i, e in sorted(errors.items()))
        done = len(outputs) - len(errors)
        rest = (f"the other {done} completed: their RequestOutputs are in this error's .outputs (None at "
                f"the invalid indices)" if done else "none completed")
        noun = "request" if len(outputs) == 1 else "requests"
        super().__init__(f"generate: {len(errors)} of {len(outputs)} {noun} invalid ({lines}); {rest}")
