"""mHC (manifold-constrained hyper-connections) on the NVIDIA backend: the
same interface and return values as the core's `PortableMHC`, served by the fused Triton kernels in
`deepinfer_kernels.mhc` (one read of the residual streams for the norm + projection, the 4x4
softmax/Sinkhorn in registers, and a single elementwise pass for post). The kernels take the
official order of operations; `official` (the QAT numerics) also rounds every product and sum apart
(no FMA)."""
from __future__ import annotations

import torch
from deepinfer_kernels.mhc import mhc_head, mhc_post, mhc_pre, mhc_pre_shifted

from deepinfer_core.ops.portable_mhc import PortableMHC


class NvidiaMHC:
    batch_invariant = True      # every row alone; tiles and splits fixed by the model shape

    def __init__(self, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 official: bool = False):
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.official = official

    def pre(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor):
        """x [T, hc, D] -> (collapsed input [T, D] in x.dtype, post [T, hc], comb [T, hc, hc]) fp32."""
        return mhc_pre(x, fn, scale, base, self.hc, self.iters, self.hc_eps, self.norm_eps,
                       self.official)

    def post(self, f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out[k] = post[k] * f + sum_j comb[j, k] * res[j] in fp32, cast to res.dtype."""
        if res.dim() == 3 and res.shape[1] != self.hc:
            raise ValueError(f"res must have hc={self.hc} streams, got {tuple(res.shape)}")
        return mhc_post(f, res, post, comb, self.official)

    def head(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Final collapse x [T, hc, D] -> [T, D] in x.dtype."""
        return mhc_head(x, fn, scale, base, self.hc, self.hc_eps, self.norm_eps, self.official)

    def pre_shifted(self, x, pre_prev, fn, scale, base):
        """Shifted mHC (V4.1): (x collapsed with `pre_prev`, this site's pre, post, comb)."""
        return mhc_pre_shifted(x, pre_prev.float(), fn, scale, base, self.hc, self.iters, self.hc_eps,
                               self.norm_eps, self.official)

    collapse = staticmethod(PortableMHC.collapse)
