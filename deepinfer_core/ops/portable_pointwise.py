"""Portable pointwise ops: the memory-bound glue between V4's GEMMs, in plain PyTorch (the reference).

`norm_rope_quant` is one composition with three switches, because every use in the model is the
same chain -- an optional RMS norm, RoPE on the trailing channels, an optional QAT fake-quant:

| use                       | norm       | quant          | tensor       |
|---------------------------|------------|----------------|--------------|
| attention queries         | "head"     | "none"         | [T, H, Dh]   |
| shared K=V row            | "weighted" | "fp8_nope"     | [T, Dh]      |
| compressed KV row         | "weighted" | "fp8_nope"     | [rows, Dh]   |
| compressed indexer key    | "weighted" | "hadamard_fp4" | [rows, Di]   |
| indexer queries           | "none"     | "hadamard_fp4" | [T, Hi, Di]  |

A backend's `PointwiseMethod` (hook `deepinfer_pointwise_method`) computes the same values in fused
kernels; `inverse_rope` may then rotate its input in place.

`official=True` (the QAT numerics) rounds the per-head query norm as DeepSeek's inference code does:
square, mean, + eps and rsqrt each in the activation dtype (`official_head_rms_norm`).
"""
from __future__ import annotations

import torch

from .quant import fake_quant_fp4, fake_quant_fp8, hadamard_transform

NORMS = ("none", "head", "weighted")
QUANTS = ("none", "fp8_nope", "hadamard_fp4")
KV_QUANT_BLOCK = 64        # FP8 fake-quant block of the KV nope dims (spec: 7 blocks of 64)
INDEXER_QUANT_BLOCK = 32   # FP4 fake-quant block of indexer queries and keys


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm; the weight multiplies in fp32 before the cast back (reference order)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted per-head RMS norm of the queries (last dim), multiplied in x.dtype (reference)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def official_head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The same norm with every step rounded to x.dtype (the official code's order): the square,
    the mean, + eps, the rsqrt and the product, each computed in fp32 and rounded as CUDA does
    (torch's CPU bf16 rsqrt rounds otherwise on small tensors, and not row by row)."""
    dt = x.dtype
    ms = x.square().float().mean(-1, keepdim=True).to(dt)
    return x * torch.rsqrt((ms + eps).float()).to(dt)


class PortablePointwise:
    batch_invariant = True      # every row alone: norms, RoPE and fake-quant per row

    def __init__(self, official: bool = False):
        self.official = official

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def norm_rope_quant(self, x: torch.Tensor, positions: torch.Tensor, rope, *, norm: str = "none",
                        weight: torch.Tensor | None = None, eps: float = 1e-6, quant: str = "none",
                        nope_dim: int | None = None) -> torch.Tensor:
        """norm -> RoPE (`rope`: a RotaryTable) on the last rope_dim channels -> fake-quant."""
        if norm == "head":
            x = (official_head_rms_norm if self.official else head_rms_norm)(x, eps)
        elif norm == "weighted":
            x = rms_norm(x, weight, eps)
        x = rope.apply(x, positions)
        if quant == "fp8_nope":
            nope = x.shape[-1] - rope.rope_dim if nope_dim is None else nope_dim
            x = torch.cat([fake_quant_fp8(x[..., :nope], KV_QUANT_BLOCK), x[..., nope:]], -1)
        elif quant == "hadamard_fp4":
            x = fake_quant_fp4(hadamard_transform(x), INDEXER_QUANT_BLOCK)
        return x

    def inverse_rope(self, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        """Undo RoPE on the attention output (a backend may rotate `x` in place)."""
        return rope.apply(x, positions, inverse=True)


PORTABLE = PortablePointwise()     # modules not bound to a backend (tests, tools) use this
