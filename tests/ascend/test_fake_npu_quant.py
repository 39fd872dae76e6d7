"""npu_dynamic_mx_quant and the MXFP8 npu_quant_matmul: reference values and constraints."""
from __future__ import annotations

import pytest
import torch


def test_dynamic_mx_quant_scales_by_hand(fake_npu):
    import torch_npu
    x = torch.zeros(1, 96)
    x[0, 0], x[0, 1] = 448.0, -3.0        # group 0: amax 448 -> 2^(8-8): code 127
    x[0, 32:64] = 0.5                      # group 1: amax 0.5 -> 2^(-1-8): code 118
    x[0, 64] = 3.0                         # group 2: amax 3 -> 2^(1-8): code 120
    q, s = torch_npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.uint8 and s.shape == (1, 2, 2)       # ceil(3 / 2) pairs, padded
    assert s.flatten()[:3].tolist() == [127, 118, 120]
    assert q[0, :2].float().tolist() == [448.0, -3.0]
    assert q[0, 32].float().item() == 0.5 * 2 ** 9 and q[0, 64].float().item() == 3.0 * 2 ** 7


def test_dynamic_mx_quant_non_tail_axis(fake_npu):
    import torch_npu
    x = torch.randn(64, 3, dtype=torch.bfloat16)
    q, s = torch_npu.npu_dynamic_mx_quant(x, axis=0, dst_type=292)
    assert q.shape == (64, 3) and s.shape == (1, 3, 2)
    deq = q.float() * torch.exp2(s.float() - 127).permute(0, 2, 1).reshape(2, 3).repeat_interleave(
        32, 0)
    torch.testing.assert_close(deq, x.float(), rtol=0.13, atol=1e-2)   # e4m3: 3 mantissa bits


def test_dynamic_mx_quant_constraints(fake_npu):
    import torch_npu
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="npu_dynamic_mx_quant: dst_type is 290"):
        torch_npu.npu_dynamic_mx_quant(x, dst_type=torch_npu.hifloat8)
    with pytest.raises(ValueError, match="npu_dynamic_mx_quant: block_size is 48"):
        torch_npu.npu_dynamic_mx_quant(x, dst_type=292, block_size=48)
    with pytest.raises(ValueError, match="npu_dynamic_mx_quant: round_mode is 'floor'"):
        torch_npu.npu_dynamic_mx_quant(x, dst_type=292, round_mode="floor")
    with pytest.raises(ValueError, match="npu_dynamic_mx_quant: axis is 2"):
        torch_npu.npu_dynamic_mx_quant(x, dst_type=292, axis=2)
    with pytest.raises(TypeError, match="npu_dynamic_mx_quant: takes 1 positional"):
        torch_npu.npu_dynamic_mx_quant(x, -1)


@pytest.mark.parametrize("fake_npu", [223], indirect=True)
def test_dynamic_mx_quant_is_a5_only(fake_npu):
    import torch_npu
    with pytest.raises(ValueError, match="npu_dynamic_mx_quant: soc_version is 223"):
        torch_npu.npu_dynamic_mx_quant(torch.randn(2, 64), dst_type=292)


def _mx_args(m=2, k=64, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x1 = torch.randint(-8, 9, (m, k), generator=g).float().to(torch.float8_e4m3fn)
    w = torch.randint(-8, 9, (n, k), generator=g).float().to(torch.float8_e4m3fn)   # [N, K]
    ps = torch.randint(120, 130, (m, k // 64, 2), generator=g).to(torch.uint8)
    ws = torch.randint(120, 130, (n, k // 64, 2), generator=g).to(torch.uint8)
    return x1, w, ps, ws


def test_quant_matmul_mxfp8_against_a_loop(fake_npu):
    import torch_npu
    x1, w, ps, ws = _mx_args()
    out = torch_npu.npu_quant_matmul(
        x1, w.t(), ws.transpose(0, 1), pertoken_scale=ps, scale_dtype=torch_npu.float8_e8m0fnu,
        pertoken_scale_dtype=torch_npu.float8_e8m0fnu, group_sizes=[1, 1, 32],
        output_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            for kk in range(64):
                g = kk // 32
                a = x1[i, kk].double() * 2.0 ** (int(ps[i, g // 2, g % 2]) - 127)
                b = w[j, kk].double() * 2.0 ** (int(ws[j, g // 2, g % 2]) - 127)
                ref[i, j] += a * b
    torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double())


def test_quant_matmul_mxfp8_constraints(fake_npu):
    import torch_npu
    x1, w, ps, ws = _mx_args()
    ok = dict(pertoken_scale=ps, scale_dtype=293, pertoken_scale_dtype=293,
              group_sizes=[1, 1, 32], output_dtype=torch.bfloat16)
    scale = ws.transpose(0, 1)
    torch_npu.npu_quant_matmul(x1, w.t(), scale, **ok)
    with pytest.raises(ValueError, match="npu_quant_matmul: scale has shape \\(3, 1, 2\\)"):
        torch_npu.npu_quant_matmul(x1, w.t(), ws, **ok)
    with pytest.raises(ValueError, match="npu_quant_matmul: scale_dtype is 44"):
        torch_npu.npu_quant_matmul(x1, w.t(), scale, **{**ok, "scale_dtype": torch.float8_e8m0fnu})
    with pytest.raises(ValueError, match="npu_quant_matmul: group_sizes is \\[1, 1, 128\\]"):
        torch_npu.npu_quant_matmul(x1, w.t(), scale, **{**ok, "group_sizes": [1, 1, 128]})
    with pytest.raises(ValueError, match="npu_quant_matmul: x1 has dtype bfloat16"):
        torch_npu.npu_quant_matmul(x1.bfloat16(), w.t(), scale, **ok)
    with pytest.raises(ValueError, match="npu_quant_matmul: x2 has shape"):
        torch_npu.npu_quant_matmul(x1, w, scale, **ok)
    with pytest.raises(TypeError, match="npu_quant_matmul: takes 3 positional"):
        torch_npu.npu_quant_matmul(x1, w.t(), scale, None, ps)
