"""The state cache on a DeepSeek-V4.1 stack (spec deepseek_v41.md §7, §15): only KV-source layers
own compressed rows and index keys, sharing layers alias their source's pools and states and add
no byte; V4's byte counts are unchanged."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.cache.state_cache import CacheLayout, StateCache
from deepinfer_core.config import ModelConfig
from deepinfer_core.tools.tiny_config import tiny_config_dict
from deepinfer_core.tools.tiny_config_v41 import tiny_v41_config_dict

BT = 6  # rollback room (DEEPINFER_MAX_BACKTRACKING_TOKENS)
F32 = 4  # compressor tails are fp32


def v41_dict(n_mtp: int = 0, engram: bool = True) -> dict:
    over = {}
    if n_mtp:  # drafter stages: window-only entries after the main layers
        ratios = tiny_v41_config_dict()["text_config"]["compress_ratios"]
        over = {"num_nextn_predict_layers": n_mtp, "compress_ratios": ratios + [0] * n_mtp,
                "dspark_block_size": 3, "dspark_target_layer_ids": [1]}
    if not engram:
        over.update(
            dict.fromkeys(
                k for k in tiny_v41_config_dict()["text_config"] if k.startswith("engram_")
            )
        )
    return tiny_v41_config_dict(**over)


def v41_cfg(n_mtp: int = 0, engram: bool = True) -> ModelConfig:
    return ModelConfig.from_dict(v41_dict(n_mtp, engram))


def packed_row(d: int, rope: int) -> int:
    """A kv_fp8 row: e4m3 nope dims, bf16 rope dims, a UE8M0 scale per 64 nope dims, padded to 8."""
    nope = d - rope
    return -(-(nope + 2 * rope + nope // 64) // 8) * 8


def v41_hand_bytes(cfg_dict: dict, n_mtp: int, e: int, kv_fp8: bool) -> tuple[int, int]:
    """(slot_bytes, block_bytes) of the tiny V4.1 from its config keys alone (sharing as in the
    tiny config: the KV sources own the pools, every other compressed layer shares)."""
    t = cfg_dict["text_config"]
    d, di, w, rope = t["head_dim"], t["index_head_dim"], t["sliding_window"], t["qk_rope_head_dim"]
    ratios = t["compress_ratios"][: t["num_hidden_layers"]]
    owners = t["kv_source_layer_ids"]  # the only layers with compressor pools
    row = packed_row(d, rope) if kv_fp8 else d * e
    rings = (len(ratios) + n_mtp) * (w + BT) * row  # every layer has its window ring
    # a C2 owner's tails: kv and z, ratio + backtrack tokens of d fp32 channels; C1 owners: none
    tails = sum(2 * (ratios[i] + BT) * d * F32 for i in owners if ratios[i] > 1)
    # a 128-position block: each owner's 128/ratio compressed rows and as many index keys
    block = sum(128 // ratios[i] * (row + di * e) for i in owners)
    # Engram: the N-1 earlier token ids each n-gram reads, plus the rollback room, as int64
    engram = (t["engram_max_ngram_size"] - 1 + BT) * 8 if t.get("engram_layer_ids") else 0
    return rings + tails + engram, block


@pytest.mark.parametrize(
    "dtype,kv_fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)  # kv_fp8 needs a bf16 cache
@pytest.mark.parametrize("n_mtp,engram", [(0, True), (1, True), (0, False)])
def test_v41_layout_bytes_by_hand(dtype, kv_fp8, n_mtp, engram):
    d = v41_dict(n_mtp, engram)
    L = CacheLayout.from_config(ModelConfig.from_dict(d), dtype, backtrack=BT, kv_fp8=kv_fp8)
    slot, block = v41_hand_bytes(d, n_mtp, dtype.itemsize, kv_fp8)
    assert (L.slot_bytes, L.block_bytes) == (slot, block)
    # sharing layers and window-only layers add nothing to a block: only layers 2, 4 (C2), 5 (C1)
    assert L.kv_owner == (-1, -1, 2, 2, 4, 5, 5, 5) + (-1,) * n_mtp
    assert [i for i in range(len(L.ratios)) if L.index_kind(i)] == [2, 4, 5]
    assert {L.index_kind(i) for i in (2, 4, 5)} == {"projected"}
    assert L.tail_len(1) == 0 and L.tail_len(2) == 2 + BT


def test_sharing_saves_the_bytes_of_a_self_sourced_stack():
    """The same ratios with every compressed layer its own source cost exactly the sharing
    layers' rows, keys and tails more."""
    shared = CacheLayout.from_config(v41_cfg(), torch.bfloat16, backtrack=BT)
    none = {
        "kv_source_layer_ids": None,
        "index_source_layer_ids": None,
        "index_k_source_layer_ids": None,
        "candidate_source_layer_id": None,
    }
    own = CacheLayout.from_config(
        ModelConfig.from_dict(tiny_v41_config_dict(**none)), torch.bfloat16, backtrack=BT
    )
    d, di = 128, 128
    # sharers: layer 3 (C2) and layers 6, 7 (C1)
    assert own.block_bytes - shared.block_bytes == (64 + 2 * 128) * (d + di) * 2
    assert own.slot_bytes - shared.slot_bytes == 2 * (2 + BT) * d * F32


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("num_slots,num_blocks", [(1, 1), (3, 5)])
def test_v41_pools_allocate_exactly_the_counted_bytes(num_slots, num_blocks, kv_fp8):
    L = CacheLayout.from_config(v41_cfg(), torch.bfloat16, backtrack=BT, kv_fp8=kv_fp8)
    cache = StateCache(L, num_slots, num_blocks)
    assert cache.nbytes() == L.cache_bytes(num_slots, num_blocks)
    assert cache.nbytes() == num_slots * L.slot_bytes + num_blocks * L.block_bytes
    assert [i for i, c in enumerate(cache.comp) if c is not None] == [2, 4, 5]
    assert [i for i, c in enumerate(cache.index) if c is not None] == [2, 4, 5]
    assert len(cache.rings) == 8
    assert cache.comp[5]["tail_kv"].shape == (num_slots, 0, 128)  # C1: no tails
    assert cache.comp[2]["tail_kv"].shape == (num_slots, 2 + BT, 128)
    assert cache.index[2]["tail_kv"].shape[1] == 0  # projected keys: no tails
    assert cache.comp[2]["rows"].shape[:2] == (num_blocks, 64)  # 128 / ratio rows per block
    assert cache.comp[5]["rows"].shape[:2] == (num_blocks, 128)
    # whole-pool views (batched kernels): a sharer's pools are its source's dicts
    for i, src in [(3, 2), (6, 5), (7, 5)]:
        assert cache.layer_pools[i].compressor is cache.comp[src]
        assert cache.layer_pools[i].indexer is cache.index[src]
    assert cache.layer_pools[0].compressor is None and cache.layer_pools[0].indexer is None


