"""With the QAT numerics on, each portable op rounds where DeepSeek's official inference code rounds.

Every test writes the official formula for one op out by hand, in plain torch, in the order of the
official `inference/model.py` (and, for the attention softmax the mHC split and the FP8/FP4 GEMMs, its kernels), and
asks the engine's op for the same bits, in bfloat16 as DeepSeek ships it. A second assertion shows
the test can fail: the clean (`official=False`) op differs from the transcription somewhere.
"""
from __future__ import annotations

import math
import types

import pytest
import torch

from deepinfer_core.config import YarnScaling
from deepinfer_core.model.layers import Linear
from deepinfer_core.model.rope import RotaryTable
from deepinfer_core.ops.portable_attention import PortableAttentionBackend
from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.portable_mhc import PortableMHC
from deepinfer_core.ops.portable_pointwise import PortablePointwise
from deepinfer_core.ops.quant import (
    e8m0_to_float,
    fake_quant_fp8,
    quant_fp8_act,
    quantize_fp4,
    quantize_fp8_block,
    unpack_fp4,
)

BF16 = torch.bfloat16
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- 1. per-head query RMS norm -----------------------------------------------------------------

def official_head_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """Square, mean, + eps, rsqrt and the product, each in the activation dtype. Each step rounds
    its fp32 result, as on the GPUs DeepSeek runs: on the CPU, torch's bf16 rsqrt of a few elements
    takes a scalar path that rounds otherwise, so the rsqrt is spelled out."""
    ms = q.square().mean(-1, keepdim=True)
    return q * torch.rsqrt((ms + eps).float()).to(q.dtype)


def test_head_norm_is_the_official_formula():
    q = (torch.randn(37, 4, 128, generator=gen(0)) * 3).to(BF16)
    rope = RotaryTable(64, 10000.0, None, official=True)
    pos = torch.zeros(37, dtype=torch.long)                  # position 0: RoPE is the identity
    got = PortablePointwise(official=True).norm_rope_quant(q, pos, rope, norm="head", eps=EPS)
    assert torch.equal(got, official_head_norm(q, EPS))
    clean = PortablePointwise().norm_rope_quant(q, pos, RotaryTable(64, 10000.0, None), norm="head",
                                                eps=EPS)
    assert not torch.equal(clean, official_head_norm(q, EPS))


# ---- 2. RoPE tables and rotation ------------------------------------------------------------------

def official_rope_table(dim: int, seqlen: int, orig: int, base: float, factor: float, fast: float,
                        slow: float) -> torch.Tensor:
    """Complex64 [seqlen, dim/2]: float32 inverse frequencies, the YaRN blend in float32, polar."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if orig > 0:
        def corr_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
        lo = max(math.floor(corr_dim(fast)), 0)
        hi = min(math.ceil(corr_dim(slow)), dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        smooth = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(seqlen), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def official_rotate(x: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, inverse: bool):
    """x [T, H, D]: the last table-width*2 channels as complex pairs times the table row."""
    rd = table.shape[1] * 2
    cis = table[pos].conj() if inverse else table[pos]
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    y = x.clone()
    y[..., -rd:] = torch.view_as_real(pairs * cis[:, None, :]).flatten(-2).to(x.dtype)
    return y


@pytest.mark.parametrize("yarn", [None, YarnScaling(16, 1024, 32, 1)], ids=["plain", "yarn"])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_is_the_official_table_and_rotation(yarn, inverse):
    base = 160000.0 if yarn else 10000.0
    table = official_rope_table(64, 5000, yarn.original_max_position_embeddings if yarn else 0, base,
                                yarn.factor if yarn else 1.0, 32, 1)
    pos = torch.randint(0, 5000, (40,), generator=gen(1))
    x = torch.randn(40, 3, 128, generator=gen(2)).to(BF16)
    got = RotaryTable(64, base, yarn, official=True).apply(x, pos, inverse=inverse)
    assert torch.equal(got, official_rotate(x, table, pos, inverse))
    if yarn:     # the clean table (double precision) is another table
        clean = RotaryTable(64, base, yarn).inv_freq
        assert not torch.equal(clean, table[1].angle().float())


# ---- 3. mHC -----------------------------------------------------------------------------------------

def official_mhc_split(mixes, scale, base, hc: int, iters: int, eps: float):
    """pre, post, comb from the mixes, as the official split-and-Sinkhorn kernel computes them."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def official_mhc_mixes(x: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.flatten(1).float()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS)
    return torch.nn.functional.linear(flat, fn) * rsqrt, flat


