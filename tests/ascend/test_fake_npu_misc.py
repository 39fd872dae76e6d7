"""npu_top_k_top_p and npu_scatter_nd_update_: reference values and constraints."""
from __future__ import annotations

import pytest
import torch


def test_top_k_top_p_by_hand(fake_npu):
    import torch_npu
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]]))
    inf = float("-inf")
    out = torch_npu.npu_top_k_top_p(logits, k=torch.tensor([2, 4], dtype=torch.int32))
    assert torch.isinf(out[0, [0, 2]]).all() and torch.equal(out[0, [1, 3]], logits[0, [1, 3]])
    assert torch.equal(out[1], logits[1])
    # p = 0.6 on (0.1, 0.4, 0.2, 0.3): ascending cumsum 0.1, 0.3, 0.6, 1.0; drop <= 0.4
    out = torch_npu.npu_top_k_top_p(logits[:1], p=torch.tensor([0.6]))
    assert out[0, 0] == inf and out[0, 2] == inf and not torch.isinf(out[0, [1, 3]]).any()


def test_top_k_top_p_constraints(fake_npu):
    import torch_npu
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="npu_top_k_top_p: k has dtype int64"):
        torch_npu.npu_top_k_top_p(x, k=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="npu_top_k_top_p: k has a value outside"):
        torch_npu.npu_top_k_top_p(x, k=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="npu_top_k_top_p: p has dtype"):
        torch_npu.npu_top_k_top_p(x, p=torch.tensor([0.5, 0.5], dtype=torch.float64))
    with pytest.raises(TypeError, match="npu_top_k_top_p: unexpected keyword argument 'top_k'"):
        torch_npu.npu_top_k_top_p(x, top_k=torch.tensor([1, 2], dtype=torch.int32))


def test_scatter_nd_update_in_place(fake_npu):
    import torch_npu
    cache = torch.zeros(4, 5, 2)
    idx = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    up = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = torch_npu.npu_scatter_nd_update_(cache, idx, up)
    assert out is cache
    assert cache[1, 2].tolist() == [1.0, 2.0] and cache[3, 0].tolist() == [3.0, 4.0]
    assert cache.abs().sum() == 10.0
    with pytest.raises(ValueError, match="npu_scatter_nd_update_: updates has shape"):
        torch_npu.npu_scatter_nd_update_(cache, idx, up[:, :1])
    with pytest.raises(ValueError, match="npu_scatter_nd_update_: indices has an out-of-range"):
        torch_npu.npu_scatter_nd_update_(cache, idx + 3, up)
    with pytest.raises(ValueError, match="npu_scatter_nd_update_: indices has dtype"):
        torch_npu.npu_scatter_nd_update_(cache, idx.float(), up)
