"""One completion's structured-output state: the trigger/bound phases and the grammar matcher.

Phases:
  free     no trigger seen yet: any token; the trigger is tracked with a prefix function (KMP), so an
           interrupted partial trigger falls back correctly
  forcing  the bound token was sampled: only the next trigger token is allowed, one per step
  grammar  the trigger is complete (or there is none): xgrammar's matcher decides the mask
  done     the grammar accepted its stop token (or ended, when no stop token exists)

Every accepted token leaves an undo record, so `rollback(n)` restores any earlier state exactly;
`fill_draft_masks` builds the masks of a run of speculative tokens and rolls back afterwards, as a
verifier needs them.
"""
from __future__ import annotations

from typing import Any

import torch

FREE, FORCING, GRAMMAR, DONE = "free", "forcing", "grammar", "done"


def prefix_function(seq: tuple[int, ...]) -> list[int]:
    """pi[i] = length of the longest proper prefix of seq[:i+1] that is also its suffix."""
    pi = [0] * len(seq)
    for i in range(1, len(seq)):
        k = pi[i - 1]
        while k and seq[i] != seq[k]:
            k = pi[k - 1]
        pi[i] = k + (seq[i] == seq[k])
    return pi


def set_single_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Row `row` of an xgrammar bitmask allows exactly `token` (int32 words, bit i of word w = id 32w+i)."""
    bitmask[row].zero_()
    bit = token % 32
    bitmask[row, token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)


class ConstraintState:
    def __init__(self, compiled: Any, so: Any, stop_token_ids: set[int]):
        self.compiled = compiled
        self.trigger: tuple[int, ...] = tuple(so.trigger_token_ids)
        self.bound: int | None = so.bound_token_id
        self.stop_token_ids = sorted(stop_token_ids)
        self._pi = prefix_function(self.trigger)
        self.matched = 0                       # trigger tokens matched by the newest outputs
        self.phase = FREE if self.trigger else GRAMMAR
        self.matcher = self._new_matcher() if self.phase == GRAMMAR else None
        self._history: list[tuple[str, int, bool]] = []   # (phase, matched, fed the matcher) before each token

    def _new_matcher(self):
        import xgrammar as xgr
        return xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids or None,
                                  terminate_without_stop_token=not self.stop_token_ids)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def constrains(self) -> bool:
        """Whether the next token is masked at all."""
        return self.phase in (FORCING, GRAMMAR)

    @property
    def done(self) -> bool:
        return self.phase == DONE

    @property
    def forced_token(self) -> int | None:
        return self.trigger[self.matched] if self.phase == FORCING else None

    def describe(self) -> str:
        return f"phase {self.phase}, trigger {self.matched}/{len(self.trigger)} matched"

    # ---- transitions ---------------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the mask forbade it."""
        record = (self.phase, self.matched, False)
        if self.phase == GRAMMAR:
            if not self.matcher.accept_token(int(token)):
                return False
            record = (GRAMMAR, self.matched, True)
            if self.matcher.is_terminated():
                self.phase = DONE
        elif self.phase == FORCING:
            if token != self.trigger[self.matched]:
                return False
            self.matched += 1
            if self.matched == len(self.trigger):
                self._start_grammar()
        elif self.phase == FREE:
            self.matched = self._advance_trigger(self.matched, token)
            if self.matched == len(self.trigger):
                self._start_grammar()
            elif token == self.bound:
                self.phase = FORCING
        self._history.append(record)       # a token after "done" is recorded too (and dropped by the engine)
        return True

    def _advance_trigger(self, k: int, token: int) -> int:
        while k and token != self.trigger[k]:
            k = self._pi[k - 1]
        return k + (token == self.trigger[k])

    def _start_grammar(self) -> None:
        self.phase = GRAMMAR
        if self.matcher is None:
            self.matcher = self._new_matcher()
        else:
            self.matcher.reset()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"rollback({num_tokens}): only {len(self._history)} tokens were accepted")
        if num_tokens == 0:
            return
        popped = [self._history.pop() for _ in range(num_tokens)]
        fed = sum(r[2] for r in popped)
        self.phase, self.matched, _ = popped[-1]           # the state before the earliest undone token
        if self.phase in (GRAMMAR, DONE):
            if fed:
                self.matcher.rollback(fed)
        else:
            self.matcher = None                            # the grammar starts afresh with the trigger

    # ---- masks ---------------------------------------------------------------------------------
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` for the next token (all allowed when nothing constrains it)."""
        if self.phase == GRAMMAR:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        elif self.phase == FORCING:
            set_single_token(bitmask, row, self.forced_token)
        else:
            bitmask[row].fill_(-1)

    def fill_draft_masks(self, draft_tokens: list[int], bitmask: torch.Tensor, first_row: int = 0) -> int:
        """Masks for verifying `draft_tokens`: row first_row+i holds the mask of the token after the
        first i drafts. Stops at the first draft the constraint refuses (later rows: all allowed,
        a verifier never reads them); returns how many drafts it accepted. The state is unchanged
        afterwards (the accepted drafts are rolled back)."""
        accepted = 0
        for i in range(len(draft_tokens) + 1):
            self.fill(bitmask, first_row + i)
            if i == len(draft_tokens) or not self.accept(draft_tokens[i]):
                break
            accepted += 1
        bitmask[first_row + accepted + 1:first_row + len(draft_tokens) + 1].fill_(-1)
        self.rollback(accepted)
        return accepted
