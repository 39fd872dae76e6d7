"""Continuous batching: FCFS admission, chunked prefill under a token budget, prefill and decode
mixed in one step, `max_num_seqs`, and preemption by recompute when the state cache is full.

The scheduler only decides *which tokens of which sequences* run next; it never touches tensors.
Cache capacity is counted in logical blocks of `block_size` token positions (one block size for
every layer kind: a block holds 32 CSA rows, 32 indexer keys and 1 HCA row of every layer).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_blocks: int | None = None          # None = unbounded cache
    block_size: int = 128


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int                             # first position fed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its last row produces a new token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class BlockManager:
    """Counts logical blocks per sequence; exact: held blocks = ceil(cached tokens / block_size)."""

    def __init__(self, num_blocks: int | None, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held: dict[int, int] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def num_used(self) -> int:
        return sum(self.held.values())

    @property
    def num_free(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks - self.num_used

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        if self.num_blocks is None:
            return True
        extra = self.blocks_for(num_tokens) - self.held.get(seq.seq_id, 0)
        return extra <= self.num_free

    def hold(self, seq: Sequence, num_tokens: int) -> None:
        self.held[seq.seq_id] = max(self.held.get(seq.seq_id, 0), self.blocks_for(num_tokens))

    def free(self, seq: Sequence) -> None:
        self.held.pop(seq.seq_id, None)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def check_fits(self, seq: Sequence) -> None:
        """A sequence that could never fit alone would wait forever: refuse it at submission."""
        need = self.blocks.blocks_for(seq.max_total_tokens)
        if self.config.num_blocks is not None and need > self.config.num_blocks:
            raise ValueError(f"request {seq.request.request_id}: prompt + max_tokens = {seq.max_total_tokens} "
                             f"tokens need {need} cache blocks but the cache has {self.config.num_blocks}; "
                             f"lower max_tokens or raise the cache budget")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.config.max_num_batched_tokens
        for seq in list(self.running):            # running first, oldest first (FCFS)
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue                           # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.can_hold(seq, seq.num_computed + n):
                victim = self.running[-1]          # the newest running sequence makes room
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.blocks.hold(seq, seq.num_computed + n)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.can_hold(seq, seq.num_computed + n):
                break                              # admission never preempts
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.blocks.hold(seq, seq.num_computed + n)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)
        self.running.remove(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: drop the cached state; prompt + outputs so far are re-prefilled."""
        self.num_preemptions += 1
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed = SeqStatus.WAITING, 0
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.chunks[:] = [c for c in out.chunks if c.seq is not seq]