def mhc_inputs(T=9, hc=4, D=256):
    g = gen(3)
    x = torch.randn(T, hc, D, generator=g).to(BF16)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05
    return x, fn, torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g)


def test_mhc_pre_and_head_are_the_official_formula():
    x, fn, scale, base = mhc_inputs()
    mixes, flat = official_mhc_mixes(x, fn)
    pre, post, comb = official_mhc_split(mixes, scale, base, 4, 20, EPS)
    y = (pre[..., None] * flat.view(x.shape)).sum(dim=1).to(x.dtype)
    ops = PortableMHC(4, 20, EPS, EPS, official=True)
    got = ops.pre(x, fn, scale, base)
    for a, b in zip(got, (y, post, comb)):
        assert torch.equal(a, b)
    head_pre = torch.sigmoid(official_mhc_mixes(x, fn[:4])[0] * scale[0] + base[:4]) + EPS
    want_head = (head_pre[..., None] * flat.view(x.shape)).sum(dim=1).to(x.dtype)
    assert torch.equal(ops.head(x, fn[:4], scale[0], base[:4]), want_head)
    clean = PortableMHC(4, 20, EPS, EPS).pre(x, fn, scale, base)
    assert not all(torch.equal(a, b) for a, b in zip(clean, (y, post, comb)))


def test_mhc_post_is_the_official_formula():
    x, fn, scale, base = mhc_inputs()
    f = torch.randn(x.shape[0], x.shape[2], generator=gen(4)).to(BF16)
    _, post, comb = PortableMHC(4, 20, EPS, EPS).pre(x, fn, scale, base)
    want = (post[..., None] * f[:, None, :] + (comb[..., None] * x[:, :, None, :]).sum(dim=1))
    got = PortableMHC(4, 20, EPS, EPS, official=True).post(f, x, post, comb)
    assert torch.equal(got, want.to(BF16))


# ---- 4. attention softmax with the sink ---------------------------------------------------------

def official_sparse_attention(q, keys, sink, scale):
    """One query block over <= 64 keys [K, D] (all visible): the kernel's order."""
    s = (q.float() @ keys.float().t()) * scale                    # [H, K]
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    acc = p.to(keys.dtype).float() @ keys.float()
    total = p.sum(-1, keepdim=True) + torch.exp(sink[:, None] - m)
    return (acc / total).to(q.dtype)


def test_attention_softmax_is_the_official_order():
    W, H, D, n = 16, 4, 128, 20
    g = gen(5)
    q = torch.randn(n, H, D, generator=g).to(BF16)
    kv = torch.randn(n, D, generator=g).to(BF16)
    sink = torch.randn(H, generator=g)
    attn = types.SimpleNamespace(window=W, attn_sink=sink, scale=D ** -0.5)
    st = types.SimpleNamespace(ring=torch.zeros(W, D, dtype=BF16))
    pos = torch.arange(n)
    got = PortableAttentionBackend.attend(attn, q, kv, st, 0, pos, None, None, official=True)
    want = torch.stack([official_sparse_attention(q[t], kv[max(0, t - W + 1):t + 1], sink, D ** -0.5)
                        for t in range(n)])
    assert torch.equal(got, want)
    clean = PortableAttentionBackend.attend(attn, q, kv, st, 0, pos, None, None)
    assert not torch.equal(clean, want)


# ---- 5. indexer scores and top-k -----------------------------------------------------------------

def official_index_topk(q, keys, proj, head_dim: int, n_heads: int, topk: int):
    """Scores in the activation dtype: weights scaled in bf16, the q.k products, ReLU times the
    weights, the head sum; the causal mask of a prefill from position 0; torch.topk."""
    weights = proj * (head_dim ** -0.5 * n_heads ** -0.5)
    score = torch.einsum("shd,td->sht", q, keys)
    score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=1)
    n = q.shape[0]
    invisible = torch.arange(keys.shape[0]).repeat(n, 1) >= torch.arange(1, n + 1).unsqueeze(1) // 4
    score = score + torch.where(invisible, float("-inf"), 0)
    return score.topk(min(topk, keys.shape[0]), dim=-1)[1], invisible


