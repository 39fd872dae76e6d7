"""Continuous batching: FCFS admission, chunked prefill under a token budget, prefill and decode
mixed in one step, `max_num_seqs`, and preemption by recompute when the state cache is full.

The scheduler only decides *which tokens of which sequences* run next and which slot and blocks of
the state cache they own; it never touches tensors. Capacity is counted in the allocator's real
slots and blocks (one logical block size for every layer kind: 128 positions).

Asynchronous scheduling: step N+1 may be planned before step N's tokens are known. A sequence then
has `num_pending` tokens in flight; its next chunk feeds the pending token (the executor resolves it
on the device side), and it is not scheduled past its max_tokens.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ..cache.block_allocator import BlockAllocator
from .sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 128


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int                             # first position fed this step
    num_tokens: int
    samples: bool                          # reaches the last token, so its last row samples a new one
    block_ids: tuple[int, ...] = ()        # snapshot of the sequence's block table for this step


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class BlockManager:
    """Gives sequences a state slot and enough blocks; exact: a resident sequence holds
    ceil(scheduled positions / block_size) blocks and one slot."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_used(self) -> int:
        return self.allocator.num_used_blocks

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.slot < 0 and self.allocator.num_free_slots == 0:
            return False
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.allocator.num_free_blocks

    def hold(self, seq: Sequence, num_tokens: int) -> None:
        if seq.slot < 0:
            seq.slot = self.allocator.allocate_slot()
        extra = self.blocks_for(num_tokens) - len(seq.block_table)
        if extra > 0:
            seq.block_table.extend(self.allocator.allocate_blocks(extra))

    def free(self, seq: Sequence) -> None:
        self.allocator.free_blocks(seq.block_table)
        seq.block_table = []
        if seq.slot >= 0:
            self.allocator.free_slot(seq.slot)
            seq.slot = -1


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator):
        self.config = config
        self.blocks = BlockManager(allocator, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def check_fits(self, seq: Sequence) -> None:
        """A sequence that could never fit alone would wait forever: refuse it at submission."""
        need = self.blocks.blocks_for(seq.max_total_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request {seq.request.request_id}: prompt + max_tokens = {seq.max_total_tokens} "
                             f"tokens need {need} cache blocks but the cache has {self.blocks.num_blocks}; "
                             f"lower max_tokens or raise the cache budget")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unready(self) -> list[Sequence]:
        """Waiting sequences whose constraint is still being prepared (or failed)."""
        return [s for s in self.waiting if not s.ready]

    def _next_chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` can feed now: everything up to its newest (possibly pending) token; none
        once its in-flight tokens already reach max_tokens."""
        if seq.num_pending and seq.num_outputs_scheduled >= seq.max_tokens:
            return 0
        return min(seq.num_tokens + seq.num_pending - seq.num_computed, budget)

    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.config.max_num_batched_tokens
        planned: list[tuple[Sequence, int]] = []
        for seq in list(self.running):            # running first, oldest first (FCFS)
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue                           # preempted earlier in this loop
            n = self._next_chunk(seq, budget)
            if n <= 0:
                continue
            while not self.blocks.can_hold(seq, seq.num_computed + n):
                victim = self.running[-1]          # the newest running sequence makes room
                self._preempt(victim, out)
                planned = [(s, k) for s, k in planned if s is not victim]
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.blocks.hold(seq, seq.num_computed + n)
            planned.append((seq, n))
            budget -= n
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not seq.ready:
                continue                           # its grammar is still compiling: the others go first
            if seq.num_pending:
                break                              # preempted while a token was in flight: wait for it
            n = self._next_chunk(seq, budget)
            if not self.blocks.can_hold(seq, seq.num_computed + n):
                break                              # admission never preempts
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.blocks.hold(seq, seq.num_computed + n)
            planned.append((seq, n))
            budget -= n
        for seq, n in planned:
            samples = seq.num_computed + n == seq.num_tokens + seq.num_pending
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n, samples, tuple(seq.block_table)))
            seq.num_computed += n
            seq.num_pending += int(samples)
        return out

    def finish(self, seq: Sequence) -> None:
        """Done (stop, length or abort): free its slot and blocks, whether running or waiting."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: drop the cached state; prompt + outputs so far are re-prefilled."""
        self.num_preemptions += 1
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed = SeqStatus.WAITING, 0
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
