"""Confidence-scheduled verification (`DEEPINFER_ENABLE_MTP_VARLEN=1`, DSpark's hardware-aware
prefix scheduler): how many of its drafts each request verifies this step, from the drafter's
confidences and the measured time of a verify step.

Objective (the DSpark paper's): maximise expected committed tokens per millisecond, `tau / time`,
where a request verifying l drafts commits `1 + sum_{j<=l} a_j` tokens in expectation,
`a_j = c_1 * ... * c_j` its cumulative confidence (the chance drafts 1..j all pass).

Cost model: our verify steps replay one CUDA graph per (batch bucket, rows per sequence), so every
sequence of a step feeds the same number of rows, `1 + L` (a request that may accept fewer drafts,
e.g. near max_tokens, still feeds L and its extra rows are dropped like rejected ones). A step's
time is therefore `time(batch, 1 + L)` whatever the per-request lengths, and once L rows are paid for
every request verifies up to L. Under that cost, Algorithm 1 of the paper (the global greedy order
of (request, j) by a, stopping at the first entry that does not raise tau / time) reduces to raising
one common L while tau / time rises, where raising L to l adds `sum_r a_{r,l}`.

Lossless: the early stop is the causality barrier. Whether L reaches j (whether x_{r,j} is
verified) is decided from the a_{r,i} with i <= j, which depend on x_{r,1..j-1} only, never on
x_{r,j} itself; a look-ahead over larger L would let x_{r,j}'s value decide its own verification
(the paper's counter-example, App. A). Verification lengths then follow the load, so a seeded
request's tokens may differ between runs (the distribution does not): batch invariance refuses it.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepTimes:
    """Measured milliseconds of one verify step per (batch bucket, rows per sequence)."""

    buckets: tuple[int, ...]                  # batch sizes profiled, ascending
    max_rows: int                             # rows per sequence profiled: 1..max_rows
    ms: tuple[tuple[float, ...], ...]         # ms[b][q - 1]: bucket buckets[b], q rows per sequence

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(self.buckets):
            raise ValueError(f"StepTimes: buckets must be ascending, got {self.buckets}")
        if len(self.ms) != len(self.buckets) or any(len(row) != self.max_rows for row in self.ms):
            raise ValueError(f"StepTimes: expected {len(self.buckets)} x {self.max_rows} times")
        if any(t <= 0 for row in self.ms for t in row):
            raise ValueError("StepTimes: every time must be > 0 ms")

    def time(self, num_seqs: int, rows: int) -> float:
        """ms of a step of `num_seqs` sequences feeding `rows` rows each: the smallest profiled
        bucket that holds them (graph replays pad to it); past the last, scaled linearly."""
        row = min(rows, self.max_rows) - 1
        for b, times in zip(self.buckets, self.ms):
            if b >= num_seqs:
                return times[row]
        return self.ms[-1][row] * num_seqs / self.buckets[-1]

    def table(self) -> list[dict]:
        """Rows for printing and JSON: batch, rows per sequence, ms, rows per ms."""
        return [{"batch": b, "rows_per_seq": q + 1, "ms": round(t, 4), "rows_per_ms": round(b * (q + 1) / t, 1)}
                for b, times in zip(self.buckets, self.ms) for q, t in enumerate(times)]


def cumulative(confidences: Sequence[float]) -> list[float]:
    """a_j = c_1 * ... * c_j, clamped to [0, 1]."""
    out, a = [], 1.0
    for c in confidences:
        a *= min(1.0, max(0.0, float(c)))
        out.append(a)
    return out


def choose_length(cumulative_confidences: Sequence[Sequence[float]], times: StepTimes, max_drafts: int) -> int:
    """The common number of drafts L (0..max_drafts) the step's sequences verify: raise L while the
    expected committed tokens per ms rise, stop at the first that does not (module doc)."""
    n = len(cumulative_confidences)
    if n == 0:
        return 0
    expected = float(n)
    best = expected / times.time(n, 1)
    length = 0
    for j in range(max_drafts):
        gain = sum(a[j] for a in cumulative_confidences if j < len(a))
        if gain <= 0.0:
            break
        expected += gain
        score = expected / times.time(n, j + 2)
        if score <= best:
            break
        best, length = score, j + 1
    return length


@dataclass
class VarlenPolicy:
    """The scheduler's `draft_length`: the step-time table profiled at start-up, which the choice
    reads as is. A speculative step's wall time is the table's times a factor (host work,
    verification, drafting): on the H200 benchmark (`benchmarks/spec_replay.py`) 1.3-1.5x at every
    batch and length, from 1 to 256 requests, and tokens per ms keep their order under a common
    factor, so the choice does not depend on it; `scale` (the median measured / table ratio of
    recent steps) is reported. Two additive corrections were tried and dropped: a constant per step
    (the median gap, a simplified form of DS-DeepInfer's online correction) made long verification
    look cheap and lost a fifth of the throughput at 256 requests and acceptance 0.6 (lengths 2-3
    against the best static 1); DS-DeepInfer's per-row slope, measured on synchronous steps, drove
    the length to 0-1 and lost up to a third there."""

    times: StepTimes
    max_drafts: int
    window: int = 64                          # recent steps whose ratios make `scale`
    _ratios: deque = field(init=False, repr=False)
    scale: float = field(default=1.0, init=False)
    chosen: list[int] = field(default_factory=list, init=False)     # histogram of chosen L

    def __post_init__(self) -> None:
        self.chosen = [0] * (self.max_drafts + 1)
        self._ratios = deque(maxlen=self.window)

    def __call__(self, cumulative_confidences: list[list[float]]) -> int:
        length = choose_length(cumulative_confidences, self.times, self.max_drafts)
        self.chosen[length] += 1
        return length

    def observe(self, num_seqs: int, rows: int, measured_ms: float) -> None:
        """One speculative step's wall time (verify chunks of `rows` rows each)."""
        self._ratios.append(measured_ms / self.times.time(num_seqs, rows))
        self.scale = statistics.median(self._ratios)
