"""A replay drafter, for benchmarks only: it proposes the continuation an earlier identical
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
from dataclasses import dataclass, field

import torch

from ..ops.sampler import counter_uniform_tensor
from ..ops.transfer import to_device
from .varlen import cumulative


@dataclass
class ReplayDrafter:
    recorded: dict[tuple[int, ...], list[int]]   # prompt ids -> the output ids of the recorded greedy run
    acceptance: Sequence[float]                  # [k]: the chance draft i is the recorded token
    vocab_size: int
    seed: int = 0
    _runs: dict = field(default_factory=dict, init=False, repr=False)   # (id(prompt), seed) -> (prompt, run, coins)
    _slot_owner: dict = field(default_factory=dict, init=False, repr=False)   # slot -> (id(prompt), seed) uploaded
    _tables: tuple | None = field(default=None, init=False, repr=False)      # device (runs, coins, prompt lens, acceptance)

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
        goes to that + 2, after the token the step adds). Each sequence's coins are drawn once, for
        every position of its run, so the benchmark's host path is the engine's, not this drafter's."""
        k, vocab, acceptance = self.num_drafts, self.vocab_size, self.acceptance
        out = []
        for prompt, seq_seed, last in zip(prompts, seeds, last_positions):
            run, coins = self._run(prompt, seq_seed)
            first = last + 2 - len(prompt)
            drafts = []
            for i in range(k):
                j = first + i
                true = run[j] if 0 <= j < len(run) else 0
                drafts.append(true if coins[j] < acceptance[i] else (true + 1) % vocab)
            out.append(drafts)
        return out

    def propose_on_device(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], slots: list[int],
                          slots_t: torch.Tensor, last_positions: torch.Tensor, num_slots: int) -> torch.Tensor:
        """`propose` [n, k] with the last committed positions on the device (a verdict the host has
        not read): each slot's recorded run and coins are uploaded once per sequence, the drafts
        gathered from them."""
        dev = last_positions.device
        owners = [(id(p), s) for p, s in zip(prompts, seeds)]
        new = [i for i, (slot, o) in enumerate(zip(slots, owners)) if self._slot_owner.get(slot) != o]
        if new:
            runs = [self._run(prompts[i], seeds[i]) for i in new]
            width = max(len(c) for _, c in runs)
            if self._tables is None or self._tables[0].shape[1] < width or self._tables[0].shape[0] < num_slots:
                self._tables = (torch.zeros(num_slots, width, dtype=torch.long, device=dev),
                                torch.zeros(num_slots, width, dtype=torch.float64, device=dev),
                                torch.zeros(num_slots, dtype=torch.long, device=dev),
                                to_device(self.acceptance, torch.float64, dev),
                                to_device(self.cumulative_confidence().tolist(), torch.float32, dev))
                self._slot_owner = {}
                new = list(range(len(slots)))
                runs = [self._run(prompts[i], seeds[i]) for i in new]
            run_t, coin_t, plen_t = self._tables[:3]
            w = run_t.shape[1]
            idx = to_device([slots[i] for i in new], torch.long, dev)
            run_t[idx] = to_device([(r + [0] * w)[:w] for r, _ in runs], torch.long, dev)
            coin_t[idx] = to_device([(c + [0.0] * w)[:w] for _, c in runs], torch.float64, dev)
            plen_t[idx] = to_device([len(prompts[i]) for i in new], torch.long, dev)
            self._slot_owner.update({slots[i]: owners[i] for i in new})
        run_t, coin_t, plen_t, acc_t, _ = self._tables
        j = (last_positions + 2 - plen_t[slots_t])[:, None] + torch.arange(self.num_drafts, device=dev)
        j = j.clamp(max=run_t.shape[1] - 1)
        true = run_t[slots_t].gather(1, j)
        return torch.where(coin_t[slots_t].gather(1, j) < acc_t, true, (true + 1) % self.vocab_size)

    def confidence_on_device(self) -> torch.Tensor:
        """`cumulative_confidence` on the device of `propose_on_device` (after its first call)."""
        return self._tables[4]

    def _run(self, prompt: Sequence[int], seq_seed: int) -> tuple[list[int], list[float]]:
        """The recorded output of `prompt` and the coin of every output position (looked up once per
        prompt object and seed: hashing a long prompt at every step would cost more than drafting)."""
        hit = self._runs.get((id(prompt), seq_seed))
        if hit is not None and hit[0] is prompt:
            return hit[1], hit[2]
        run = self.recorded.get(tuple(prompt))
        if run is None:
            raise KeyError("ReplayDrafter: no recorded run for a prompt of length "
                           f"{len(prompt)}; record every prompt's greedy output first")
        n = len(run) + self.num_drafts + 2          # drafts past the run are fed, never accepted
        coins = counter_uniform_tensor([self.seed ^ seq_seed] * n, range(len(prompt), len(prompt) + n), "cpu",
                                       namespace="draft").tolist()
        self._runs[(id(prompt), seq_seed)] = (prompt, run, coins)
        return run, coins
