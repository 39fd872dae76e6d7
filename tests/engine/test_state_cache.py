"""The paged state cache: exact byte accounting, sizing from a budget, the allocator, and paged rows
that read back exactly what a contiguous layout would hold."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.cache.block_allocator import BlockAllocator, CacheFullError
from deepinfer_core.cache.budget import CacheRequest, resolve_num_blocks
from deepinfer_core.cache.state_cache import CacheLayout, StateCache
from deepinfer_core.config import ModelConfig
from deepinfer_core.tools.tiny_config import tiny_config_dict



def tiny_cfg() -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict())


def counts(cfg: ModelConfig) -> tuple[int, int, int]:
    ratios = [cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)]
    ratios += [cfg.mtp_ratio(i) for i in range(cfg.num_nextn_predict_layers)]
    return len(ratios), ratios.count(4), ratios.count(128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_layout_bytes_by_hand(dtype):
    cfg = tiny_cfg()
    n_layers, n_csa, n_hca = counts(cfg)          # 9 layers (8 + MTP): 3 CSA, 2 HCA
    assert (n_layers, n_csa, n_hca) == (9, 3, 2)
    e, bt, d, di, w = dtype.itemsize, 6, cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    L = CacheLayout.from_config(cfg, dtype, backtrack=bt)
    ring = (w + bt) * d * e
    csa_tails = 2 * (8 + bt) * 2 * d * 4 + 2 * (8 + bt) * 2 * di * 4      # main + indexer, kv and z, fp32
    hca_tails = 2 * (128 + bt) * d * 4
    assert L.slot_bytes == n_layers * ring + n_csa * csa_tails + n_hca * hca_tails
    assert L.block_bytes == n_csa * (32 * d + 32 * di) * e + n_hca * 1 * d * e


def test_flash_layout_bytes_by_hand(v4_flash_config):
    cfg = ModelConfig.from_dict(v4_flash_config)
    n_layers, n_csa, n_hca = counts(cfg)
    assert (n_layers, n_csa, n_hca) == (44, 21, 20)
    L = CacheLayout.from_config(cfg, torch.bfloat16, backtrack=6)
    # a 128-position block: 32 CSA rows of 512 bf16 + 32 indexer keys of 128 bf16, 1 HCA row of 512
    assert L.block_bytes == 21 * (32 * 512 + 32 * 128) * 2 + 20 * 512 * 2 == 880_640
    per_token = L.block_bytes / 128
    assert 6_800 < per_token < 6_900    # ~6.9 KB/token, bf16 rows: 6.9 GB per 1M tokens


def test_flash_kv_fp8_layout_bytes_by_hand(v4_flash_config):
    """kv_fp8: rings and main compressed rows packed in 584 B (448 e4m3 + 64 bf16 RoPE + 7 UE8M0 + 1 pad);
    indexer keys stay bf16, compressor tails fp32."""
    cfg = ModelConfig.from_dict(v4_flash_config)
    bf16 = CacheLayout.from_config(cfg, torch.bfloat16, backtrack=6)
    L = CacheLayout.from_config(cfg, torch.bfloat16, backtrack=6, kv_fp8=True)
    assert (L.rope_dim, L.kv_row_bytes, bf16.kv_row_bytes) == (64, 584, 1024)
    assert L.block_bytes == 21 * (32 * 584 + 32 * 128 * 2) + 20 * 584 == 576_160
    assert L.slot_bytes == bf16.slot_bytes - 44 * (128 + 6) * (1024 - 584)
    assert 4_500 < L.block_bytes / 128 < 4_502           # per token, vs 6,880 with bf16 rows


@pytest.mark.parametrize("num_slots,num_blocks", [(1, 1), (2, 5)])
def test_kv_fp8_pools_allocate_exactly_the_counted_bytes(num_slots, num_blocks):
    cfg = tiny_cfg()
    L = CacheLayout.from_config(cfg, torch.bfloat16, backtrack=6, kv_fp8=True)
    cache = StateCache(L, num_slots, num_blocks)
    assert L.kv_row_bytes == 200                          # head_dim 128: 64 e4m3 + 64 bf16 + 1 scale, padded to 8
    assert cache.rings[0].shape == (num_slots, cfg.sliding_window + 6, 200) and cache.rings[0].dtype == torch.uint8
    assert cache.comp[2]["rows"].dtype == torch.uint8 and cache.index[2]["rows"].dtype == torch.bfloat16
    assert cache.nbytes() == L.cache_bytes(num_slots, num_blocks)
    bf16 = CacheLayout.from_config(cfg, torch.bfloat16, backtrack=6)
    assert L.slot_bytes < bf16.slot_bytes and L.block_bytes < bf16.block_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_fp8_needs_a_bf16_cache(dtype):
    with pytest.raises(ValueError, match=f"kv_fp8.*{dtype}"):
        CacheLayout.from_config(tiny_cfg(), dtype, backtrack=0, kv_fp8=True)


@pytest.mark.parametrize("num_slots,num_blocks", [(1, 1), (3, 17), (8, 64)])
def test_pools_allocate_exactly_the_counted_bytes(num_slots, num_blocks):
    L = CacheLayout.from_config(tiny_cfg(), torch.float32, backtrack=6)
    cache = StateCache(L, num_slots, num_blocks)
    assert cache.nbytes() == L.cache_bytes(num_slots, num_blocks)
    assert cache.nbytes() == num_slots * L.slot_bytes + num_blocks * L.block_bytes


def test_budget_gives_the_most_blocks_that_fit():
    L = CacheLayout.from_config(tiny_cfg(), torch.float32, backtrack=6)
    budget = 4 * L.slot_bytes + 10 * L.block_bytes + L.block_bytes - 1
    n, _, note = resolve_num_blocks(L, CacheRequest(num_slots=4, memory_bytes=budget), "cpu")
    assert n == 10 and "kv_cache_memory_bytes" in note
    cache = StateCache(L, 4, n)
    assert cache.nbytes() <= budget < cache.nbytes() + L.block_bytes
    # max_model_len caps the blocks at what max_num_seqs full-length sequences can use
    n, _, note = resolve_num_blocks(L, CacheRequest(num_slots=4, memory_bytes=1 << 30, max_model_len=300), "cpu")
    assert n == 4 * 3 and "capped" in note
    # the env table's CPU budget is the default
    n, _, note = resolve_num_blocks(L, CacheRequest(num_slots=1), "cpu")
    assert n == (2**30 - L.slot_bytes) // L.block_bytes and "DEEPINFER_CPU_KV_CACHE_BYTES" in note


def test_default_checkpoint_slots_stay_within_their_share_of_the_budget():
    L = CacheLayout.from_config(tiny_cfg(), torch.float32, backtrack=6)
    budget = 100 * L.slot_bytes
    req = CacheRequest(num_slots=4, checkpoint_slots=8, memory_bytes=budget, checkpoint_share=0.1)
    n, checkpoints, note = resolve_num_blocks(L, req, "cpu")
    assert checkpoints == 8 and "checkpoint" not in note             # 8 slots: 8% of the budget
    n, checkpoints, note = resolve_num_blocks(L, dataclasses.replace(req, checkpoint_slots=30), "cpu")
    assert checkpoints == 10 and "checkpoint slots capped at 10%" in note
    assert n == (budget - 14 * L.slot_bytes) // L.block_bytes
    exact = CacheRequest(num_slots=4, checkpoint_slots=30, memory_bytes=budget)   # a count asked for
    assert resolve_num_blocks(L, exact, "cpu")[1] == 30


def test_too_small_budget_names_the_field():
    L = CacheLayout.from_config(tiny_cfg(), torch.float32, backtrack=6)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000 .*max_num_seqs"):
        resolve_num_blocks(L, CacheRequest(num_slots=2, memory_bytes=1000), "cpu")


def test_allocator_free_lists():
    a = BlockAllocator(num_blocks=4, num_slots=2)
    blocks = a.allocate_blocks(3)
    assert sorted(blocks) == [0, 1, 2] and a.num_free_blocks == 1
    with pytest.raises(CacheFullError):
        a.allocate_blocks(2)
    s0, s1 = a.allocate_slot(), a.allocate_slot()
    with pytest.raises(CacheFullError):
        a.allocate_slot()
    a.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free_blocks([blocks[0]])
    a.free_slot(s0)
    a.free_slot(s1)
    assert a.empty


def test_paged_rows_roundtrip_through_a_scattered_block_table():
    L = CacheLayout.from_config(tiny_cfg(), torch.float32, backtrack=0)
    cache = StateCache(L, num_slots=2, num_blocks=8)
    table = [5, 2, 7]                                # not contiguous, not sorted
    st = cache.bind(1, table)
    cs = next(layer.compressor for layer in st.layers if layer.compressor is not None and layer.compressor.ratio == 4)
    rows = torch.randn(80, L.head_dim)               # 80 rows of 32 per block: 3 blocks
    cs.write_rows(0, rows[:50])
    cs.write_rows(50, rows[50:])
    cs.n_rows = 80
    assert torch.equal(cs.read_rows(), rows)
    assert torch.equal(cache.comp[2]["rows"][7, :16], rows[64:])       # block 3 of the table is pool block 7
    with pytest.raises(RuntimeError, match="block table holds 3"):
        cs.write_rows(96, rows[:1])


def test_binding_a_slot_resets_its_tails_only():
    L = CacheLayout.from_config(tiny_cfg(), torch.float32, backtrack=0)
    cache = StateCache(L, num_slots=2, num_blocks=2)
    a, b = cache.bind(0, [0]), cache.bind(1, [1])
    ca, cb = a.layers[2].compressor, b.layers[2].compressor
    ca.tail_z.fill_(1.0)
    cb.tail_z.fill_(2.0)
    again = cache.bind(0, [0])
    assert torch.isneginf(again.layers[2].compressor.tail_z).all()
    assert (again.layers[2].compressor.tail_kv == 0).all()
    assert (cb.tail_z == 2.0).all()


def test_cuda_budget_asks_torch_cuda_with_the_device_as_given(monkeypatch):
    L = CacheLayout.from_config(tiny_cfg(), torch.float32, backtrack=6)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (3 << 30, 4 << 30))
    n, _, note = resolve_num_blocks(L, CacheRequest(num_slots=1, gpu_memory_utilization=0.5), "cuda:1")
    assert asked == ["cuda:1"] and n == ((1 << 30) - L.slot_bytes) // L.block_bytes
    assert note.startswith("gpu_memory_utilization (1.00 GiB in use, 0.00 GiB activations)")
