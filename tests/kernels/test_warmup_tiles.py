"""The engine's warm-up runs a step of every MoE tile set a served step can select: the fused MoE
picks its tiles (the schedule's BM1/BM2, the grouped GEMMs' BLOCK_M) by the step's tokens, whatever
the sequences, so a count one sequence cannot hold (max_model_len) must still be warmed up, over
several sequences. The regression: benchmarks/spec_replay.py at concurrency 64 (max_model_len 392,
4 blocks a sequence) compiled the 32-row tiles mid-serving: the warm-up stopped at one sequence's
512 tokens (7 rows per expert of V4-Flash: 16-row tiles), and a step of many prompts' prefill chunks
went past 587 tokens. The GPU side: tests/gpu/test_no_late_compiles.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepinfer_kernels.moe import invariant_moe_config, moe_tile_config

from deepinfer_core.cache.block_allocator import BlockAllocator
from deepinfer_core.runner import warmup
from deepinfer_core.runner.warmup import eager_sizes, split_rows

BLOCK = 128


class FakeRunner:
    """What `_warm_up` reads of a ModelRunner; `execute` records each step's sequence lengths."""

    def __init__(self, max_model_len: int, max_seqs: int, num_blocks: int, vocab: int = 1000):
        self.device = "cpu"
        self.expert_parallel = False
        self.graphs = None
        self.model_config = SimpleNamespace(max_position_embeddings=16384, vocab_size=vocab)
        self.cache = SimpleNamespace(allocator=BlockAllocator(num_blocks, max_seqs),
                                     layout=SimpleNamespace(block_size=BLOCK))
        self.slot_tables = SimpleNamespace(max_blocks=-(-max_model_len // BLOCK))
        self.sampler = SimpleNamespace(sample=lambda logits, params, positions, seeds: logits[:, 0])
        self.steps: list[list[int]] = []

    def execute(self, batch) -> torch.Tensor:
        assert len(batch.ids) == sum(batch.lens) and batch.starts == [0] * len(batch.lens)
        assert batch.logit_rows == [sum(batch.lens[:i + 1]) - 1 for i in range(len(batch.lens))]
        tables = {}
        for slot, col, block in batch.updates.table_writes:
            tables.setdefault(slot, []).append((col, block))
        assert sorted(tables) == sorted(batch.slots) == sorted(batch.updates.bound_slots)
        for slot, n in zip(batch.slots, batch.lens):        # each sequence inside its block table
            assert len(tables[slot]) == -(-n // BLOCK) <= self.slot_tables.max_blocks
        self.steps.append(list(batch.lens))
        return torch.zeros(len(batch.lens), 4)


def warmed_steps(monkeypatch, **kw) -> list[int]:
    """The token counts of the eager warm-up's steps for a runner of `kw` (8192-token budget)."""
    runner = FakeRunner(**kw)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(warmup, "_progress", lambda *a, **k: None)
    warmup._warm_up(runner, 8192)
    alloc = runner.cache.allocator
    assert alloc.num_free_blocks == alloc.num_blocks and alloc.num_free_slots == alloc.num_slots
    return [sum(lens) for lens in runner.steps]


def test_split_rows_fills_sequences_up_to_the_limit():
    assert split_rows(4, 512) == [4]
    assert split_rows(512, 512) == [512]
    assert split_rows(1024, 512) == [512, 512]
    assert split_rows(1000, 384) == [384, 384, 232]


def test_the_warm_up_runs_every_size_of_the_ladder_over_several_sequences(monkeypatch):
    # benchmarks/spec_replay.py --concurrency 1,64: max_model_len 256 + 128 + 8, 64 * 4 + 8 blocks
    steps = warmed_steps(monkeypatch, max_model_len=392, max_seqs=64, num_blocks=264)
    assert steps == eager_sizes(8192) == [1, 4, 16, 64, 256, 1024, 4096, 8192]


def test_a_step_past_the_cache_or_the_slots_is_left_out(monkeypatch):
    # 2 slots of 512 tokens: the largest step has 1024 tokens; 5 blocks hold 640 tokens
    few_slots = warmed_steps(monkeypatch, max_model_len=392, max_seqs=2, num_blocks=64)
    assert few_slots == [1, 4, 16, 64, 256, 1024]
    few_blocks = warmed_steps(monkeypatch, max_model_len=392, max_seqs=64, num_blocks=5)
    assert few_blocks == [1, 4, 16, 64, 256]


# (routed + shared experts, top-k + the shared column): V4-Flash, the trained tiny model, V4.1-Flash
MODELS = [(257, 7), (9, 3), (385, 7)]


def tile_sets(tokens: int, experts: int, k1: int) -> dict:
    """The fused MoE's tile choice for a step of `tokens` in every mode the engine runs it in."""
    out = {("invariant", sm90): invariant_moe_config(tokens, k1, experts, mma_v2_family=sm90)
           for sm90 in (False, True)}
    for fp4 in (False, True):
        for fp8_act in (False, True):
            out[("tiles", fp4, fp8_act)] = moe_tile_config(tokens, k1, experts, fp4=fp4,
                                                           fp8_activations=fp8_act)
    return {mode: tuple(sorted(cfg.items())) for mode, cfg in out.items()}


@pytest.mark.parametrize("experts,k1", MODELS)
@pytest.mark.parametrize("max_model_len,max_seqs", [(392, 64), (128, 64), (1024, 64), (16384, 8)])
def test_warmed_steps_select_every_tile_set_a_served_step_can(monkeypatch, experts, k1,
                                                             max_model_len, max_seqs):
    """Every step of 1..8192 tokens (prefill chunks of many prompts, decode, a verify step of
    gamma + 1 rows per sequence at concurrency 64: 256 or 384 rows) selects a tile set that some
    warm-up step selected."""
    steps = warmed_steps(monkeypatch, max_model_len=max_model_len, max_seqs=max_seqs,
                         num_blocks=4096)
    reachable = min(8192, max_seqs * -(-max_model_len // BLOCK) * BLOCK)
    warm = [tile_sets(n, experts, k1) for n in steps]
    for t in range(1, reachable + 1):
        for mode, tiles in tile_sets(t, experts, k1).items():
            assert any(w[mode] == tiles for w in warm), (
                f"a step of {t} tokens selects {mode} {tiles}, which no warm-up step ({steps}) ran")