def test_bound_sharing_layers_hold_their_sources_states():
    L = CacheLayout.from_config(v41_cfg(), torch.float32, backtrack=BT)
    cache = StateCache(L, num_slots=2, num_blocks=4)
    st, other = cache.bind(0, [0, 1]), cache.bind(1, [2, 3])
    lay = st.layers
    for i, src in [(3, 2), (6, 5), (7, 5)]:
        assert lay[i].compressor is lay[src].compressor and lay[i].indexer is lay[src].indexer
        assert lay[i].ring.data_ptr() != lay[src].ring.data_ptr()  # own window ring
    owners = [lay[i].compressor for i in (2, 4, 5)]
    assert len({id(c) for c in owners}) == 3 and all(c is not None for c in owners)
    assert len({id(lay[i].indexer) for i in (2, 4, 5)}) == 3
    assert all(lay[i].compressor is None and lay[i].indexer is None for i in (0, 1))
    assert [lay[i].compressor.ratio for i in range(2, 8)] == [2, 2, 2, 1, 1, 1]
    assert lay[2].compressor.tail_z.shape[0] == 2 + BT
    assert bool(torch.isinf(lay[2].compressor.tail_z).all())  # fresh: z = -inf
    # aliasing is within a sequence, never across slots
    assert other.layers[3].compressor is other.layers[2].compressor
    assert other.layers[3].compressor is not lay[3].compressor
    assert other.layers[2].compressor.tail_kv.data_ptr() != lay[2].compressor.tail_kv.data_ptr()
    cache.reset_slots([0, 1])  # zero-length tails of C1 owners and projected keys: no error


