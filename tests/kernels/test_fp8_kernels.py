"""FP8 activation quantisation and the block-scaled FP8 GEMMs against their core references on
random inputs: decode-like and prefill-like row counts, K not a multiple of 128, partial weight
blocks, and zero / huge rows."""
from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.fp8_gemm import fp8_gemm, tile_config
from deepinfer_kernels.fp8_quant import act_quant, act_quant_values

from deepinfer_core.ops.quant import dequant_fp8_block, e8m0_to_float, fake_quant_fp8, quantize_fp8_block


@pytest.mark.parametrize("M,K", [(1, 128), (7, 256), (33, 200), (3, 1000)])
def test_act_quant_equals_the_core_fake_quant_bit_for_bit(kdev, M, K):
    g = torch.Generator().manual_seed(M * 1000 + K)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M)[:, None]
    x[0, :5] = 0.0
    if M > 2:
        x[2] = 0.0                                   # an all-zero row: the amax floor applies
    x = x.to(torch.bfloat16)
    q, s = act_quant(x.to(kdev))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (M, -(-K // 128))
    deq = q.float().cpu() * s.cpu().repeat_interleave(128, 1)[:, :K]
    want = fake_quant_fp8(x.float(), 128)
    assert torch.equal(deq, want)
    values = act_quant_values(x.to(kdev))           # the same values in one launch (the CUDA-core MoE's)
    assert values.dtype == torch.float32 and torch.equal(values.cpu(), want)


def fp8_tolerance(device: str) -> float:
    """Products of two e4m3 values are exact, so the interpreter (fp32 sums) lands near 1e-7. Hopper's
    FP8 tensor cores sum an MMA chain with a short mantissa: ~1e-4 relative, the hardware's own limit
    (DeepGEMM shows the same); the kernel promotes to fp32 every `PROMOTE_EVERY` channels."""
    return 1e-6 if device == "cpu" else 5e-4


def reference_gemm(qa, sa, qw, sw_e8m0, block=(128, 128)) -> torch.Tensor:
    K = qa.shape[1]
    a = qa.double() * sa.double().repeat_interleave(128, 1)[:, :K]
    w = dequant_fp8_block(qw, sw_e8m0, block, torch.float32).double()
    return a @ w.T


def spread_weights(N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Weights whose 32x32 blocks span ~12 binades: a 32x32 scale grid differs from a 128x128 one."""
    return torch.randn(N, K, generator=g) * torch.logspace(-6, -2, 8)[torch.randint(0, 8, (N // 32 + 1, K // 32 + 1),
                                                                                  generator=g)].repeat_interleave(
        32, 0).repeat_interleave(32, 1)[:N, :K]


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("M,N,K", [(1, 64, 128), (5, 192, 256), (17, 128, 384), (40, 320, 200), (70, 128, 136)])
def test_fp8_gemm_matches_dequantised_matmul(kdev, M, N, K, block):
    """128x128 weight blocks (V4) and 32x32 (V4.1: four weight scales per activation group)."""
    g = torch.Generator().manual_seed(M + N + K)
    w = torch.randn(N, K, generator=g) * 0.05 if block == (128, 128) else spread_weights(N, K, g)
    qw, sw = quantize_fp8_block(w, block)
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
    qa, sa = act_quant(x.to(kdev))
    out = fp8_gemm(qa, sa, qw.to(kdev), e8m0_to_float(sw).to(kdev), out_dtype=torch.float32, weight_block=block)
    ref = reference_gemm(qa.cpu(), sa.cpu(), qw, sw, block)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < fp8_tolerance(kdev), f"relative error {err:.2e}"
    bf = fp8_gemm(qa, sa, qw.to(kdev), e8m0_to_float(sw).to(kdev), out_dtype=torch.bfloat16, weight_block=block)
    assert bf.dtype == torch.bfloat16 and torch.allclose(bf.cpu().double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max())


def test_fp8_gemm_row_does_not_depend_on_the_other_rows(kdev, rows_match):
    """No split-K and a fixed K order: a row's output is the same alone and in a larger launch with the
    same tile shape (what batch-invariant mode builds on)."""
    g = torch.Generator().manual_seed(9)
    qw, sw = quantize_fp8_block(torch.randn(128, 256, generator=g) * 0.05)
    qa, sa = act_quant(torch.randn(48, 256, generator=g).to(kdev))
    cfg = tile_config(64)
    full = fp8_gemm(qa, sa, qw.to(kdev), e8m0_to_float(sw).to(kdev), torch.float32, cfg)
    alone = fp8_gemm(qa[5:6], sa[5:6], qw.to(kdev), e8m0_to_float(sw).to(kdev), torch.float32, cfg)
    rows_match(alone, full[5:6])


def test_fp8_gemm_rejects_mismatched_scales(kdev):
    qa, sa = act_quant(torch.randn(2, 256).to(kdev))
    qw, sw = quantize_fp8_block(torch.randn(128, 256))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemm(qa, sa[:, :1], qw.to(kdev), e8m0_to_float(sw).to(kdev))
    with pytest.raises(ValueError, match="do not fit"):        # 128x128 scales read as 32x32 blocks
        fp8_gemm(qa, sa, qw.to(kdev), e8m0_to_float(sw).to(kdev), weight_block=(32, 32))
    with pytest.raises(ValueError, match=r"weight_block=\(64, 64\); allowed: \(128, 128\), \(32, 32\)"):
        fp8_gemm(qa, sa, qw.to(kdev), e8m0_to_float(sw).to(kdev), weight_block=(64, 64))



@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("M,N,K,dtype", [(1, 128, 256, torch.float32), (9, 192, 384, torch.bfloat16),
                                         (40, 256, 200, torch.float32), (70, 128, 256, torch.bfloat16)])
def test_w8a16_gemm_matches_dequantised_matmul(kdev, M, N, K, dtype, block):
    from deepinfer_kernels.fp8_gemm import w8a16_gemm
    g = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=g) * 0.05 if block == (128, 128) else spread_weights(N, K, g)
    qw, sw = quantize_fp8_block(w, block)
    x = torch.randn(M, K, generator=g).to(dtype)
    out = w8a16_gemm(x.to(kdev), qw.to(kdev), e8m0_to_float(sw).to(kdev), weight_block=block)
    ref = x.double() @ dequant_fp8_block(qw, sw, block, torch.float32).double().T
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert out.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_k_matches_the_unsplit_gemm(kdev, splits):
    from deepinfer_kernels.fp8_gemm import split_k
    from deepinfer_kernels.fp8_gemm import tile_config as cfg_for
    g = torch.Generator().manual_seed(splits)
    qw, sw = quantize_fp8_block(torch.randn(128, 640, generator=g) * 0.05)
    qa, sa = act_quant(torch.randn(3, 640, generator=g).to(kdev))
    args = (qa, sa, qw.to(kdev), e8m0_to_float(sw).to(kdev), torch.float32)
    one, many = fp8_gemm(*args, splits=1), fp8_gemm(*args, splits=splits)
    ref = reference_gemm(qa.cpu(), sa.cpu(), qw, sw)
    for out in (one, many):
        assert (out.cpu().double() - ref).norm() / ref.norm() < fp8_tolerance(kdev)
    # decode shapes with few output tiles split; the split ignores M up to 64 rows
    assert split_k(512, 4096, cfg_for(1), 1, 132) == split_k(512, 4096, cfg_for(64), 64, 132) > 1
    assert split_k(32768, 1024, cfg_for(1), 1, 132) == 1 and split_k(512, 4096, cfg_for(65), 65, 132) == 1
