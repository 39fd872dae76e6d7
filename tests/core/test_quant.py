"""Bit-exact tests of deepinfer_core.ops.quant against hand-computed values."""
from __future__ import annotations

import torch

from deepinfer_core.ops.quant import (
    FP4_LUT, dequant_fp4, dequant_fp8_block, e8m0_to_float, fake_quant_fp4, fake_quant_fp8,
    hadamard_transform, pow2_ceil, quant_fp8_act, quantize_fp4, quantize_fp8_block, unpack_fp4,
)


def f32(vals) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns (so -0.0 vs 0.0 and dtype differences are caught)."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.view(torch.int32) if got.dtype == torch.float32 else got.view(torch.int16),
                       want.view(torch.int32) if want.dtype == torch.float32 else want.view(torch.int16)), \
        f"\n got {got.tolist()}\nwant {want.tolist()}"


# ---- scales ------------------------------------------------------------------------------------

def test_e8m0_to_float_bytes_and_dtype():
    b = torch.tensor([127, 120, 130, 1, 0, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float(b)
    want = f32([1.0, 2.0 ** -7, 8.0, 2.0 ** -126, 2.0 ** -127, 2.0 ** 127, float("nan")])
    assert torch.equal(got[:6], want[:6]) and torch.isnan(got[6])
    assert torch.equal(e8m0_to_float(b[:6].view(torch.float8_e8m0fnu)), want[:6])


def test_pow2_ceil_normals():
    x = f32([1.0, 0.75, 3.0, 2.0 ** -10, 1.0 + 2.0 ** -23, 448.0, 0.5, 1.0 - 2.0 ** -24, 3.0 / 448])
    want = f32([1.0, 1.0, 4.0, 2.0 ** -10, 2.0, 512.0, 0.5, 1.0, 2.0 ** -7])
    assert torch.equal(pow2_ceil(x), want)


def test_pow2_ceil_subnormals_and_edges():
    # Bit-pattern rule: exponent field 0 + non-zero mantissa -> field 1 -> 2^-126 (reference kernel).
    x = f32([2.0 ** -130, 2.0 ** -149, 3 * 2.0 ** -128, 2.0 ** -126, 2.0 ** -126 * (1 + 2.0 ** -23), 0.0])
    want = f32([2.0 ** -126, 2.0 ** -126, 2.0 ** -126, 2.0 ** -126, 2.0 ** -125, 0.0])
    assert torch.equal(pow2_ceil(x), want)
    assert torch.equal(pow2_ceil(f32([2.0 ** 127])), f32([2.0 ** 127]))


# ---- FP8 activation fake-quant -----------------------------------------------------------------

def test_fake_quant_fp8_hand_computed_block():
    # amax 3.0 -> 3/448 = 0.0067 -> s = 2^-7, so x/s = 128 x.
    x = f32([3.0, 1.0, 0.01,
             1.0625 / 128,   # 1.0625: halfway 1.0 (mant 000) / 1.125 (001) -> even -> 1.0
             1.1875 / 128,   # 1.1875: halfway 1.125 (001) / 1.25 (010) -> even -> 1.25
             2.125,          # 272: halfway 256 (000) / 288 (001) -> 256
             2.375,          # 304: halfway 288 (001) / 320 (010) -> 320
             -3.0,
             2.0 ** -17,     # 2^-10: halfway 0 / 2^-9 (smallest subnormal) -> 0
             3 * 2.0 ** -17])  # 1.5 * 2^-9: halfway 2^-9 / 2^-8 -> 2^-8
    want = f32([3.0, 1.0, 1.25 / 128, 1.0 / 128, 1.25 / 128, 2.0, 2.5, -3.0, 0.0, 2.0 ** -15])
    assert_bits_equal(fake_quant_fp8(x, block=10), want)


def test_fake_quant_fp8_blocks_floor_and_scales():
    # Block 0: amax 3 -> s 2^-7. Block 1: all zero -> amax floor 1e-4 -> 1e-4/448 = 2.23e-7 -> s 2^-22.
    # Block 2: amax 1e-5 < floor -> s 2^-22; 1e-5 * 2^22 = 41.94 -> e4m3 step 4 in [32,64) -> 40.
    x = f32([[3.0, 1.0], [0.0, 0.0], [1e-5, 0.0]]).reshape(1, 6)
    q, s = quant_fp8_act(x, block=2)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, f32([[2.0 ** -7, 2.0 ** -22, 2.0 ** -22]]))
    assert torch.equal(q.float(), f32([[384.0, 128.0, 0.0, 0.0, 40.0, 0.0]]))
    want = f32([[3.0, 1.0, 0.0, 0.0, 40 * 2.0 ** -22, 0.0]])
    assert_bits_equal(fake_quant_fp8(x, block=2), want)


def test_fake_quant_fp8_bf16_input_and_shape():
    # bf16(0.01) = 0.010009765625 -> *128 = 1.28125 -> 1.25 -> 0.009765625 (exact in bf16).
    x = torch.tensor([[3.0, 0.01, -448.0 / 128, 0.0]], dtype=torch.bfloat16)
    got = fake_quant_fp8(x, block=4)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert_bits_equal(got, torch.tensor([[3.0, 0.009765625, -3.5, 0.0]], dtype=torch.bfloat16))


def test_fake_quant_fp8_matches_brute_force_nearest_even():
    # Independent oracle: enumerate every finite e4m3 value; nearest, ties to the even byte code.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(codes)
    vals, idx = codes[finite], torch.arange(256)[finite]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g) * torch.logspace(-3, 2, 256)
    got = fake_quant_fp8(x, block=128)
    xb = x.reshape(4, 2, 128)
    s = pow2_ceil(xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)
    t = (xb / s).reshape(-1, 1)
    d = (t - vals[None]).abs()
    best = d.min(1, keepdim=True).values
    cand = torch.where(d == best, idx[None], 1 << 20)
    even = torch.where((cand % 2 == 0) & (cand < 256), cand, 1 << 20).min(1).values
    pick = torch.where(even < 256, even, cand.min(1).values)
    ref = (codes[pick].reshape(4, 2, 128) * s).reshape(4, 256)
    assert torch.equal(got.abs(), ref.abs())


