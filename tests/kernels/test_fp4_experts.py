"""FP4 experts decoded in registers (deepinfer_kernels.fp4_experts) give the FP8 path's bits: the fused
MoE with routed experts kept as packed e2m1 codes + UE8M0 group scales (the shared expert FP8) equals,
bit for bit, the same MoE on the load-time FP8 re-encoding of those experts, with QAT (W4A8) and
without (W4A16), in float32 and bfloat16; the decoded tiles equal `fp4_to_fp8_block`'s bytes; the
resident order holds every code and scale byte once; malformed FP4 experts are refused by name.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from deepinfer_kernels.fp4_experts import Fp4Experts, fp4_fits, fp4_tile, to_resident, to_word_order
from deepinfer_kernels.moe import fused_moe
from deepinfer_kernels.moe_routing import route_topk

from deepinfer_core.ops.quant import (
    e8m0_to_float,
    fp4_to_fp8_block,
    quantize_fp4,
    quantize_fp8_block,
)

E, K = 4, 2          # routed experts, top-k; the shared expert is expert E


@triton.jit
def _decode(p_ptr, g_ptr, s_ptr, out_ptr, N, K, NB_K: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PRMT: tl.constexpr = False):
    pid_n, kb = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    scale = tl.load(s_ptr + (offs_n // 128) * NB_K + (kb * BLOCK_K) // 128, mask=n_ok, other=0.0)
    tile = fp4_tile(p_ptr, g_ptr, offs_n, n_ok, kb * BLOCK_K, K, scale, BLOCK_N, BLOCK_K, PRMT)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[None, :] * K + offs_k[:, None], tile, mask=n_ok[None, :] & (offs_k < K)[:, None])


def random_fp4(n: int, k: int, gen: torch.Generator, spread: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code (both signs, zeros) and group scales over `spread` binades."""
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    groups = torch.randint(127 - spread, 128, (n, k // 32), generator=gen, dtype=torch.uint8)
    return codes, groups


DECODERS = ["integer", pytest.param("prmt", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("n,k,spread", [(208, 384, 10), (128, 128, 10), (128, 256, 13), (256, 512, 14)])
def test_decoded_tiles_are_the_re_encoded_bytes(kdev, n, k, spread, decoder):
    """spread 13: groups 12+ binades under their block's largest, whose small codes are e4m3 subnormals;
    14: the widest span the re-encoding keeps exact (0.5 at 2^-9, e4m3's smallest subnormal).
    "prmt": the compiled decoder (inline PTX: lookup tables and byte permutes, one group per tile)."""
    if decoder == "prmt":
        assert kdev == "cuda", "the byte-permute decoder is inline PTX: it needs a CUDA GPU"
    block_k = 32 if decoder == "prmt" else 128
    codes, groups = random_fp4(n, k, torch.Generator().manual_seed(n + k), spread)
    q, s8 = fp4_to_fp8_block(codes.view(torch.int8), groups)
    if spread > 11:
        assert (q.view(torch.uint8) & 0x78 == 0).logical_and(q.view(torch.uint8) & 7 != 0).any()   # subnormals
    out = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=kdev)
    nbk = triton.cdiv(k, 128)
    codes_r, groups_r = to_resident(codes, groups)
    _decode[(triton.cdiv(n, 64), triton.cdiv(k, block_k))](
        codes_r.to(kdev), groups_r.to(kdev), e8m0_to_float(s8).to(kdev), out, n, k, NB_K=nbk, BLOCK_N=64,
        BLOCK_K=block_k, PRMT=decoder == "prmt")
    got, want = out.cpu().view(torch.uint8), q.view(torch.uint8)
    bad = (got != want).nonzero()
    assert not len(bad), (f"{len(bad)} bytes differ, first at {bad[:4].tolist()}: got {got[got != want][:4].tolist()}"
                          f" want {want[got != want][:4].tolist()}, codes {codes.view(-1)[:1].tolist()}")


def stacked_experts(D: int, I: int, seed: int):
    """(FP8 w13, s13, w2, s2) with the routed experts re-encoded from FP4, and the same weights as
    (Fp4Experts w13, s13, Fp4Experts w2, s2): None where D or I is no multiple of 128."""
    gen = torch.Generator().manual_seed(seed)
    mats = {"w13": [], "w2": []}
    for e in range(E + 1):
        for name, (n, k) in (("w13", (I, D)), ("w13", (I, D)), ("w2", (D, I))):
            if e < E:
                mats[name].append(("fp4", *quantize_fp4(torch.randn(n, k, generator=gen) * k ** -0.5, 32)))
            else:
                mats[name].append(("fp8", *quantize_fp8_block(torch.randn(n, k, generator=gen) * k ** -0.5)))
    fp8_form, fp4_form = [], []
    for name, rows in (("w13", (2,)), ("w2", ())):
        ws, ss = [], []
        for fmt, w, s in mats[name]:
            q, s8 = fp4_to_fp8_block(w, s) if fmt == "fp4" else (w, s)
            ws.append(q)
            ss.append(e8m0_to_float(s8))
        shape = (E + 1, *rows, *ws[0].shape)
        w = torch.stack(ws).view(shape)
        s = torch.stack(ss).view(E + 1, *rows, *ss[0].shape)
        fp4 = [m for m in mats[name] if m[0] == "fp4"]
        packed = torch.stack([m[1].view(torch.uint8) for m in fp4]).view(E, *rows, *fp4[0][1].shape)
        groups = torch.stack([m[2].view(torch.uint8) for m in fp4]).view(E, *rows, *fp4[0][2].shape)
        fp8_form += [w, s]
        fits = fp4_fits(*w.shape[-2:])      # else only the FP8 form (sizes the FP4 tiles do not take)
        fp4_form += [Fp4Experts(*to_resident(packed, groups), w[E:].contiguous()) if fits else None, s]
    return fp8_form, fp4_form


def moe(x, weights, qat: bool, dtype, kdev, swap: bool = False):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(x.shape[0], E, generator=gen)
    ids, rw = route_topk(logits.to(kdev), K, bias=torch.zeros(E, device=kdev), renormalize=True,
                         routed_scale=1.5, shared_expert=True)
    w13, s13, w2, s2 = [_to(t, kdev) for t in weights]
    return fused_moe(x.to(kdev, dtype), ids, rw, w13, s13, w2, s2, n_clamped=E, swiglu_limit=0.8, quant_in=qat,
                     quant_mid=qat, compute_dtype=dtype, shared_last=True,
                     config=dict(block_m1=16, block_m2=16, block_n2=128, num_warps1=4, num_stages1=2,
                                 num_warps2=4, num_stages2=2, swap_ab1=swap, swap_ab2=swap))


def _to(t, dev):
    if isinstance(t, Fp4Experts):
        return Fp4Experts(t.packed.to(dev), t.groups.to(dev), t.fp8.to(dev))
    return t.to(dev)


@pytest.mark.parametrize("qat,dtype,D,I", [(True, torch.float32, 256, 128), (False, torch.float32, 128, 256),
                                           (True, torch.bfloat16, 128, 128), (False, torch.bfloat16, 128, 128)])
def test_fp4_experts_give_the_re_encoded_bits(kdev, qat, dtype, D, I):
    fp8_form, fp4_form = stacked_experts(D, I, seed=D + I)
    x = torch.randn(11, D, generator=torch.Generator().manual_seed(3))
    want = moe(x, fp8_form, qat, dtype, kdev)
    got = moe(x, fp4_form, qat, dtype, kdev)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_malformed_fp4_experts_are_refused():
    codes = torch.zeros(E, 2, 128, 64, dtype=torch.uint8)
    groups = torch.zeros(E, 2, 128, 4, dtype=torch.uint8)
    shared = torch.zeros(1, 2, 128, 128, dtype=torch.float8_e4m3fn)
    assert Fp4Experts(codes, groups, shared).shape == (E + 1, 2, 128, 128)
    with pytest.raises(ValueError, match="do not fit"):
        Fp4Experts(codes, groups[..., :3], shared)
    with pytest.raises(ValueError, match="uint8 codes"):
        Fp4Experts(codes.view(torch.int8), groups, shared)
    with pytest.raises(ValueError, match=r"\[N, K\] = \[120, 128\] cannot be resident as FP4 tiles"):
        Fp4Experts(*(t[:, :, :120].contiguous() for t in (codes, groups, shared)))
    with pytest.raises(ValueError, match="N a multiple of 16 and K of 128"):
        to_resident(torch.zeros(16, 80, dtype=torch.uint8), torch.zeros(16, 5, dtype=torch.uint8))
    w2 = Fp4Experts(torch.zeros(E, 128, 64, dtype=torch.uint8), torch.zeros(E, 128, 4, dtype=torch.uint8),
                    torch.zeros(1, 128, 128, dtype=torch.float8_e4m3fn))
    x = torch.zeros(2, 256)
    ids = torch.zeros(2, K + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit D=256"):
        fused_moe(x, ids, torch.ones(2, K + 1), Fp4Experts(codes, groups, shared), torch.ones(E + 1, 2, 1, 1), w2,
                  torch.ones(E + 1, 1, 1), n_clamped=E, swiglu_limit=0.0, quant_in=False, quant_mid=False,
                  compute_dtype=torch.float32)


def test_decoding_a_group_at_a_time_stays_close_under_the_interpreter(kdev, monkeypatch):
    """The GPU decodes 32 inputs per step and chains the dots (bitwise there: tests above, compiled);
    the interpreter's numpy dots round such a chain differently, so here: the same result to fp32 noise."""
    from deepinfer_kernels import moe_gemm
    monkeypatch.setattr(moe_gemm, "_fp4_sub", lambda: 32)
    fp8_form, fp4_form = stacked_experts(256, 128, seed=5)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(3))
    for qat in (True, False):
        want, got = moe(x, fp8_form, qat, torch.float32, kdev), moe(x, fp4_form, qat, torch.float32, kdev)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,D,I", [(torch.float32, 256, 128), (torch.bfloat16, 128, 256)])
def test_the_swapped_gemms_keep_fp4_equal_to_fp8_and_close_to_the_unswapped_ones(kdev, dtype, D, I):
    """w13 and w2 with the weights as the dots' first operand (`swap_ab1`, `swap_ab2`, QAT): FP4 experts
    still give their re-encoding's bits, and the result is the unswapped one up to the order of the fp32
    sums: compiled, that order can move an intermediate across an FP8 rounding boundary (a 1/16 step
    on that element), so the comparison is over the whole output, not per element."""
    fp8_form, fp4_form = stacked_experts(D, I, seed=D + I)
    x = torch.randn(11, D, generator=torch.Generator().manual_seed(3))
    plain = moe(x, fp8_form, True, dtype, kdev)
    want = moe(x, fp8_form, True, dtype, kdev, swap=True)
    got = moe(x, fp4_form, True, dtype, kdev, swap=True)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))
    rel = ((want.float() - plain.float()).norm() / plain.float().norm()).item()
    assert rel < 1e-2, rel


def test_the_swapped_gemms_refuse_unquantised_activations(kdev):
    fp8_form, _ = stacked_experts(128, 128, seed=1)
    with pytest.raises(ValueError, match="swap_ab=True needs FP8 activations"):
        moe(torch.randn(3, 128), fp8_form, False, torch.float32, kdev, swap=True)


def test_the_resident_order_holds_each_byte_once_where_the_kernels_read_it():
    """`to_resident` permutes whole words: every checkpoint word (bits in `to_word_order`) and scale byte
    is found once, at the address the kernels compute (`code_row` / `group_row`, restated here)."""
    n, k = 48, 384
    codes, groups = random_fp4(n, k, torch.Generator().manual_seed(11))
    codes_r, groups_r = to_resident(codes, groups)
    words = to_word_order(codes).view(torch.int32)             # [n, k / 8]
    flat_w, flat_g = codes_r.view(torch.int32).reshape(-1), groups_r.reshape(-1)
    rows = torch.arange(n)[:, None]
    h = torch.arange(0, k // 2, 4)[None, :]                      # each word's first code byte
    at = (rows // 16) * (k * 8) + ((rows % 16) // 8) * 512 + (rows % 8) * 64 + (h // 64) * 1024 + h % 64
    assert torch.equal(flat_w[at // 4], words)
    G = torch.arange(k // 32)[None, :]
    assert torch.equal(flat_g[(rows // 16) * (k // 2) + ((rows % 16) // 8) * 32 + (rows % 8) * 4 + (G // 4) * 64
                              + G % 4], groups)
    assert fp4_fits(4096, 2048) and not fp4_fits(4096, 2000) and not fp4_fits(4100, 2048)
