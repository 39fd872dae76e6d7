"""Portable manifold-constrained hyper-connections (mHC), all in fp32."""
from __future__ import annotations

import torch


class PortableMHC:
    batch_invariant = False

    def __init__(self, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps

    def _mix(self, x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """(flat streams @ fn^T) * rsqrt(mean square): the unweighted RMS norm folded in after."""
        xf = x.flatten(-2).float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return self._matmul(xf * r, fn)

    _sigmoid = staticmethod(torch.sigmoid)    # a subclass may choose the elementwise functions

    @staticmethod
    def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b^T (a subclass may choose the GEMM)."""
        return a @ b.t()

    def pre(self, x: torch.Tensor, fn, scale, base):
        """x [T, hc, D] -> (collapsed input [T, D], post [T, hc], comb [T, hc, hc])."""
        hc = self.hc
        mix = self._mix(x, fn)
        pre = self._sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + self.hc_eps
        post = 2 * self._sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        y = (pre[..., None] * x.float()).sum(dim=1).to(x.dtype)
        return y, post, comb

    def post(self, f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out[k] = post[k] * f + sum_j comb[j, k] * res[j]  (stream k uses column k)."""
        out = post[..., None] * f.float()[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, res.float())
        return out.to(res.dtype)

    def head(self, x: torch.Tensor, fn, scale, base) -> torch.Tensor:
        pre = self._sigmoid(self._mix(x, fn) * scale + base) + self.hc_eps
        return (pre[..., None] * x.float()).sum(dim=1).to(x.dtype)
