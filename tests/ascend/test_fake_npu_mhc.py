"""npu_mhc_pre / npu_mhc_sinkhorn / npu_mhc_post: reference values and constraints."""
from __future__ import annotations

import pytest
import torch


def _pre_inputs(t=2, n=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g).bfloat16()
    phi = torch.randn(n * n + 2 * n, n * d, generator=g) * 0.1
    alpha = torch.tensor([0.5, 1.5, 2.0])
    bias = torch.randn(n * n + 2 * n, generator=g)
    return x, phi, alpha, bias


def test_mhc_pre_by_the_formulas(fake_npu):
    import torch_npu
    x, phi, alpha, bias = _pre_inputs()
    h_in, h_post, h_res, inv_rms, h_mix, h_pre = torch_npu.npu_mhc_pre(
        x, phi, alpha, bias, norm_eps=1e-6, hc_eps=0.01, out_flag=1)
    for t in range(2):
        v = x[t].float().reshape(-1)
        xn = v / torch.sqrt((v * v).mean() + 1e-6)
        mix = phi @ xn
        pre = torch.sigmoid(0.5 * mix[:4] + bias[:4]) + 0.01
        torch.testing.assert_close(h_pre[t], pre)
        torch.testing.assert_close(h_post[t], 2 * torch.sigmoid(1.5 * mix[4:8] + bias[4:8]))
        torch.testing.assert_close(h_res[t], (2.0 * mix[8:] + bias[8:]).reshape(4, 4))
        torch.testing.assert_close(h_in[t].float(), (pre[:, None] * x[t].float()).sum(0),
                                   atol=2e-2, rtol=1e-2)
    assert h_in.dtype == torch.bfloat16 and inv_rms.shape == (2,) and h_mix.shape == (2, 24)


def test_mhc_pre_constraints(fake_npu):
    import torch_npu
    x, phi, alpha, bias = _pre_inputs()
    with pytest.raises(ValueError, match="npu_mhc_pre: x has n = 3"):
        torch_npu.npu_mhc_pre(x[:, :3], phi, alpha, bias)
    with pytest.raises(ValueError, match="npu_mhc_pre: phi has dtype bfloat16"):
        torch_npu.npu_mhc_pre(x, phi.bfloat16(), alpha, bias)
    with pytest.raises(ValueError, match="npu_mhc_pre: alpha has shape"):
        torch_npu.npu_mhc_pre(x, phi, alpha[:2], bias)
    with pytest.raises(TypeError, match="npu_mhc_pre: takes 4 positional"):
        torch_npu.npu_mhc_pre(x, phi, alpha, bias, None)


def test_mhc_sinkhorn_is_doubly_stochastic_and_follows_the_recipe(fake_npu):
    import torch_npu
    x = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1))
    y, norm_out, sum_out = torch_npu.npu_mhc_sinkhorn(x, eps=1e-6, num_iters=20, out_flag=1)
    torch.testing.assert_close(y.sum(-2), torch.ones(3, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.sum(-1), torch.ones(3, 4), atol=1e-3, rtol=0)
    m = torch.softmax(x, -1) + 1e-6
    m = m / (m.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        m = m / (m.sum(-1, keepdim=True) + 1e-6)
        m = m / (m.sum(-2, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, m)
    assert norm_out.shape == (40, 4, 4, 3) and sum_out.shape == (40, 4, 3)
    with pytest.raises(ValueError, match="npu_mhc_sinkhorn: num_iters is 0"):
        torch_npu.npu_mhc_sinkhorn(x, num_iters=0)
    with pytest.raises(ValueError, match="npu_mhc_sinkhorn: x has dtype bfloat16"):
        torch_npu.npu_mhc_sinkhorn(x.bfloat16())
    with pytest.raises(TypeError, match="npu_mhc_sinkhorn: takes 1 positional"):
        torch_npu.npu_mhc_sinkhorn(x, 1e-6)


def test_mhc_post_by_the_formula(fake_npu):
    import torch_npu
    x = torch.arange(8.0).reshape(1, 4, 2).bfloat16()
    h_res = torch.zeros(1, 4, 4)
    h_res[0, 0, 3] = 1.0                                    # y[0] = x[3]
    h_out = torch.tensor([[1.0, -1.0]]).bfloat16()
    h_post = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    y = torch_npu.npu_mhc_post(x, h_res, h_out, h_post)
    assert y[0, 0].float().tolist() == [6.0 + 2.0, 7.0 - 2.0] and y[0, 1:].abs().sum() == 0
    y2 = torch_npu.npu_mhc_post(x, None, h_out, h_post)
    assert y2[0, 0].float().tolist() == [2.0, -1.0] and torch.equal(y2[0, 1:], x[0, 1:])
    with pytest.raises(ValueError, match="npu_mhc_post: h_post has shape"):
        torch_npu.npu_mhc_post(x, h_res, h_out, h_post[:, :3])
    with pytest.raises(ValueError, match="npu_mhc_post: h_out has dtype"):
        torch_npu.npu_mhc_post(x, h_res, h_out.float(), h_post)


@pytest.mark.parametrize("fake_npu", [253], indirect=True)
def test_mhc_is_a5_only(fake_npu):
    import torch_npu
    with pytest.raises(ValueError, match="npu_mhc_sinkhorn: soc_version is 253"):
        torch_npu.npu_mhc_sinkhorn(torch.zeros(1, 4, 4))
