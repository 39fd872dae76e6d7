"""The banned-words `LogitsProcessor` (deepinfer_core/engine/constraints.py), what
`deepinfer_logits_processors` returns.

The engine calls it at three points:
  submission  `claims` picks the requests whose extra_args has `banned_...` keys; `prepare`
              validates them (a ValueError refuses the request: LLM.generate raises it, the server
              answers 400) and tokenizes the words once. Nothing is slow, so the constraint is
              ready at once.
  each step   `mask` sets the logits of the banned next tokens of every claimed row to -inf, in
              place, before logprobs, penalties and sampling; `mask_drafts` does the same for the
              verify rows of speculative decoding (so these requests still draft).
  after it    `advance` feeds each completion's state its new token (n > 1: one state each).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from .banned_words import BannedState, BannedTable, parse, requested, token_sequences


class BannedWordsConstraint:
    """One request's RequestConstraint: its token table, ready at once."""

    def __init__(self, processor: BannedWordsProcessor, table: BannedTable):
        self.processor, self.table = processor, table

    def ready(self) -> bool:
        return True

    def error(self) -> str | None:
        return None

    def wait(self, timeout: float) -> None:
        pass

    def new_state(self, params: Any, eos_token_id: int | None) -> BannedState:
        return BannedState(self.table)


class BannedWordsProcessor:
    name = "banned_words"

    # ---- submission (the caller's thread) --------------------------------------------------------
    def claims(self, params: Any) -> bool:
        if not requested(getattr(params, "extra_args", None)):
            return False
        # The engine gives a request one logits processor: with structured outputs as well, one of
        # the two would be dropped silently, so the request is refused instead.
        if getattr(params, "so_args", None) is not None:
            raise ValueError("extra_args.banned_words: cannot be combined with structured "
                             "outputs (so_args, structured_outputs, response_format, guided_*, a "
                             "forced tool call); a request takes one logits processor: drop one "
                             "of them")
        return True

    def prepare(self, params: Any, *, tokenizer: Any, vocab_size: int,
                eos_token_id: int | None) -> BannedWordsConstraint:
        banned = parse(params.extra_args)
        if tokenizer is None:
            raise ValueError("extra_args.banned_words: needs the model's tokenizer (the checkpoint "
                             "has no tokenizer files; pass LLM(tokenizer=...))")
        encode = partial(tokenizer.encode, add_special_tokens=False)
        return BannedWordsConstraint(self, BannedTable(token_sequences(banned, encode, vocab_size)))

    # ---- the step (the engine's executor) --------------------------------------------------------
    def mask(self, logits: torch.Tensor, rows: Sequence[int],
             states: Sequence[BannedState]) -> None:
        _set_minus_inf(logits, [(r, t) for r, s in zip(rows, states) for t in s.banned()])

    def mask_drafts(self, logits: torch.Tensor, first_rows: Sequence[int],
                    states: Sequence[BannedState], drafts: Sequence[Sequence[int]]) -> list[int]:
        """Request i's verify row first_rows[i] + j gets the mask of its state after drafts[i][:j];
        a banned draft is refused with every draft after it (the rows past it stay unmasked: a
        verifier never reads them). Returns how many drafts each request allows."""
        allowed, pairs = [], []
        for first, state, ids in zip(first_rows, states, drafts):
            rows, n = state.draft_masks([int(t) for t in ids])
            allowed.append(n)
            pairs += [(first + j, t) for j, banned in enumerate(rows) for t in banned]
        _set_minus_inf(logits, pairs)
        return allowed

    def advance(self, states: Sequence[BannedState], tokens: Sequence[int]) -> list[bool]:
        for state, token in zip(states, tokens):
            state.accept(int(token))
        return [False] * len(states)      # never complete: the completion ends as it would anyway


def _set_minus_inf(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """logits[row, token] = -inf for each (row, token), in one indexed write on the logits' device
    (the indices are staged in pinned memory on an accelerator, so the host does not wait)."""
    if not pairs:
        return
    index = torch.tensor(pairs, dtype=torch.long).T
    if logits.device.type != "cpu":
        index = index.contiguous().pin_memory().to(logits.device, non_blocking=True)
    logits[index[0], index[1]] = float("-inf")