# ---- FP4 activation fake-quant -----------------------------------------------------------------

def test_fake_quant_fp4_grid_and_all_ties():
    # amax 6 -> s = 1; grid points stay, ties go to the even code.
    x = f32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,     # the 7 ties + max
             0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0,        # on grid
             0.26, 0.74, 1.3, 1.7, 2.6, 3.4, 5.1, 4.9,       # off-tie
             -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1])
    want = f32([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0,
                0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0,
                0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0, 4.0,
                -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -0.0])
    assert_bits_equal(fake_quant_fp4(x), want)


def test_fake_quant_fp4_scales():
    # Block 0: amax 3 -> 3/6 = 0.5 -> s = 0.5: 3 -> 6*0.5; 0.2 -> 0.4 -> 0.5 -> 0.25; 0.125 -> tie 0/0.5 -> 0.
    # Block 1: amax 7 -> 7/6 -> s = 2: 7 -> 3.5 -> tie 3/4 -> 4 -> 8; 1 -> 0.5 -> 1.
    # Block 2: zeros -> amax floor 6*2^-126 -> s = 2^-126, stays 0.
    x = f32([3.0, 0.2, 0.125, -1.0, 7.0, 1.0, 5.0, -2.9, 0.0, 0.0, 0.0, 0.0])
    want = f32([3.0, 0.25, 0.0, -1.0, 8.0, 1.0, 4.0, -3.0, 0.0, 0.0, 0.0, 0.0])
    assert_bits_equal(fake_quant_fp4(x, block=4), want)
    xb = x.to(torch.bfloat16)
    assert_bits_equal(fake_quant_fp4(xb, block=4), want.to(torch.bfloat16))


def test_fake_quant_fp4_matches_brute_force():
    grid = torch.tensor(FP4_LUT[:8])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g) * 3
    got = fake_quant_fp4(x)
    xb = x.reshape(8, 2, 32)
    s = pow2_ceil(xb.abs().amax(-1, keepdim=True) / 6)
    a = (xb / s).abs().reshape(-1, 1)
    d = (a - grid[None]).abs()
    best = d.min(1, keepdim=True).values
    code = torch.where(d == best, torch.arange(8)[None], 99)
    even = torch.where(code % 2 == 0, code, 99).min(1).values  # a tie always has one even code
    pick = torch.where(even < 99, even, code.min(1).values)
    ref = (grid[pick].reshape(8, 2, 32) * s).reshape(8, 64) * x.sign()
    assert torch.equal(got, ref)


# ---- Hadamard ----------------------------------------------------------------------------------

def test_hadamard_hand_example():
    # H4 = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]] / 2; H4 [1,2,3,4] = [10,-2,-4,0]/2.
    assert torch.equal(hadamard_transform(f32([1, 2, 3, 4])), f32([5, -1, -2, 0]))
    assert torch.equal(hadamard_transform(f32([[0, 1, 0, 0]])), f32([[0.5, -0.5, 0.5, -0.5]]))


