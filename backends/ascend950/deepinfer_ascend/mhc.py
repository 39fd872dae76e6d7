"""mHC (manifold-constrained hyper-connections) on torch_npu's A5 mHC operators (hook
`deepinfer_mhc_method`; Ascend 950 only, bf16/fp16 streams).

Follows `torch_npu-npu_mhc_pre.md`, `torch_npu-npu_mhc_sinkhorn.md`, `torch_npu-npu_mhc_post.md`
(Ascend/op-plugin), as read:
* `pre`: `npu_mhc_pre(x, phi=hc_*_fn, alpha=hc_*_scale, bias=hc_*_base, norm_eps, hc_eps)` gives
  h_in = sum_j H_pre[j] x_j, H_post = 2 sigmoid(...) and the raw H_res (no Sinkhorn; gamma None:
  V4's norm is unweighted), then `npu_mhc_sinkhorn(H_res, eps=hc_eps, num_iters=hc_sinkhorn_iters)`:
  row softmax + eps, column normalisation, then (iters - 1) x (row, column), each sum + eps --
  V4's recipe. h_post's shape [T, n] (the page says (T, D)) is [UNCONFIRMED].
* `post`: `npu_mhc_post(x=streams, h_res, h_out=f, h_post)`: y[k] = sum_j h_res[k, j] x[j] +
  h_post[k] f as the page writes the product; V4 needs y[k] = sum_j comb[j, k] x[j], so h_res is
  passed as comb transposed. Whether the kernel multiplies by H_res or its transpose is
  [UNCONFIRMED] (spec: to be checked by test on bring-up).
Not run on hardware; vllm-ascend reports the A5 `HcPre` custom kernel (not this op) ignoring its
pre-mix weights (vllm-ascend #17122): check h_in on bring-up.

Portable fallbacks (the core's `PortableMHC` on the NPU): `head` (the final collapse has no op),
V4.1's `pre_shifted` and `collapse`; float32 streams (the ops take bf16/fp16 only); the QAT
numerics (`simulate_qat`): their official rounding order (the mixing product before the norm, the
softmax as exp(c - max) / sum) is not the op's (fp32 differences of ~5e-7 on random data, enough
to change the tiny model's greedy tokens when tried), so the op table chooses this class only for
the clean numerics.
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.ops.portable_mhc import PortableMHC


class AscendMHC(PortableMHC):
    batch_invariant = False

    def __init__(self, torch_npu: Any, hc_mult: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float):
        super().__init__(hc_mult, sinkhorn_iters, hc_eps, norm_eps, official=False)
        self._pre = torch_npu.npu_mhc_pre
        self._sinkhorn = torch_npu.npu_mhc_sinkhorn
        self._post = torch_npu.npu_mhc_post

    def pre(self, x: torch.Tensor, fn, scale, base):
        """x [T, hc, D] -> (collapsed input [T, D], post [T, hc], comb [T, hc, hc])."""
        h_in, h_post, h_res = self._pre(x, fn, scale, base, norm_eps=self.norm_eps,
                                        hc_eps=self.hc_eps)[:3]
        comb = self._sinkhorn(h_res, eps=self.hc_eps, num_iters=self.iters)[0]
        return h_in, h_post, comb

    def post(self, f: torch.Tensor, res: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        """out[k] = post[k] * f + sum_j comb[j, k] * res[j]."""
        return self._post(res, comb.transpose(-1, -2).contiguous(), f.to(res.dtype), post)
