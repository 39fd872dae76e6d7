"""One completion being generated: its tokens, how many of them the state cache holds, and its
status. Plain Python (the scheduler reads these; it never touches tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from .output_processor import CompletionState, Request


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    completion: CompletionState
    max_tokens: int                       # output tokens allowed (params and max_model_len)
    want_prompt_logprobs: bool = False
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0                 # positions scheduled into the cache (next position)
    num_pending: int = 0                  # tokens being sampled by steps not yet post-processed
    slot: int = -1                        # state slot while resident (-1: none)
    block_table: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def ready(self) -> bool:
        """False while the request's constraint (e.g. its grammar) is still being prepared."""
        c = self.request.constraint
        return c is None or c.ready()

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.completion.token_ids)

    @property
    def num_outputs_scheduled(self) -> int:
        """Output tokens known plus those still being sampled."""
        return len(self.completion.token_ids) + self.num_pending

    @property
    def max_total_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + self.max_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt, out = self.request.prompt_token_ids, self.completion.token_ids
        return (prompt + out)[start:end] if end > len(prompt) else prompt[start:end]
