"""Continuous batching: admission in the scheduling policy's order (first come, first served by
default; a plugin may offer another through `deepinfer_scheduler_policy`), chunked prefill under a token budget, prefill and decode
mixed in one step, `max_num_seqs`, and preemption by recompute when the state cache is full.

The scheduler decides *which tokens of which sequences* run next and which slot and blocks of the
state cache they own; it never touches tensors. Capacity is counted in the allocator's real slots
and blocks (one logical block size for every layer kind: 128 positions). What changed in the cache
since the last step (newly bound slots, blocks appended to a sequence's table) is recorded in
`CacheUpdates`, which the device side applies to its persistent per-slot tables in one go.

Asynchronous scheduling: step N+1 may be planned before step N's tokens are known. A sequence then
has `num_pending` tokens in flight; its next chunk feeds the pending token (the device takes it
from its own record of the last sampled token), and it is not scheduled past its max_tokens. A
sequence whose next step needs host knowledge of its last token (a grammar's mask) waits for it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..cache.block_allocator import BlockAllocator
from ..cache.prefix_cache import PrefixCache
from .sequence import Request, SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 128
    max_model_len: int | None = None       # positions a block table holds (verify rows fed for shape)


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int                             # first position fed this step
    num_tokens: int
    samples: bool                          # reaches the last token, so its last row samples a new one
    num_drafts: int = 0                    # a verify chunk: [last token, its first num_drafts drafts]
    max_accept: int = 0                    # drafts it may accept (<= num_drafts: fewer near max_tokens;
                                           # the other rows keep the step's graph shape, dropped as rejected)
    drafts: list[int] | tuple = ()         # the drafts it verifies (the sequence's own may be replaced
                                           # by newer ones before this step is post-processed)


@dataclass
class CacheUpdates:
    """Changes to the slot/block bookkeeping since the last step, for the device-side tables."""

    bound_slots: list[int] = field(default_factory=list)        # fresh owners: reset their state
    table_writes: list[tuple[int, int, int]] = field(default_factory=list)   # (slot, column, block)
    # prefix caching, (source slot, destination slot) pairs, applied in this order around the resets:
    saves: list[tuple[int, int]] = field(default_factory=list)      # a sequence's slot -> a checkpoint
    restores: list[tuple[int, int]] = field(default_factory=list)   # a checkpoint -> a new owner's slot

    def take(self) -> CacheUpdates:
        out = CacheUpdates(self.bound_slots, self.table_writes, self.saves, self.restores)
        self.bound_slots, self.table_writes, self.saves, self.restores = [], [], [], []
        return out


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)      # moved from waiting to running


class BlockManager:
    """Gives sequences a state slot and enough blocks; exact: a resident sequence holds
    ceil(scheduled positions / block_size) blocks and one slot. With a prefix cache, its first
    blocks may be cached ones it shares, and cached blocks no sequence holds are evicted on demand."""

    def __init__(self, allocator: BlockAllocator, block_size: int, prefix: PrefixCache | None = None):
        self.allocator, self.block_size, self.prefix = allocator, block_size, prefix
        self.updates = CacheUpdates()
        self._freed: set[int] = set()      # slots freed since they were last bound

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_available_blocks(self) -> int:
        free = self.allocator.num_free_blocks
        return free if self.prefix is None else free + self.prefix.num_evictable_blocks

    def can_hold(self, seq: Sequence, num_tokens: int, shared: int = 0) -> bool:
        """Whether `seq` can hold `num_tokens` positions (`shared`: cached blocks it will take)."""
        if seq.slot < 0 and self.allocator.num_free_slots == 0:
            return False
        return self.blocks_for(num_tokens) - len(seq.block_ids) - shared <= self.num_available_blocks()

    def bind_slot(self, seq: Sequence) -> None:
        seq.slot = self.allocator.allocate_slot()
        self.updates.bound_slots.append(seq.slot)
        if seq.slot in self._freed:        # the slot's previous owner's writes of this interval
            self._freed.discard(seq.slot)
            if self.updates.table_writes:
                self.updates.table_writes = [w for w in self.updates.table_writes if w[0] != seq.slot]

    def hold(self, seq: Sequence, num_tokens: int) -> None:
        if seq.slot < 0:
            self.bind_slot(seq)
        extra = self.blocks_for(num_tokens) - len(seq.block_ids)
        if extra > 0:
            short = extra - self.allocator.num_free_blocks
            if short > 0 and self.prefix is not None:
                self.prefix.evict(short)
            first = len(seq.block_ids)
            new = self.allocator.allocate_blocks(extra)
            seq.block_ids.extend(new)
            self.updates.table_writes.extend((seq.slot, first + i, b) for i, b in enumerate(new))

    def free(self, seq: Sequence) -> None:
        self.allocator.free_blocks(seq.block_ids if self.prefix is None else self.prefix.release(seq))
        seq.block_ids = []
        if seq.slot >= 0:
            self.allocator.free_slot(seq.slot)
            self._freed.add(seq.slot)
            seq.slot = -1


@runtime_checkable
class SchedulingPolicy(Protocol):
    """deepinfer_scheduler_policy: the order in which the scheduler admits waiting requests (the
    core's is first come, first served). Budgets, cache capacity and preemption stay the core's:
    a preempted sequence resumes first, whatever its key."""

    name: str

    def admission_key(self, request: Request) -> Any:
        """A sort key for a request's completions entering the waiting queue: lower keys are
        admitted first, equal keys in arrival order. Called once per completion, on the host, when
        it is submitted. `request` is an engine.sequence.Request (`request_id`, `prompt`,
        `prompt_token_ids`, `params`: SamplingParams, `metrics.arrival_time`); the keys of one
        policy must compare with each other."""


class FirstComeFirstServed:
    """The core's scheduling policy: every request the same key, so requests are admitted in the
    order they arrived."""

    name = "fcfs"

    def admission_key(self, request: Request) -> int:
        return 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator,
                 policy: SchedulingPolicy | None = None, prefix: PrefixCache | None = None):
        self.config = config
        self.policy = policy if policy is not None else FirstComeFirstServed()
        # seq_id -> its place in the waiting queue: (0,) resumes first (a preempted sequence), then
        # (1, the policy's key) in key order, equal keys in arrival order
        self._keys: dict[int, tuple] = {}
        self.blocks = BlockManager(allocator, config.block_size, prefix)
        # confidence-scheduled verification (speculative/varlen.py): the step's common draft length
        # from the cumulative confidences of the sequences that verify; None verifies every draft
        self.draft_length: Callable[[list[list[float]]], int] | None = None
        self.waiting: deque[Sequence] = deque()     # finished entries are skipped and dropped lazily
        self.running: dict[int, Sequence] = {}      # seq_id -> sequence, in admission order
        self.num_preemptions = 0

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix cache (None: prefix caching off); the block manager's."""
        return self.blocks.prefix

    def check_fits(self, seq: Sequence) -> None:
        """A sequence that could never fit alone would wait forever: refuse it at submission."""
        need = self.blocks.blocks_for(seq.max_total_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(f"prompt + max_tokens = {seq.max_total_tokens} "
                             f"tokens need {need} cache blocks but the cache has {self.blocks.num_blocks}; "
                             f"lower max_tokens or raise the cache budget")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SeqStatus.WAITING
        key = self._keys[seq.seq_id] = (1, self.policy.admission_key(seq.request))
        i = len(self.waiting)
        while i and key < self._keys.get(self.waiting[i - 1].seq_id, (0,)):
            i -= 1
        self.waiting.insert(i, seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or any(not s.finished for s in self.waiting)

    def unready(self) -> list[Sequence]:
        """Waiting sequences whose constraint is still being prepared (or failed)."""
        return [s for s in self.waiting if not s.finished and not s.ready]

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        return out

    @staticmethod
    def _plan(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        samples = start + n == seq.num_tokens + seq.num_pending
        out.chunks.append(ScheduledChunk(seq, start, n, samples))
        seq.num_computed = start + n
        if samples:
            seq.num_pending += 1

    def _next_chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` can feed now: everything up to its newest (possibly pending) token; none
        once its in-flight tokens reach max_tokens, nor while a grammar waits for its last token."""
        if seq.num_pending and (seq.num_outputs_scheduled >= seq.max_tokens
                                or seq.request.constraint is not None):
            return 0
        return min(seq.num_tokens + seq.num_pending - seq.num_computed, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences first, oldest first (FCFS); the newest make room when blocks run out
        (a victim is always newer than the sequence being planned, so never planned already).
        The common case, a decode inside the blocks it holds, is inline: this loop runs for every
        sequence at every step."""
        block_size, chunks, prefix = self.config.block_size, out.chunks, self.prefix
        limit = self._draft_length() if self.draft_length is not None else None
        for seq in list(self.running.values()):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue                           # preempted earlier in this loop
            pending = seq.num_pending
            if pending and (len(seq.token_ids) + pending >= seq.max_tokens or seq.request.constraint is not None):
                continue                           # at max_tokens, or a grammar waits for its token
            start = seq.num_computed
            n = min(seq.num_tokens + pending - start, budget)
            if n <= 0:
                continue
            if seq.cuts or prefix is not None and start % block_size == 0:
                n = self._keep_boundaries(seq, start, n)
            if seq.unnamed_checkpoint is not None:
                prefix.settle(seq)
            samples = start + n == seq.num_tokens + pending
            drafts = accept = 0
            if seq.draft_ids and n == 1 and len(seq.token_ids) >= seq.min_tokens:
                drafts, accept = self._num_drafts(seq, start, pending, budget, limit)
                if prefix is not None and start % block_size + accept >= block_size:
                    accept = block_size - 1 - start % block_size   # a later chunk starts on the boundary
                n += drafts
            if start + n > len(seq.block_ids) * block_size:
                if drafts > accept and not self.blocks.can_hold(seq, start + n):
                    n, drafts = n - (drafts - accept), accept      # rows fed for the shape never preempt
                while not self.blocks.can_hold(seq, start + n):
                    victim = next(reversed(self.running.values()))
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    continue
                self.blocks.hold(seq, start + n)
            chunks.append(ScheduledChunk(seq, start, n, samples, drafts, accept, seq.draft_ids if drafts else ()))
            seq.num_computed = start + n
            if samples:
                seq.num_pending = pending + 1
            budget -= n
        return budget

    def _keep_boundaries(self, seq: Sequence, start: int, n: int) -> int:
        """Prefix caching: a chunk that starts on one of the sequence's kept boundaries (or, past its
        prompt, on any block boundary) checkpoints it; a prefill chunk ends on the next one."""
        cuts = seq.cuts
        if cuts:
            if cuts[-1] == start:
                cuts.pop()
                self.prefix.checkpoint(seq, start, self.blocks.updates)
                if not cuts and seq.request.prompt_filler is seq:
                    seq.request.prompt_filler = None
            if cuts and start + n > cuts[-1]:
                n = cuts[-1] - start
        elif start >= len(seq.prompt_ids) and start % self.config.block_size == 0:
            self.prefix.checkpoint(seq, start, self.blocks.updates, decoding=True)
        return n

    def _draft_length(self) -> int:
        """The common draft length of this step's verify chunks (confidence-scheduled)."""
        conf = [s.draft_conf for s in self.running.values() if s.draft_ids and s.status is SeqStatus.RUNNING
                and s.num_computed + 1 == s.num_tokens + s.num_pending]
        return self.draft_length(conf) if conf else 0

    def _num_drafts(self, seq: Sequence, start: int, pending: int, budget: int,
                    limit: int | None) -> tuple[int, int]:
        """(drafts fed, drafts that may be accepted) with the last token: all it holds (or the step's
        confidence-scheduled length), within the budget; none accepted past max_tokens (a verify step
        adds accepted + 1 tokens; `pending` are still in flight). The rows past max_tokens are still
        fed, within the blocks the sequence may hold, so every verify chunk of the step has one shape
        (one CUDA graph)."""
        fed = min(len(seq.draft_ids), budget - 1) if limit is None else min(len(seq.draft_ids), limit, budget - 1)
        accept = max(0, min(fed, seq.max_tokens - len(seq.token_ids) - pending - 1))
        room = self.blocks.blocks_for(self.config.max_model_len or seq.max_total_tokens) * self.config.block_size - start - 1
        return max(accept, min(fed, room)), accept

    def schedule_blind(self, verifying: list[ScheduledChunk], max_drafts: int, codes: Callable[[int, int], list[int]],
                       fits: Callable[[int, int], bool]) -> list[ScheduledChunk] | None:
        """The next verify step of the sequences `verifying` (a step whose verdict is still on the
        device), planned before that verdict is read: L drafts each (the confidence-scheduled length
        from the confidences known so far, else `max_drafts`), named by `codes(slot, L)`, at
        positions the device knows (the chunks' `start` is filled in when the verdict is committed).
        None, so the caller reads the verdict and schedules as usual, unless every running sequence
        is in `verifying`, nothing waits, the step's shape `fits(sequences, L + 1)` the device path,
        and every sequence, whatever the verdict, can accept all L drafts within its max_tokens and
        the blocks it may hold, with no preemption."""
        verifying = [c for c in verifying if not c.seq.finished]    # stopped or aborted meanwhile
        if not verifying or len(verifying) != len(self.running) or any(not s.finished for s in self.waiting):
            return None
        seqs = [c.seq for c in verifying]
        if any(s.status is not SeqStatus.RUNNING for s in seqs):
            return None
        n = max_drafts
        if self.draft_length is not None:
            n = min(n, self.draft_length([s.draft_conf for s in seqs]) if all(s.draft_conf for s in seqs) else 0)
        if n < 1 or len(seqs) * (n + 1) > self.config.max_num_batched_tokens or not fits(len(seqs), n + 1):
            return None
        block_size, extra = self.config.block_size, 0
        ends = []
        for c in verifying:
            seq = c.seq
            # the previous step may still accept all of its drafts: positions and tokens at their most
            start = c.start + 1 + c.max_accept
            room = self.blocks.blocks_for(self.config.max_model_len or seq.max_total_tokens) * block_size - start - 1
            left = seq.max_tokens - len(seq.token_ids) - seq.num_pending - c.max_accept - 1
            if min(room, left) < n or len(seq.token_ids) < seq.min_tokens:
                return None
            if self.prefix is not None and (start - 1) // block_size != (start + n) // block_size:
                return None                        # may pass a block boundary: plan it on the host
            ends.append(start + n + 1)
            extra += max(0, self.blocks.blocks_for(ends[-1]) - len(seq.block_ids))
        if extra > self.blocks.allocator.num_free_blocks:
            return None
        chunks = []
        for seq, end in zip(seqs, ends):
            self.blocks.hold(seq, end)
            seq.num_pending += 1
            chunks.append(ScheduledChunk(seq, -1, n + 1, True, n, n, codes(seq.slot, n)))
        return chunks

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting sequences in order while the budget, the slots and the blocks allow; admission
        never preempts. A sequence whose grammar is still compiling lets the others go first."""
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.finished:
                self._keys.pop(self.waiting.popleft().seq_id, None)
                continue
            if not seq.ready or seq.request.prompt_filler not in (None, seq):
                skipped.append(self.waiting.popleft())   # its grammar compiling, or its prompt
                continue
            if seq.num_pending:
                break                              # preempted while a token was in flight: wait for it
            hit = self.prefix.lookup(seq) if self.prefix is not None else None
            if hit is not None and hit.checkpoint is not None:
                self.prefix.index.acquire(hit.nodes)     # not evictable while admission counts blocks
                seq.num_computed = hit.num_blocks * self.config.block_size
            n = self._next_chunk(seq, budget)
            if not self.blocks.can_hold(seq, seq.num_computed + n, hit.num_blocks if hit is not None else 0):
                if hit is not None and hit.checkpoint is not None:
                    self.prefix.index.release(hit.nodes)
                    seq.num_computed = 0
                break
            self._keys.pop(self.waiting.popleft().seq_id, None)
            out.admitted.append(seq)
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
            if hit is not None:
                self.blocks.bind_slot(seq)
                self.prefix.admit(seq, hit, self.blocks.updates)
                if seq.cuts:
                    n = min(n, seq.cuts[-1] - seq.num_computed)
                    if seq.request.params.n > 1 and not seq.token_ids:
                        seq.request.prompt_filler = seq    # its siblings share its prompt
            self.blocks.hold(seq, seq.num_computed + n)
            self._plan(out, seq, n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    # ---- leaving -------------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """Done (stop, length or abort): free its slot and blocks at once, whether running or
        waiting (a waiting entry is dropped from the queue lazily)."""
        if seq.status is SeqStatus.RUNNING:
            del self.running[seq.seq_id]
        if seq.request.prompt_filler is seq:
            seq.request.prompt_filler = None
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: drop the cached state; prompt + outputs so far are re-prefilled."""
        self.num_preemptions += 1
        self.blocks.free(seq)
        del self.running[seq.seq_id]
        seq.status, seq.num_computed, seq.draft_ids, seq.draft_conf = SeqStatus.WAITING, 0, [], []
        seq.draft_source, seq.cuts = None, []
        if seq.request.prompt_filler is seq:
            seq.request.prompt_filler = None
        self._keys[seq.seq_id] = (0,)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
