"""FP8 linear layers on the FP8 tensor cores: weights stay e4m3 with their block scales on the GPU
(128x128 for V4, 32x32 for V4.1); activations are quantised per token and per 128 channels (the
reference's act_quant) and multiplied by the block-scaled FP8 GEMM (`deepinfer_kernels`).

This *is* the QAT numerics: the reference quantises those activations to FP8 before the product, so
with simulate_qat=True the result equals the portable path up to summation order. Without
activation quantisation (simulate_qat=False, or a layer the reference computes in bf16) the weights
still stay FP8 and are widened tile by tile (`w8a16_gemm`). FP4 checkpoint weights (the routed
experts) are re-encoded to FP8 with 128x128 scales at load when that is exact (`fp4_to_fp8_block`;
SM90 has no FP4 tensor cores), else dequantised by the portable method. The grouped wo_a (bf16
activations) keeps its FP8 weights too (`w8a16_gemm` over its groups), except in batch-invariant mode.

bf16 checkpoint weights (`Bf16LinearMethod`) stay bf16 in a bf16 model, including the layers the
reference computes in fp32 (the compressors' projections): a bf16 x bf16 product is exact in fp32, so
an fp32-accumulating bf16 GEMM on the tensor cores is the reference's math up to summation order,
at half the weight bytes and far above fp32 SIMT speed.
"""
from __future__ import annotations

import logging

import torch
from deepinfer_kernels.fp8_gemm import WEIGHT_BLOCKS

from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.quant import e8m0_to_float, fp4_to_fp8_block

log = logging.getLogger("deepinfer.nvidia")


class Fp8LinearMethod:
    def __init__(self, dtype: torch.dtype, simulate_qat: bool, block=(128, 128), batch_invariant: bool = False):
        self.dtype, self.block, self.simulate_qat = dtype, tuple(block), simulate_qat
        self.batch_invariant = batch_invariant
        self.fallback = (DenseLinearMethod if batch_invariant else PortableLinearMethod)(dtype, simulate_qat, block)

    def batch_invariant_variant(self) -> "Fp8LinearMethod":
        """Fixed GEMM tiles and split-K for every batch (the batch_invariant feature's protocol)."""
        return type(self)(self.dtype, self.simulate_qat, self.block, batch_invariant=True)

    def uses_fp8(self, layer) -> bool:
        return getattr(layer, "fp8_scale", None) is not None

    def keeps_grouped_fp8(self, layer) -> bool:
        """A grouped FP8 layer (wo_a: bf16 activations in the reference) stays FP8 when each group's rows
        are whole 128-row scale blocks; batch-invariant mode keeps the dense kernel's dequantised form."""
        return (layer.fmt == "fp8" and not self.batch_invariant and not (layer.act_quant and self.simulate_qat)
                and layer.out_features % (layer.groups * self.block[0]) == 0)

    def process_weights(self, layer) -> None:
        # FP4 scales are per 32 inputs whatever the model's FP8 block size (V4.1's is 32x32)
        if layer.fmt not in ("fp8", "fp4") or (layer.fmt == "fp8" and self.block not in WEIGHT_BLOCKS) or \
                (layer.grouped and not self.keeps_grouped_fp8(layer)):
            self.fallback.process_weights(layer)
            return
        weight, scale = layer.weight, layer.scale
        layer.fp8_block = self.block if layer.fmt == "fp8" else (128, 128)
        if layer.fmt == "fp4":
            encoded = fp4_to_fp8_block(weight, scale)
            if encoded is None:
                log.warning("FP4 weight %s cannot be re-encoded to FP8 exactly (group scales span > 14 "
                            "binades in a 128x128 block); dequantising it instead", tuple(weight.shape))
                self.fallback.process_weights(layer)
                return
            weight, scale = encoded
        layer.register_buffer("weight", weight.contiguous(), persistent=False)
        layer.register_buffer("fp8_scale", e8m0_to_float(scale).contiguous(), persistent=False)
        layer.scale = None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_fp8(layer):
            return self.fallback.apply(layer, x)
        from deepinfer_kernels.fp8_gemm import fp8_gemm, invariant_plan, w8a16_gemm
        from deepinfer_kernels.fp8_quant import act_quant
        lead, out_dtype = x.shape[:-1], layer.compute_dtype or self.dtype
        x2 = x.reshape(-1, x.shape[-1])
        cfg = splits = None
        if self.batch_invariant:
            cfg, splits = invariant_plan(layer.weight.shape[0], layer.weight.shape[1], x.device, x2.shape[0])
        if layer.act_quant and self.simulate_qat:
            qa, sa = act_quant(x2)
            y = fp8_gemm(qa, sa, layer.weight, layer.fp8_scale, out_dtype=out_dtype, config=cfg, splits=splits,
                         weight_block=layer.fp8_block)
        else:
            y = w8a16_gemm(x2.to(out_dtype), layer.weight, layer.fp8_scale, out_dtype=out_dtype, config=cfg,
                           weight_block=layer.fp8_block)
        return y.view(*lead, y.shape[-1])

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        """V4's wo_a, x [T, G, in] -> [T, G, out/G]: a bf16 product in the reference (no activation
        quantisation), so the FP8 weights are widened tile by tile (`w8a16_gemm`, all groups in one
        launch), as exact as the dequantised weights and half their bytes."""
        if not self.uses_fp8(layer):
            return self.fallback.apply_grouped(layer, x)
        from deepinfer_kernels.fp8_gemm import w8a16_gemm
        out_dtype = layer.compute_dtype or self.dtype
        return w8a16_gemm(x.to(out_dtype), layer.weight, layer.fp8_scale, out_dtype=out_dtype,
                          weight_block=layer.fp8_block)