def test_hadamard_is_sylvester_and_involution():
    for n in (2, 16, 64, 128):
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        eye = torch.eye(n)
        got = hadamard_transform(eye)
        assert torch.allclose(got, h * n ** -0.5, atol=0, rtol=1e-6)
        back = hadamard_transform(got)
        if n in (16, 64):  # n^-0.5 exact in fp32 -> H.H = I exactly
            assert torch.equal(back, eye)
        assert torch.allclose(back, eye, atol=1e-6)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    y = hadamard_transform(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


# ---- weight dequantisation ---------------------------------------------------------------------

def test_dequant_fp8_block_hand_computed():
    # e4m3 bytes: 0x38 = 1.0, 0x40 = 2.0, 0xC4 = -3.0, 0x7E = 448, 0x01 = 2^-9, 0x00 = 0.
    w = torch.tensor([[0x38, 0x40, 0xC4, 0x7E],
                      [0x01, 0x00, 0x38, 0xC4]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.tensor([[127, 120], [130, 126]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequant_fp8_block(w, s, block=(1, 2), dtype=torch.float32)
    want = f32([[1.0, 2.0, -3.0 / 128, 448.0 / 128],
                [8 * 2.0 ** -9, 0.0, 0.5, -1.5]])
    assert torch.equal(got, want)
    assert torch.equal(dequant_fp8_block(w, s, block=(1, 2)), want.to(torch.bfloat16))


def test_dequant_fp8_block_partial_edges():
    w = torch.full((3, 5), 1.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[127, 128, 129], [126, 125, 124]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequant_fp8_block(w, s, block=(2, 2), dtype=torch.float32)
    want = f32([[1, 1, 2, 2, 4], [1, 1, 2, 2, 4], [0.5, 0.5, 0.25, 0.25, 0.125]])
    assert torch.equal(got, want)


def test_unpack_and_dequant_fp4_hand_computed():
    # 0x2F: low F -> -6, high 2 -> 1.0; 0x71: low 1 -> 0.5, high 7 -> 6; 0x8A: low A -> -1, high 8 -> -0.
    packed = torch.tensor([[0x2F, 0x71, 0x8A]], dtype=torch.uint8)
    want = f32([[-6.0, 1.0, 0.5, 6.0, -1.0, -0.0]])
    assert_bits_equal(unpack_fp4(packed), want)
    assert_bits_equal(unpack_fp4(packed.view(torch.int8)), want)
    s = torch.tensor([[126, 129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 0.5, 4 per 2 columns
    got = dequant_fp4(packed.view(torch.int8), s, block=4, dtype=torch.float32)
    assert_bits_equal(got, f32([[-3.0, 0.5, 0.25, 3.0, -4.0, -0.0]]))


# ---- encoders ----------------------------------------------------------------------------------

def test_quantize_fp8_block_hand_and_roundtrip():
    w = torch.zeros(2, 4)
    w[0, 0], w[0, 1], w[1, 2] = 3.0, 1.0 / 128, -0.75
    q, s = quantize_fp8_block(w, block=(1, 2))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    # amax 3 -> 2^-7 (byte 120); zero block -> floor 1e-4 -> 2^-22 (105); amax .75 -> 2^-9 (118).
    assert s.view(torch.uint8).tolist() == [[120, 105], [105, 118]]
    assert q.float().tolist() == [[384.0, 1.0, 0.0, 0.0], [0.0, 0.0, -384.0, 0.0]]
    assert torch.equal(dequant_fp8_block(q, s, block=(1, 2), dtype=torch.float32), w)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 384, generator=g)
    q, s = quantize_fp8_block(w)
    wq = dequant_fp8_block(q, s, dtype=torch.float32)
    q2, s2 = quantize_fp8_block(wq)  # on-grid values re-encode to the same values
    assert torch.equal(dequant_fp8_block(q2, s2, dtype=torch.float32), wq)
    assert torch.equal(dequant_fp8_block(q, s), wq.to(torch.bfloat16))  # lossless in bf16


def test_quantize_fp4_hand_and_roundtrip():
    w = f32([[6.0, 1.0, -0.5, 2.5, 0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_fp4(w, block=4)
    # s0 = 1 (127); codes 7,2,9,4 (2.5 ties to 2 = code 4) -> bytes 0x27, 0x49; zeros -> s 2^-126 (1).
    assert q.dtype == torch.int8 and s.dtype == torch.float8_e8m0fnu
    assert q.view(torch.uint8).tolist() == [[0x27, 0x49, 0x00, 0x00]]
    assert s.view(torch.uint8).tolist() == [[127, 1]]
    assert torch.equal(dequant_fp4(q, s, block=4, dtype=torch.float32),
                       f32([[6.0, 1.0, -0.5, 2.0, 0.0, 0.0, 0.0, 0.0]]))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g) * 0.05
    q, s = quantize_fp4(w)
    assert q.shape == (64, 64) and s.shape == (64, 4)
    wq = dequant_fp4(q, s, dtype=torch.float32)
    assert torch.equal(wq, fake_quant_fp4(w))       # encoder == activation fake-quant rule
    # Bytes may differ (a block whose max rounds to 3 re-encodes with half the scale), values not.
    q2, s2 = quantize_fp4(wq)
    assert torch.equal(dequant_fp4(q2, s2, dtype=torch.float32), wq)
    assert torch.equal(dequant_fp4(q, s), wq.to(torch.bfloat16))


def test_fp4_to_fp8_re_encoding_is_exact_or_refused():
    from deepinfer_core.ops.quant import dequant_fp4, dequant_fp8_block, fp4_to_fp8_block, quantize_fp4
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.02
    w[5, 64:96] *= 2 ** 10                     # group scales spanning 10 binades in one block: still exact
    w[200:, :] = 0.0                           # an all-zero block
    packed, scale = quantize_fp4(w)
    q, s = fp4_to_fp8_block(packed, scale)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    assert torch.equal(dequant_fp8_block(q, s, (128, 128), torch.float32), dequant_fp4(packed, scale, 32, torch.float32))
    w[0, :32] *= 2 ** 20                       # 20 binades apart: e4m3 cannot hold both ends
    assert fp4_to_fp8_block(*quantize_fp4(w)) is None
