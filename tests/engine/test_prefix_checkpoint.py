"""The groundwork of prefix caching on the hybrid state: at a position aligned to the cache block
(a multiple of every compress ratio), a sequence's state is its slot (window rings, compressor
tails, Engram ids) plus its blocks before that position. Copying the slot aside (a checkpoint),
letting the first sequence run on, then copying the checkpoint into a new sequence's slot that
shares those blocks (`StateCache.copy_slots`, `SequenceState.resume`) gives a state that computes
exactly what a cold run computes: prompt logits and later decode steps bitwise equal (batch-invariant
ops, float32, CPU), on V4 (CSA with its overlapping window, HCA) and V4.1 (shared caches, Engram)."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.runner.model_runner import ModelRunner

TAIL, DECODE = 20, 3    # prompt tokens after the checkpoint; decode steps compared


@pytest.fixture(scope="module", params=["v4", "v41"])
def runner(request, tiny_ckpt_dir, tiny_v41_dir):
    path = tiny_ckpt_dir if request.param == "v4" else tiny_v41_dir
    return ModelRunner(path, dtype="float32", batch_invariant=True, device="cpu")


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def restored(runner, checkpoint_slot: int, shared_blocks: list[int], at: int):
    """A new self-managed sequence over a fresh slot holding the checkpoint, sharing the blocks."""
    cache, alloc = runner.cache, runner.cache.allocator
    slot = alloc.allocate_slot()
    cache.copy_slots([checkpoint_slot], [slot])
    st = cache.bind(slot, list(shared_blocks), fresh=False)
    st.resume(at)
    own: list[int] = []

    def grow(s, need: int) -> None:
        new = alloc.allocate_blocks(need - len(s.table))
        own.extend(new)
        s.table.set(s.table.ids + new)
    st.grow = grow
    return st, slot, own


def test_a_restored_checkpoint_computes_what_a_cold_run_computes(runner, at=256):
    prompt, other, later = ids(at + TAIL, 1), ids(50, 2), ids(DECODE, 3)
    cold, first = runner.new_sequence(), runner.new_sequence()
    alloc = runner.cache.allocator
    checkpoint = alloc.allocate_slot()
    try:
        runner.forward_batch([prompt[:at]], [cold])
        want = [runner.forward_batch([prompt[at:]], [cold], all_logits=True)]
        want += [runner.forward_batch([[t]], [cold]) for t in later]

        runner.forward_batch([prompt[:at]], [first])
        runner.cache.copy_slots([first.slot], [checkpoint])
        runner.forward_batch([other], [first])            # the first sequence runs on elsewhere
        shared = first.table.ids[: at // first.block_size]
        warm, slot, own = restored(runner, checkpoint, shared, at)
        got = [runner.forward_batch([prompt[at:]], [warm], all_logits=True)]
        got += [runner.forward_batch([[t]], [warm]) for t in later]
        for step, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max():.3g}"
        alloc.free_blocks(own)
        alloc.free_slot(slot)
    finally:
        runner.release(cold)
        runner.release(first)
        alloc.free_slot(checkpoint)


def test_without_the_slot_copy_the_continuation_differs(runner):
    """The check above can fail: the same shared blocks over a slot that holds another sequence's
    window and tails give other logits."""
    at = 128
    prompt, other = ids(at + TAIL, 1), ids(at, 4)
    cold, stranger = runner.new_sequence(), runner.new_sequence()
    try:
        runner.forward_batch([prompt[:at]], [cold])
        runner.forward_batch([other], [stranger])
        want = runner.forward_batch([prompt[at:]], [cold], all_logits=True)
        warm, slot, own = restored(runner, stranger.slot, cold.table.ids[:1], at)
        got = runner.forward_batch([prompt[at:]], [warm], all_logits=True)
        assert not torch.equal(got, want)
        runner.cache.allocator.free_blocks(own)
        runner.cache.allocator.free_slot(slot)
    finally:
        runner.release(cold)
        runner.release(stranger)