def test_indexer_scores_are_the_official_formula():
    n, Hi, Di, topk = 64, 16, 128, 8
    g = gen(6)
    q = torch.randn(n, Hi, Di, generator=g).to(BF16)
    # near-duplicate keys: scores part in fp32 but often tie in bf16, where the orders differ
    keys = (torch.randn(1, Di, generator=g) + 0.02 * torch.randn(n // 4, Di, generator=g)).to(BF16)
    proj = torch.randn(n, Hi, generator=g).to(BF16)
    top, invisible = official_index_topk(q, keys, proj, Di, Hi, topk)
    want = torch.zeros(n, n // 4, dtype=torch.bool).scatter_(1, top, True) & ~invisible
    w = proj * (Di ** -0.5 * Hi ** -0.5)                 # Indexer.head_weights with QAT on
    got = PortableAttentionBackend(official=True).index_select(q, w, keys, torch.arange(n), 4, topk)
    assert torch.equal(got, want)
    clean = PortableAttentionBackend().index_select(q, w.float(), keys, torch.arange(n), 4, topk)
    assert not torch.equal(clean, want)


# ---- 6. FP8 / FP4 linears: the GEMM kernels' per-block sums -------------------------------------

def official_block_gemm(x, w_vals, w_scale_of_block, k_block: int):
    """act_quant (128-wide FP8 blocks, power-of-two scales), then per K block: the fp32 sum of the
    FP8 x FP8 (or FP4) products times both scales, added to an fp32 accumulator block by block,
    rounded to the activation dtype at the end."""
    xq, sx = quant_fp8_act(x, 128)
    acc = torch.zeros(x.shape[0], w_vals.shape[0])
    for b in range(x.shape[1] // k_block):
        cols = slice(b * k_block, (b + 1) * k_block)
        part = torch.nn.functional.linear(xq[:, cols].float(), w_vals[:, cols])
        acc += part * sx[:, b * k_block // 128, None] * w_scale_of_block(b)[None, :]
    return acc.to(x.dtype)


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantised_linear_sums_per_block_like_the_kernels(fmt, dtype):
    g = gen(7)
    K, N = 512, 256
    master = torch.randn(N, K, generator=g) * 0.05
    layer = Linear(K, N, fmt)
    if fmt == "fp8":
        layer.weight, layer.scale = quantize_fp8_block(master)
        vals = layer.weight.float()
        scale = e8m0_to_float(layer.scale)                       # [N/128, K/128]

        def block_scale(b):
            return scale[:, b].repeat_interleave(128)
    else:
        layer.weight, layer.scale = quantize_fp4(master)
        vals = unpack_fp4(layer.weight).float()
        scale = e8m0_to_float(layer.scale)                       # [N, K/32]

        def block_scale(b):
            return scale[:, b]
    want_vals = vals.clone()
    method = PortableLinearMethod(dtype, simulate_qat=True)
    layer.method = method
    method.process_weights(layer)
    x = (torch.randn(33, K, generator=g) * 2).to(dtype)
    want = official_block_gemm(x, want_vals, block_scale, 128 if fmt == "fp8" else 32)
    assert torch.equal(layer(x), want)
    # FP4 x FP8 products have few bits and often sum exactly; in bf16 the two sums rarely part
    # after the rounding: the fp8 weights in fp32 show the order matters
    if fmt == "fp8" and dtype == torch.float32:
        one_sum = torch.nn.functional.linear(fake_quant_fp8(x), layer.weight)
        assert not torch.equal(one_sum, want)


def test_blockwise_linear_in_row_chunks_is_bit_identical(monkeypatch):
    """The batched per-block products are bounded in memory by splitting the rows; every row's
    sums are its own, so the chunked result is the same bits."""
    from deepinfer_core.ops import portable_linear as pl
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(64, 256, generator=g)
    whole = pl.blockwise_linear(x, w, 32)
    monkeypatch.setattr(pl, "BLOCKWISE_BYTES", 4 * 8 * 64 * 7)      # 7 rows per chunk
    assert torch.equal(pl.blockwise_linear(x, w, 32), whole)