def test_writes_through_a_sharer_land_in_the_source_pool():
    L = CacheLayout.from_config(v41_cfg(), torch.float32, backtrack=BT)
    cache = StateCache(L, num_slots=1, num_blocks=4)
    st = cache.bind(0, [3, 1])
    rows = torch.randn(70, L.head_dim)  # C2: 64 rows per block -> 2 blocks
    st.layers[3].compressor.write_rows(0, rows)
    st.layers[2].compressor.n_rows = 70
    assert torch.equal(st.layers[3].compressor.read_rows(), rows)
    assert torch.equal(cache.comp[2]["rows"][3], rows[:64])  # block 0 of the table is pool block 3
    assert torch.equal(cache.comp[2]["rows"][1, :6], rows[64:])
    keys = torch.randn(130, L.index_head_dim)  # C1: 128 keys per block
    st.layers[7].indexer.write_rows(0, keys)
    st.layers[5].indexer.n_rows = 130
    assert torch.equal(st.layers[6].indexer.read_rows(), keys)
    assert torch.equal(cache.index[5]["rows"][1, :2], keys[128:])


def test_rollback_on_aliased_states():
    L = CacheLayout.from_config(v41_cfg(), torch.float32, backtrack=BT)
    cache = StateCache(L, num_slots=1, num_blocks=2)
    st = cache.bind(0, [0, 1])
    n = 41
    st.num_tokens = n
    for i in (2, 4, 5):
        r = L.ratios[i]
        st.layers[i].compressor.n_rows = n // r
        st.layers[i].indexer.n_rows = n // r
    st.rollback(n - 5)  # 36
    for i in range(2, 8):
        r = L.ratios[i]
        assert st.layers[i].compressor.n_rows == (n - 5) // r, i
        assert st.layers[i].indexer.n_rows == (n - 5) // r, i
    assert st.num_tokens == 36
    st.rollback(36)  # a no-op rollback keeps the counts
    assert (st.layers[3].compressor.n_rows, st.layers[7].compressor.n_rows) == (18, 36)
    st.rollback(31)
    assert (st.layers[3].compressor.n_rows, st.layers[6].indexer.n_rows) == (15, 31)
    with pytest.raises(ValueError, match="backtrack=6"):
        st.rollback(24)


# ---- V4: unchanged -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_layout_bytes_by_hand(dtype):
    d4 = tiny_config_dict()
    cfg = ModelConfig.from_dict(d4)
    e, d, di, w = dtype.itemsize, d4["head_dim"], d4["index_head_dim"], d4["sliding_window"]
    ratios = d4["compress_ratios"][: d4["num_hidden_layers"] + d4["num_nextn_predict_layers"]]
    L = CacheLayout.from_config(cfg, dtype, backtrack=BT)
    assert L.kv_owner is None and L.ratios == tuple(ratios)
    assert {L.index_kind(i) for i, r in enumerate(ratios) if r == 4} == {"compressor"}

    def tails(r: int) -> int:  # c*ratio + backtrack tokens of c*d fp32 channels, kv and z
        c = 2 if r == 4 else 1
        return 2 * (c * r + BT) * c * d * F32 + (2 * (c * r + BT) * c * di * F32 if r == 4 else 0)

    slot = len(ratios) * (w + BT) * d * e + sum(tails(r) for r in ratios if r)
    block = sum(128 // r * d * e + (128 // r * di * e if r == 4 else 0) for r in ratios if r)
    assert (L.slot_bytes, L.block_bytes) == (slot, block)
    cache = StateCache(L, 2, 3)
    assert cache.nbytes() == L.cache_bytes(2, 3)
    st = cache.bind(0, [0, 1, 2])
    comps = [layer.compressor for layer in st.layers if layer.compressor is not None]
    assert len(comps) == sum(1 for r in ratios[: d4["num_hidden_layers"]] if r)
    assert len({id(c) for c in comps}) == len(comps)  # nothing shared in V4
    assert all(c.overlap == (c.ratio == 4) for c in comps)
