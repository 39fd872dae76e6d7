"""Portable manifold-constrained hyper-connections (mHC), all in fp32.

`official=True` (the QAT numerics) rounds as DeepSeek's inference code does: the mixing product of
the raw streams first, times the rsqrt norm after; the combination softmax as exp(c - max) / sum;
the post mix as post * f plus the multiply-and-sum of comb and the streams. `official=False`
scales the streams before the product, uses `torch.softmax` and an einsum (transformers' order).
"""
from __future__ import annotations

import torch


class PortableMHC:
    batch_invariant = False

    def __init__(self, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 official: bool = False):
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.official = official

    def _mix(self, x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """(flat streams @ fn^T) * rsqrt(mean square): the unweighted RMS norm folded in."""
        xf = x.flatten(-2).float()
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.norm_eps)
        if self.official:
            return self._matmul(xf, fn) * r
        return self._matmul(xf * r, fn)

    _sigmoid = staticmethod(torch.sigmoid)    # a subclass may choose the elementwise functions

    @staticmethod
    def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b^T (a subclass may choose the GEMM)."""
        return a @ b.t()

    def _softmax(self, c: torch.Tensor) -> torch.Tensor:
        if self.official:
            e = torch.exp(c - c.amax(dim=-1, keepdim=True))
            return e / e.sum(dim=-1, keepdim=True)
        return torch.softmax(c, dim=-1)

    def pre(self, x: torch.Tensor, fn, scale, base):
        """x [T, hc, D] -> (collapsed input [T, D], post [T, hc], comb [T, hc, hc])."""
        pre, post, comb = self.mixes(x, fn, scale, base)
        return self.collapse(x, pre), post, comb

    def pre_shifted(self, x: torch.Tensor, pre_prev: torch.Tensor, fn, scale, base):
        """Shifted mHC: (x collapsed with `pre_prev` [T, D], this site's pre, post, comb)."""
        pre, post, comb = self.mixes(x, fn, scale, base)
        return self.collapse(x, pre_prev), pre, post, comb

    @staticmethod
    def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_j pre[j] * x[j] in fp32, cast to x.dtype."""
        return (pre[..., None] * x.float()).sum(dim=1).to(x.dtype)

    def mixes(self, x: torch.Tensor, fn, scale, base):
        """x [T, hc, D] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]), fp32."""
        hc = self.hc
        mix = self._mix(x, fn)
        pre = self._sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + self.hc_eps
        post = 2 * self._sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
        comb = self._softmax(comb) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    def post(self, f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out[k] = post[k] * f + sum_j comb[j, k] * res[j]  (stream k uses column k)."""
        if self.official:
            mixed = self._stream_mix(comb, res.float())
        else:
            mixed = torch.einsum("tjk,tjd->tkd", comb, res.float())
        return (post[..., None] * f.float()[:, None, :] + mixed).to(res.dtype)

    def _stream_mix(self, comb: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        """sum_j comb[:, j, k] * res[:, j], j in ascending order, one [T, hc, D] term at a time
        (the same bits as the official multiply-then-sum over j, without its [T, hc, hc, D])."""
        out = comb[:, 0, :, None] * res[:, 0, None, :]
        for j in range(1, self.hc):
            out = out + comb[:, j, :, None] * res[:, j, None, :]
        return out

    def head(self, x: torch.Tensor, fn, scale, base) -> torch.Tensor:
        return self.collapse(x, self._sigmoid(self._mix(x, fn) * scale + base) + self.hc_eps)
