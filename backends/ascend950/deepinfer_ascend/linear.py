"""FP8 linear layers as MXFP8 matmuls (hook `deepinfer_linear_method`, Ascend 950 only).

Follows vllm-ascend's A5 MXFP8 linear as read from the torch_npu 2.13.0 schema and meta
registration (`npu_quant_matmul` has a doc page, `torch_npu-npu_quant_matmul.md`, for its
A2/A3 int8/int4 forms only; the MX form with `scale_dtype = pertoken_scale_dtype =
torch_npu.float8_e8m0fnu` and `group_sizes=[1, 1, 32]` has none [UNCONFIRMED on hardware]).

With the QAT numerics (`simulate_qat`) a layer the reference quantises (`act_quant`) computes:
the activations quantised in torch exactly as DeepSeek's act_quant does (e4m3 with one
power-of-two scale per 128 channels, `deepinfer_core.ops.quant.quant_fp8_act`), each scale
repeated over its four 32-groups (mx.py), then `npu_quant_matmul` on the FP8 weights with their
128x128 (V4) or 32x32 (V4.1) block scales repeated into the MX layout at load. Every product is
the reference's; only the fp32 summation order differs from the core's block-by-block sums.

`npu_dynamic_mx_quant` is not used: its scales are OCP MX (2^(floor(log2 amax) - 8) per 32,
saturating values above 448), not DeepSeek's 2^ceil(log2(amax / 448)) per 128, so it would not
give the reference's activations, and the clean-math mode (`simulate_qat=False`) quantises no
activations at all.

Portable fallbacks (the core's `PortableLinearMethod`, weights dequantised exactly to the compute
dtype, torch matmuls on the NPU): `simulate_qat=False`; layers without `act_quant`; a float32
compute dtype (the MX form outputs bfloat16 or float16 only); the grouped output projection wo_a
(bf16 activations in the reference; `npu_transpose_quant_batchmatmul` not mapped yet); weight
blocks whose K side is not a multiple of 32; bf16 and FP4 weights.
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.quant import quant_fp8_act

from .mx import MX_GROUP, act_mx_scale, weight_mx_scale

ACT_BLOCK = 128          # DeepSeek's act_quant: one scale per 128 channels


class MxFp8LinearMethod:
    batch_invariant = False

    def __init__(self, torch_npu: Any, dtype: torch.dtype, simulate_qat: bool, block=(128, 128)):
        self.dtype, self.simulate_qat, self.block = dtype, simulate_qat, tuple(block)
        self.fallback = PortableLinearMethod(dtype, simulate_qat, block)
        self._matmul = torch_npu.npu_quant_matmul
        self._e8m0 = torch_npu.float8_e8m0fnu           # the dtype code of the scales

    def takes(self, layer) -> bool:
        """Whether `layer` runs as an MXFP8 matmul (else the portable method)."""
        out_dtype = layer.compute_dtype or self.dtype
        return (layer.fmt == "fp8" and not layer.grouped and layer.act_quant and self.simulate_qat
                and out_dtype == torch.bfloat16 and self.block[1] % MX_GROUP == 0)

    def process_weights(self, layer) -> None:
        if not self.takes(layer):
            self.fallback.process_weights(layer)
            layer.mx_scale = None
            return
        layer.register_buffer("mx_scale", weight_mx_scale(layer.scale, layer.out_features,
                                                          layer.in_features, self.block),
                              persistent=False)
        layer.register_buffer("weight", layer.weight.contiguous(), persistent=False)
        layer.scale = None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.mx_scale is None:
            return self.fallback.apply(layer, x)
        lead, K = x.shape[:-1], x.shape[-1]
        q, s = quant_fp8_act(x.reshape(-1, K), ACT_BLOCK)
        y = self._matmul(q, layer.weight.t(), layer.mx_scale,
                         pertoken_scale=act_mx_scale(s, K, ACT_BLOCK),
                         output_dtype=torch.bfloat16, scale_dtype=self._e8m0,
                         pertoken_scale_dtype=self._e8m0, group_sizes=[1, 1, MX_GROUP])
        return y.view(*lead, y.shape[-1])

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.fallback.apply_grouped(layer, x)
