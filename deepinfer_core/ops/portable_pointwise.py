"""Portable pointwise ops: the memory-bound glue between V4's GEMMs, in plain PyTorch (the reference).

`norm_rope_quant` is one composition with three switches, because every use in the model is the
same chain -- an optional RMS norm, RoPE on the trailing channels, an optional QAT fake-quant:

| use                           | norm       | quant          | tensor       |
|-------------------------------|------------|----------------|--------------|
| attention queries             | "head"     | "none"         | [T, H, Dh]   |
| shared K=V row (window ring)  | "weighted" | "fp8_nope"     | [T, Dh]      |
| compressed KV row, V4         | "weighted" | "fp8_nope"     | [rows, Dh]   |
| compressed KV row, V4.1       | "weighted" | "fp4_kv"       | [rows, Dh]   |
| ... `use_fp4_sparse_kv` off   | "weighted" | "mxfp8_kv"     | [rows, Dh]   |
| compressed indexer key (V4)   | "weighted" | "hadamard_fp4" | [rows, Di]   |
| projected index key (V4.1)    | "weighted" | "hadamard_fp4" | [rows, Di]   |
| indexer queries               | "none"     | "hadamard_fp4" | [T, Hi, Di]  |

"fp8_nope": FP8 e4m3 per 64 on the nope channels, RoPE channels untouched; "hadamard_fp4": Hadamard,
then FP4 e2m1 with a power-of-two scale per 32; "fp4_kv": FP4 e2m1 with an E4M3 scale per 16 over
all channels (`quant.fake_quant_fp4_e4m3`); "mxfp8_kv": FP8 e4m3 with a UE8M0 scale per 32 over all
channels (DeepSeek's act_quant scale recipe, `quant.fake_quant_fp8` with blocks of 32; the sources
name the format only).

A backend's `PointwiseMethod` (hook `deepinfer_pointwise_method`) computes the same values in fused
kernels; `inverse_rope` may then rotate its input in place. A method need not know the V4.1 modes
(`V41_KV_QUANTS`): the Compressor asks for quant "none" and applies `fake_quant_kv_row` itself.

`official=True` (the QAT numerics) rounds the per-head query norm as DeepSeek's inference code does:
square, mean, + eps and rsqrt each in the activation dtype (`official_head_rms_norm`).
"""
from __future__ import annotations

import torch

from .quant import (
    fake_quant_fp4,
    fake_quant_fp4_e4m3,
    fake_quant_fp8,
    hadamard_transform,
)

NORMS = ("none", "head", "weighted")
V41_KV_QUANTS = ("fp4_kv", "mxfp8_kv")    # V4.1 compressed KV rows, every channel
QUANTS = ("none", "fp8_nope", "hadamard_fp4") + V41_KV_QUANTS
KV_QUANT_BLOCK = 64        # FP8 fake-quant block of the KV nope dims (spec: 7 blocks of 64)
INDEXER_QUANT_BLOCK = 32   # FP4 fake-quant block of indexer queries and keys
FP4_KV_BLOCK = 16          # V4.1 FP4 compressed KV: one E4M3 scale per 16 values (288 B/token)
MXFP8_KV_BLOCK = 32        # V4.1 MXFP8 compressed KV: one UE8M0 scale per 32 values (528 B/token)


def fake_quant_kv_row(x: torch.Tensor, quant: str) -> torch.Tensor:
    """V4.1's compressed-KV fake-quant over all channels of the last dim (nope and RoPE alike):
    "fp4_kv" (`use_fp4_sparse_kv` on) or "mxfp8_kv" (off)."""
    if quant == "fp4_kv":
        return fake_quant_fp4_e4m3(x, FP4_KV_BLOCK)
    if quant == "mxfp8_kv":
        return fake_quant_fp8(x, MXFP8_KV_BLOCK)
    raise ValueError(f"quant={quant!r} is not a V4.1 compressed-KV mode; "
                     f"allowed: {list(V41_KV_QUANTS)}")


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


def gather_rows(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Engram's table gather: rows [T, K] of an FP8 table [R, dim] with UE8M0 scales per 32,
    dequantised side by side -> [T, K * dim] fp32 (the table on the rows' device)."""
    w = weight[rows].float()
    s = scale[rows].float()
    return (w.unflatten(-1, (-1, 32)) * s[..., None]).flatten(1)


class PortablePointwise:
    batch_invariant = True      # every row alone: norms, RoPE and fake-quant per row
    reads_host_memory = False   # gather_rows needs the table on the rows' device

    def __init__(self, official: bool = False):
        self.official = official

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def norm_rope_quant(self, x: torch.Tensor, positions: torch.Tensor, rope, *, norm: str = "none",
                        weight: torch.Tensor | None = None, eps: float = 1e-6, quant: str = "none",
                        nope_dim: int | None = None) -> torch.Tensor:
        """norm -> RoPE (`rope`: a RotaryTable) on the last rope_dim channels -> fake-quant."""
        if norm not in NORMS:
            raise ValueError(f"norm={norm!r}; allowed: {list(NORMS)}")
        if quant not in QUANTS:
            raise ValueError(f"quant={quant!r}; allowed: {list(QUANTS)}")
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
        elif quant in V41_KV_QUANTS:
            x = fake_quant_kv_row(x, quant)
        return x

    def inverse_rope(self, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        """Undo RoPE on the attention output (a backend may rotate `x` in place)."""
        return rope.apply(x, positions, inverse=True)

    def gather_rows(self, weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return gather_rows(weight, scale, rows)


PORTABLE = PortablePointwise()     # modules not bound to a backend (tests, tools) use this
