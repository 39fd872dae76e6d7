"""A replay drafter, for benchmarks only (issue 17): it proposes the continuation an earlier identical
greedy run produced, each draft right with a chosen probability per draft position (else a token the
target will reject), so speculative decoding's own cost and speed-up can be measured on a model whose
drafter accepts nothing (random weights, e.g. the V4-Flash-width dummy model) at the acceptance a real
drafter would reach. Drafting costs no device work.

With per-position probabilities a_1..a_k, a verify step accepts draft i with probability a_i given
that drafts 1..i-1 were accepted (a greedy target reproduces the recorded run). Each coin is a
counter-based uniform of (seed, the sequence's seed, the draft's position), so a run is reproducible.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.sampler import counter_uniform
from .varlen import cumulative


@dataclass
class ReplayDrafter:
    recorded: dict[tuple[int, ...], list[int]]   # prompt ids -> the output ids of the recorded greedy run
    acceptance: Sequence[float]                  # [k]: the chance draft i is the recorded token
    vocab_size: int
    seed: int = 0

    @property
    def num_drafts(self) -> int:
        return len(self.acceptance)

    def __post_init__(self) -> None:
        if not self.acceptance or not all(0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"ReplayDrafter: acceptance must be k >= 1 probabilities in [0, 1], "
                             f"got {list(self.acceptance)}")

    def cumulative_confidence(self) -> torch.Tensor:
        """[k] the chance drafts 1..j all pass: exact confidences, for VARLEN scheduling."""
        return torch.tensor(cumulative(self.acceptance), dtype=torch.float32)

    def propose(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                last_positions: Sequence[int]) -> list[list[int]]:
        """k drafts per sequence whose last committed position is `last_positions[i]` (its first draft
        goes to that + 2, after the token the step adds)."""
        out = []
        for prompt, seq_seed, last in zip(prompts, seeds, last_positions):
            run = self.recorded.get(tuple(prompt))
            if run is None:
                raise KeyError("ReplayDrafter: no recorded run for a prompt of length "
                               f"{len(prompt)}; record every prompt's greedy output first")
            drafts = []
            for i, a in enumerate(self.acceptance):
                pos = last + 2 + i
                j = pos - len(prompt)
                true = run[j] if 0 <= j < len(run) else 0
                right = counter_uniform(self.seed ^ seq_seed, pos, namespace="draft") < a
                drafts.append(true if right else (true + 1) % self.vocab_size)
            out.append(drafts)
        return out
