"""Scheduler.schedule_blind: the next verify step planned before the previous step's verdict is read
(speculative/device_verdict.py). It plans only what is right whatever that verdict turns out to be,
and otherwise leaves everything as it was (None: the engine reads the verdict and schedules as usual)."""
from __future__ import annotations

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.api.outputs import RequestMetrics
from deepinfer_core.cache.block_allocator import BlockAllocator
from deepinfer_core.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from deepinfer_core.engine.sequence import Request, SeqStatus, Sequence

K = 3


def codes(slot: int, k: int) -> list[int]:
    return [-100 - 10 * slot - i for i in range(k)]


def always(num_seqs: int, q: int) -> bool:
    return True


def verifying(scheduler: Scheduler, start: int, num_outputs: int, max_tokens: int = 64, n: int = 2):
    """`n` running sequences whose verify step of K drafts at `start` is in flight (not committed)."""
    chunks = []
    for i in range(n):
        req = Request(f"r{i}", None, list(range(1, start)), SamplingParams(max_tokens=max_tokens), 0,
                      RequestMetrics(arrival_time=0.0))
        seq = Sequence(i, req, 0, 0, max_tokens)
        seq.token_ids = [5] * num_outputs
        seq.num_tokens = len(req.prompt_token_ids) + num_outputs
        seq.status = SeqStatus.RUNNING
        scheduler.running[seq.seq_id] = seq
        scheduler.blocks.hold(seq, start + K + 1)
        seq.num_computed, seq.num_pending = start + K + 1, 1
        chunks.append(ScheduledChunk(seq, start, K + 1, True, K, K, codes(seq.slot, K)))
    return chunks


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, block_size=128, max_model_len=1024), BlockAllocator(16, 4))


def test_plans_every_sequence_at_the_devices_positions_with_room_for_any_verdict(scheduler):
    prev = verifying(scheduler, start=120, num_outputs=10)
    free = scheduler.blocks.allocator.num_free_blocks
    chunks = scheduler.schedule_blind(prev, K, codes, always)
    assert [(c.seq, c.start, c.num_tokens, c.num_drafts, c.max_accept) for c in chunks] == \
        [(p.seq, -1, K + 1, K, K) for p in prev]
    assert [c.drafts for c in chunks] == [codes(p.seq.slot, K) for p in prev]
    assert all(p.seq.num_pending == 2 for p in prev)
    # the worst case: all K drafts accepted before, then K more rows: 120 + 1 + K + K + 1 = 128 positions
    assert all(len(p.seq.block_ids) == 1 for p in prev) and scheduler.blocks.allocator.num_free_blocks == free


def test_a_second_block_is_held_when_the_worst_case_crosses_into_it():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=128, max_model_len=1024), BlockAllocator(16, 4))
    prev = verifying(s, start=121, num_outputs=10)
    assert s.schedule_blind(prev, K, codes, always) is not None
    assert all(len(p.seq.block_ids) == 2 for p in prev)


@pytest.mark.parametrize("case", ["waiting", "not running", "max_tokens", "blocks", "shape", "varlen 0", "stopped"])
def test_refuses_and_changes_nothing_unless_every_verdict_fits(case):
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=128, max_model_len=1024), BlockAllocator(16, 4))
    prev = verifying(s, start=121, num_outputs=10, max_tokens=10 + 1 + K + K + 1)
    fits = always
    if case == "waiting":
        s.waiting.append(Sequence(9, prev[0].seq.request, 1, 0, 8))
    elif case == "not running":
        del s.running[prev[1].seq.seq_id]
        prev[1].seq.status = SeqStatus.WAITING
    elif case == "max_tokens":        # all K accepted before, K more now: one token over max_tokens
        prev[0].seq.max_tokens -= 1
    elif case == "blocks":
        s.blocks.allocator.allocate_blocks(s.blocks.allocator.num_free_blocks - 1)
    elif case == "shape":
        fits = lambda num_seqs, q: False    # noqa: E731
    elif case == "varlen 0":
        s.draft_length = lambda conf: 0
        for p in prev:
            p.seq.draft_conf = [0.1] * K
    elif case == "stopped":           # a stopped sequence is left out; the others still go
        s.finish(prev[0].seq)
    before = [(p.seq.num_pending, list(p.seq.block_ids)) for p in prev]
    chunks = s.schedule_blind(prev, K, codes, fits)
    if case == "stopped":
        assert [c.seq for c in chunks] == [prev[1].seq]
        return
    assert chunks is None
    assert [(p.seq.num_pending, list(p.seq.block_ids)) for p in prev] == before


def test_varlen_length_comes_from_the_confidences_known_so_far():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=128, max_model_len=1024), BlockAllocator(16, 4))
    prev = verifying(s, start=40, num_outputs=4)
    seen = []
    s.draft_length = lambda conf: seen.append(conf) or 2
    for p in prev:
        p.seq.draft_conf = [0.9, 0.8, 0.5]
    chunks = s.schedule_blind(prev, K, codes, always)
    assert seen == [[[0.9, 0.8, 0.5]] * 2]
    assert [(c.num_tokens, c.num_drafts, c.drafts) for c in chunks] == [(3, 2, codes(p.seq.slot, 2)) for p in prev]
