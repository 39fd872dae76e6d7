"""RMSNorm, one row per program with the whole reduction in one block (batch invariant by
construction). Core reference: `deepinfer_core.model.layers.RMSNorm` (fp32 statistics, weight
applied in fp32, output in the input dtype)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps) * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, y, x2.shape[1], x2.stride(0), y.stride(0), eps,
                                        BLOCK=triton.next_power_of_2(x2.shape[1]))
    return y.view(shape)