class Bf16LinearMethod:
    def __init__(self, dtype: torch.dtype, simulate_qat: bool, block=(128, 128), batch_invariant: bool = False):
        self.dtype, self.simulate_qat, self.block = dtype, simulate_qat, tuple(block)
        self.batch_invariant = batch_invariant
        self.fallback = (DenseLinearMethod if batch_invariant else PortableLinearMethod)(dtype, simulate_qat, block)

    def batch_invariant_variant(self) -> "Bf16LinearMethod":
        """The fixed-tile Triton GEMM instead of cuBLAS (the batch_invariant feature's protocol)."""
        return type(self)(self.dtype, self.simulate_qat, self.block, batch_invariant=True)

    def process_weights(self, layer) -> None:
        if self.dtype == torch.bfloat16 and layer.weight.dtype == torch.bfloat16 and not layer.grouped:
            layer.register_buffer("weight", layer.weight.contiguous(), persistent=False)
            layer.scale = None
            return
        self.fallback.process_weights(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        out_dtype = layer.compute_dtype or self.dtype
        if layer.weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or not x.is_cuda:
            return self.fallback.apply(layer, x)      # (mm's out_dtype is CUDA-only)
        x2 = x.reshape(-1, x.shape[-1])
        if self.batch_invariant:
            from deepinfer_kernels.dense_gemm import dense_gemm
            y = dense_gemm(x2, layer.weight, out_dtype)
        else:
            y = torch.mm(x2, layer.weight.t(), out_dtype=out_dtype) if out_dtype != x.dtype else x2 @ layer.weight.t()
        return y.view(*x.shape[:-1], y.shape[-1])

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.fallback.apply_grouped(layer, x)


class DenseLinearMethod(PortableLinearMethod):
    """The portable method's weights (dequantised to the compute dtype) through the fixed-tile Triton
    GEMM (`deepinfer_kernels.dense_gemm`): the batch-invariant fallback of the two methods above on
    a GPU, including the grouped wo_a."""
    batch_invariant = True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            raise ValueError("DenseLinearMethod: batch-invariant GEMMs run on CUDA tensors only")
        from deepinfer_kernels.dense_gemm import dense_gemm
        xq = self._quant_input(layer, x)
        y = dense_gemm(xq.reshape(-1, xq.shape[-1]), layer.weight)
        return y.view(*x.shape[:-1], y.shape[-1])

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        from deepinfer_kernels.dense_gemm import dense_gemm
        G = x.shape[1]
        return dense_gemm(self._quant_input(layer, x), layer.weight.view(G, -1, x.shape[-1]))
