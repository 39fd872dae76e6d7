"""FP8 linear layers on the FP8 tensor cores: weights stay e4m3 with their 128x128 block scales on the
GPU; activations are quantised per token and per 128 channels (the reference's act_quant) and
multiplied by the block-scaled FP8 GEMM (`deepinfer_kernels`).

This *is* the QAT numerics: the reference quantises those activations to FP8 before the product, so
with simulate_qat=True the result equals the portable path up to summation order. With
simulate_qat=False (or bf16 / FP4 weights, or a layer without activation quantisation) the layer
falls back to the core's portable method.
"""
from __future__ import annotations

import torch

from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.quant import e8m0_to_float


class Fp8LinearMethod:
    def __init__(self, dtype: torch.dtype, simulate_qat: bool, block=(128, 128)):
        self.dtype, self.block = dtype, tuple(block)
        self.fallback = PortableLinearMethod(dtype, simulate_qat, block)

    def uses_fp8(self, layer) -> bool:
        return getattr(layer, "fp8_scale", None) is not None

    def process_weights(self, layer) -> None:
        if layer.fmt != "fp8" or not layer.act_quant or self.block != (128, 128):
            self.fallback.process_weights(layer)
            return
        layer.register_buffer("weight", layer.weight.contiguous(), persistent=False)
        layer.register_buffer("fp8_scale", e8m0_to_float(layer.scale).contiguous(), persistent=False)
        layer.scale = None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_fp8(layer):
            return self.fallback.apply(layer, x)
        from deepinfer_kernels.fp8_gemm import fp8_gemm
        from deepinfer_kernels.fp8_quant import act_quant
        lead = x.shape[:-1]
        qa, sa = act_quant(x.reshape(-1, x.shape[-1]))
        y = fp8_gemm(qa, sa, layer.weight, layer.fp8_scale, out_dtype=layer.compute_dtype or self.dtype)
        return y.view(*lead, y.shape[-1])

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        """V4's wo_a: a bf16 product in the reference (no activation quantisation), so the portable
        method serves it (a grouped bf16 kernel is future work)."""
        return self.fallback.apply_grouped(layer, x)
