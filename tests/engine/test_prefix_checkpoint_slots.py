"""Checkpoint slots of the prefix cache (cache/prefix_cache.py) within one step: when the slots run
out, a new checkpoint takes the least recently used one's slot, but never a slot the same step still
copies (a restore's source, a save's destination): two copies into one slot in one `index_copy_`
land in any order on a GPU, which the CPU (copying in order) would never show."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.cache.block_allocator import BlockAllocator
from deepinfer_core.cache.prefix_cache import CHECKPOINTS_FULL, PrefixCache
from deepinfer_core.cache.state_cache import StateCache
from deepinfer_core.engine.scheduler import CacheUpdates

BS = 4


@dataclass(eq=False)
class Seq:
    """What the prefix cache reads of a sequence."""
    token_ids: list[int]
    slot: int
    block_ids: list[int]
    prefix_nodes: list = field(default_factory=list)
    block_hashes: list = field(default_factory=list)
    decode_checkpoint: object = None
    unnamed_checkpoint: tuple | None = None
    request: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(cache_salt=None))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_slice(self, lo: int, hi: int) -> list[int]:
        return self.token_ids[lo:hi]


def cache_with_seqs(n: int, slots: int) -> tuple[PrefixCache, list[Seq]]:
    alloc = BlockAllocator(num_blocks=64, num_slots=n + slots)
    cache = PrefixCache(alloc, BS, num_checkpoint_slots=slots)
    seqs = [Seq([100 * i + t for t in range(2 * BS + 1)], alloc.allocate_slot(),
                alloc.allocate_blocks(3)) for i in range(n)]
    return cache, seqs


def test_a_step_never_saves_twice_into_one_checkpoint_slot():
    cache, seqs = cache_with_seqs(4, slots=3)
    step = CacheUpdates()
    for seq in seqs:                          # four boundaries in one step, three slots
        cache.checkpoint(seq, BS, step)
    dsts = [dst for _, dst in step.saves]
    assert len(dsts) == 3 and len(set(dsts)) == 3
    assert cache.stats.cut_short == {CHECKPOINTS_FULL: 1}
    nxt = CacheUpdates()                      # the next step may take the oldest one
    cache.checkpoint(seqs[3], 2 * BS, nxt)
    assert [dst for _, dst in nxt.saves] == [dsts[0]] and cache.stats.evicted_checkpoints == 1
    assert seqs[0].prefix_nodes[0].checkpoint is None


def test_a_step_never_takes_a_checkpoint_it_restores_from():
    cache, seqs = cache_with_seqs(2, slots=1)
    cache.checkpoint(seqs[0], BS, CacheUpdates())
    step = CacheUpdates()
    step.restores.append((seqs[0].prefix_nodes[0].checkpoint, 9))   # a hit admitted this step
    cache.checkpoint(seqs[1], BS, step)
    assert step.saves == [] and seqs[0].prefix_nodes[0].checkpoint is not None
    cache.checkpoint(seqs[1], 2 * BS, CacheUpdates())     # later, the slot may go
    assert seqs[0].prefix_nodes[0].checkpoint is None and cache.stats.evicted_checkpoints == 1


def test_copying_into_one_slot_twice_in_one_op_is_refused(tiny_ckpt_dir):
    from deepinfer_core import LLM
    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", device="cpu", max_model_len=64,
              max_num_seqs=2, num_cache_blocks=4, enable_prefix_caching=False)
    cache: StateCache = llm.runner.cache
    with pytest.raises(RuntimeError, match="copied into twice"):
        cache.copy_slots([0, 1], [1, 1])
    for t in cache.slot_tensors():
        t[0] = torch.arange(t[0].numel()).view(t[0].shape).to(t.dtype)
    cache.copy_slots([0], [1])
    assert all(torch.equal(t[0], t[1]) for t in cache.slot_tensors())
