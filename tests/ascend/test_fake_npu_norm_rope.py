"""npu_rms_norm, npu_add_rms_norm, npu_rotary_mul: reference values and documented constraints."""
from __future__ import annotations

import pytest
import torch


def test_rms_norm_reference_by_hand(fake_npu):
    import torch_npu
    x = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    y, rstd = torch_npu.npu_rms_norm(x, torch.tensor([1.0, 2.0]), epsilon=0.0)
    # rms of (3, 4) = sqrt(12.5); of (1, 1) = 1
    r = 12.5 ** -0.5
    torch.testing.assert_close(rstd, torch.tensor([[r], [1.0]]))
    torch.testing.assert_close(y, torch.tensor([[3 * r, 8 * r], [1.0, 2.0]]))


def test_rms_norm_constraints(fake_npu):
    import torch_npu
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    torch_npu.npu_rms_norm(x, torch.ones(8))        # fp32 gamma with bf16 x: documented
    with pytest.raises(ValueError, match="npu_rms_norm: gamma has dtype torch.float16"):
        torch_npu.npu_rms_norm(x, torch.ones(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="npu_rms_norm: gamma .*trailing"):
        torch_npu.npu_rms_norm(x, torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="npu_rms_norm: input has dtype int32"):
        torch_npu.npu_rms_norm(x.int(), torch.ones(8, dtype=torch.int32))
    with pytest.raises(TypeError, match="npu_rms_norm: unexpected keyword argument 'eps'"):
        torch_npu.npu_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), eps=1e-6)
    with pytest.raises(TypeError, match="npu_rms_norm: takes 3 positional"):
        torch_npu.npu_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6, 1)


def test_add_rms_norm_returns_sum_and_norm(fake_npu):
    import torch_npu
    x1, x2 = torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 2.0]])
    y, rstd, s = torch_npu.npu_add_rms_norm(x1, x2, torch.ones(2), 0.0)
    torch.testing.assert_close(s, torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(y, torch.tensor([[3.0, 4.0]]) * 12.5 ** -0.5)
    assert rstd.shape == (1, 1) and rstd.dtype == torch.float32
    with pytest.raises(ValueError, match="npu_add_rms_norm: x2 .*same shape"):
        torch_npu.npu_add_rms_norm(x1, torch.ones(2, 2), torch.ones(2))
    with pytest.raises(ValueError, match="npu_add_rms_norm: gamma has dtype"):
        torch_npu.npu_add_rms_norm(x1, x2, torch.ones(2, dtype=torch.bfloat16))


def _rope_independent(x, cos, sin, interleave):
    # complex-number rotation of pairs (independent of the doc's cat/stack formula)
    if interleave:
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        rot = torch.polar(torch.ones_like(cos[..., ::2]), torch.atan2(sin[..., ::2], cos[..., ::2]))
        return torch.view_as_real(pairs * rot).flatten(-2)
    h = x.shape[-1] // 2
    pairs = torch.complex(x[..., :h], x[..., h:])
    rot = torch.polar(torch.ones_like(cos[..., :h]), torch.atan2(sin[..., :h], cos[..., :h]))
    out = pairs * rot
    return torch.cat((out.real, out.imag), dim=-1)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_is_a_rotation(fake_npu, mode):
    import torch_npu
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 2, 8, generator=g)                    # BSND
    theta = torch.randn(1, 3, 1, 4, generator=g)
    full = (theta.repeat_interleave(2, -1) if mode == "interleave" else theta.repeat(1, 1, 1, 2))
    out = torch_npu.npu_rotary_mul(x, full.cos(), full.sin(), mode)
    ref = _rope_independent(x, full.cos(), full.sin(), mode == "interleave")
    torch.testing.assert_close(out, ref)


def test_rotary_mul_constraints(fake_npu):
    import torch_npu
    x, c = torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8)
    with pytest.raises(ValueError, match="npu_rotary_mul: rotary_mode is 'quarter'"):
        torch_npu.npu_rotary_mul(x, c, c, "quarter")
    with pytest.raises(ValueError, match="npu_rotary_mul: input has 3 dimensions"):
        torch_npu.npu_rotary_mul(x[0], c[0], c[0])
    with pytest.raises(ValueError, match="npu_rotary_mul: r2 has dtype"):
        torch_npu.npu_rotary_mul(x, c, c.bfloat16())
    with pytest.raises(ValueError, match="npu_rotary_mul: r1 .*interleave mode"):
        torch_npu.npu_rotary_mul(torch.ones(2, 2, 2, 8), torch.ones(2, 2, 1, 8), c, "interleave")
    with pytest.raises(TypeError, match="npu_rotary_mul: unexpected keyword argument 'mode'"):
        torch_npu.npu_rotary_mul(x, c, c, mode="half")
