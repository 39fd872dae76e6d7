"""The pointwise glue on torch_npu's norm and RoPE operators (hook `deepinfer_pointwise_method`).

Follows the doc pages (Ascend/op-plugin `docs/zh/custom_APIs/torch_npu/`):
* `(beta)torch_npu-npu_rms_norm.md`: `npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`,
  y = x * rsqrt(mean(x^2) + eps) * gamma over gamma's trailing dims, in fp32, x's dtype out.
  Used for the weighted norms and the unweighted per-head query norm (gamma = fp32 ones).
* `torch_npu-npu_rotary_mul.md`: `npu_rotary_mul(x, r1, r2, rotary_mode="interleave")` =
  x * r1 + rotate(x) * r2 with rotate(x) = (-x1, x0, -x3, x2, ...): V4's interleaved ("GPT-J pair")
  RoPE on the 64-dim tail, with r1 = cos and r2 = sin each repeated per pair; the inverse RoPE of
  the attention output with r2 = -sin. The tail is rotated in float32 (the op takes r1/r2 in x's
  dtype, and bf16 tables would round cos/sin), then cast back once, as the core's RoPE does.
Neither page lists an A5 row (vllm-ascend calls both on A5) [UNCONFIRMED on hardware].

`npu_add_rms_norm` (x1 + x2 then the norm) is not used: V4's residual stream is the mHC streams,
and the core's pointwise interface has no add-then-norm call.

Portable fallbacks (the core's `PortablePointwise`, same tensors on the NPU): the official
per-head norm (`official=True`, each step rounded as DeepSeek's code does), the fake-quant steps
of `norm_rope_quant` ("fp8_nope", "hadamard_fp4", V4.1's KV modes), Engram's `gather_rows`.
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.ops.portable_pointwise import NORMS, QUANTS, PortablePointwise


class AscendPointwise(PortablePointwise):
    batch_invariant = False     # not claimed: the ops' reduction order is undocumented
    reads_host_memory = False

    def __init__(self, torch_npu: Any, official: bool = False):
        super().__init__(official=official)
        self._rms_norm = torch_npu.npu_rms_norm        # bound once: no lookup per call
        self._rotary_mul = torch_npu.npu_rotary_mul
        self._ones: dict[tuple, torch.Tensor] = {}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() < 2:                    # the op takes 2-8 dims
            return self._rms_norm(x[None], self._gamma(weight, x), eps)[0][0]
        return self._rms_norm(x, self._gamma(weight, x), eps)[0]

    @staticmethod
    def _gamma(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # documented gamma dtypes: x's own or float32 (a float32 copy is exact)
        return weight if weight.dtype in (x.dtype, torch.float32) else weight.float()

    def _head_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        key = (x.shape[-1], x.device)
        if key not in self._ones:
            self._ones[key] = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
        return self._rms_norm(x, self._ones[key], eps)[0]

    def rope(self, x: torch.Tensor, positions: torch.Tensor, rope, inverse: bool = False
             ) -> torch.Tensor:
        """Rotate the last `rope.rope_dim` channels of x [T, ..., D] (positions [T])."""
        rd, T = rope.rope_dim, x.shape[0]
        cos, sin = rope.cos_sin(positions)                       # [T, rd/2] float32
        r1 = cos.repeat_interleave(2, -1).view(T, 1, 1, rd)      # S11D: broadcast over B, N
        r2 = sin.repeat_interleave(2, -1).view(T, 1, 1, rd)
        if inverse:
            r2 = -r2
        tail = x[..., -rd:].float().reshape(T, -1, 1, rd)        # [S, B, N=1, D]
        rot = self._rotary_mul(tail, r1, r2, rotary_mode="interleave")
        rot = rot.view(*x.shape[:-1], rd).to(x.dtype)
        return torch.cat([x[..., :-rd], rot], dim=-1)

    def norm_rope_quant(self, x: torch.Tensor, positions: torch.Tensor, rope, *,
                        norm: str = "none", weight: torch.Tensor | None = None, eps: float = 1e-6,
                        quant: str = "none", nope_dim: int | None = None) -> torch.Tensor:
        if norm not in NORMS:
            raise ValueError(f"norm={norm!r}; allowed: {list(NORMS)}")
        if quant not in QUANTS:
            raise ValueError(f"quant={quant!r}; allowed: {list(QUANTS)}")
        if norm == "weighted":
            x = self.rms_norm(x, weight, eps)
        elif norm == "head" and not self.official:
            x = self._head_norm(x, eps)
        elif norm == "head":
            x = super().norm_rope_quant(x, positions, _NoRope, norm="head", eps=eps)
        x = self.rope(x, positions, rope)
        if quant == "none":
            return x
        return super().norm_rope_quant(x, positions, _NoRope, quant=quant,
                                       nope_dim=x.shape[-1] - rope.rope_dim
                                       if nope_dim is None else nope_dim)

    def inverse_rope(self, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        return self.rope(x, positions, rope, inverse=True)


class _NoRope:
    """The identity rotation: lets the portable op run only its norm or quant step."""

    rope_dim = 0

    @staticmethod
    def apply(x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return x
