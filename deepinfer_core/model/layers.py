"""Leaf modules whose persistent buffers carry exactly the checkpoint's names, dtypes and shapes.

Every checkpoint tensor is a persistent *buffer* (inference only, no autograd), so
`model.state_dict()` before loading lists exactly what the checkpoint must contain. After loading,
`process_weights()` lets the chosen op implementation turn the stored format into its runtime form
(e.g. the portable linear method dequantises FP8/FP4 exactly into the compute dtype).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.portable_pointwise import PORTABLE

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=device)


class Linear(nn.Module):
    """`y = x @ W^T` over a weight stored as in the checkpoint.

    fmt "fp8": weight float8_e4m3fn [out, in] + `scale` UE8M0 [ceil(out/bo), ceil(in/bi)]
    fmt "fp4": weight int8 [out, in/2] (two e2m1 per byte, low nibble first) + `scale` [out, in/32]
    fmt "bf16": weight bfloat16 [out, in] (or float32 when `dtype` says so), no scale.
    `act_quant` marks the layers whose input the reference fake-quantises to FP8 (QAT simulation);
    it follows the model's definition, not the checkpoint's storage.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, *, block=(128, 128),
                 act_quant: bool | None = None, dtype=torch.bfloat16, device="cpu", groups: int = 1):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        # groups > 1: block-diagonal (V4's wo_a, `apply_grouped`): group g maps its in_features inputs
        # to output rows g*out/groups .. (g+1)*out/groups
        self.groups = groups
        self.act_quant = (fmt != "bf16") if act_quant is None else act_quant
        self.method = None         # bound by bind_ops(); the op object that computes this layer
        self.compute_dtype = None  # None = the model's compute dtype; fp32 for reference-fp32 layers
        if fmt == "fp8":
            bo, bi = block
            self.register_buffer("weight", empty((out_features, in_features), FP8, device))
            self.register_buffer("scale", empty((math.ceil(out_features / bo), math.ceil(in_features / bi)), E8M0, device))
        elif fmt == "fp4":
            assert in_features % 32 == 0, "FP4 weights need in_features divisible by 32"
            self.register_buffer("weight", empty((out_features, in_features // 2), torch.int8, device))
            self.register_buffer("scale", empty((out_features, in_features // 32), E8M0, device))
        elif fmt == "bf16":
            self.register_buffer("weight", empty((out_features, in_features), dtype, device))
            self.scale = None
        else:
            raise ValueError(f"unknown weight format {fmt!r}; allowed: fp8, fp4, bf16")

    @property
    def grouped(self) -> bool:
        return self.groups > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, fmt={self.fmt}, act_quant={self.act_quant}"


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight multiplies in fp32 before the cast back (reference order).
    Computed by the bound pointwise method (a backend's fused kernel), else the portable one."""

    def __init__(self, dim: int, eps: float, device="cpu"):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", empty((dim,), torch.bfloat16, device))
        self.pointwise = PORTABLE    # bound by bind_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise.rms_norm(x, self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, device="cpu"):
        super().__init__()
        self.register_buffer("weight", empty((vocab, dim), torch.bfloat16, device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


def weight_format(cfg, kind: str) -> str:
    """Checkpoint storage format of a linear: `kind` is "dense" (FP8 in V4) or "expert"."""
    if not cfg.fp8_weights:
        return "bf16"
    return cfg.expert_dtype if kind == "expert" else "fp8"
