"""Portable linear method: dequantise FP8/FP4 weights exactly into the compute dtype once after
loading; at run time fake-quantise the input (QAT simulation) and do a plain matmul.

FP8 x UE8M0 and FP4 x UE8M0 values are exactly representable in bf16, so dequantising loses
nothing; only the summation order differs from the reference kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import dequant_fp4, dequant_fp8_block, fake_quant_fp8


class PortableLinearMethod:
    batch_invariant = False     # torch GEMMs pick their tiles by the number of rows

    def __init__(self, dtype: torch.dtype, simulate_qat: bool, block=(128, 128)):
        self.dtype, self.simulate_qat, self.block = dtype, simulate_qat, tuple(block)

    def process_weights(self, layer) -> None:
        dtype = layer.compute_dtype or self.dtype
        w, scale = layer.weight, getattr(layer, "scale", None)
        if scale is None:
            w = w.to(dtype)
        elif w.dtype == torch.int8:
            w = dequant_fp4(w, scale, 32, dtype)
        else:
            w = dequant_fp8_block(w, scale, self.block, dtype)
        layer.register_buffer("weight", w.contiguous(), persistent=False)
        layer.scale = None

    def _quant_input(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.act_quant and self.simulate_qat:
            x = fake_quant_fp8(x, 128)
        return x.to(layer.weight.dtype)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._quant_input(layer, x), layer.weight)

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal projection: x [T, G, in/G] -> [T, G, out/G] (V4's wo_a)."""
        G = x.shape[1]
        w = layer.weight.view(G, -1, x.shape[-1])
        return torch.einsum("tgi,goi->tgo", self._quant_input(layer, x), w)
