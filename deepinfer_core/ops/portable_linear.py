"""Portable linear method: dequantise FP8/FP4 weights exactly into the compute dtype once after
loading; at run time fake-quantise the input (QAT simulation) and do a plain matmul.

FP8 x UE8M0 and FP4 x UE8M0 values are exactly representable in bf16, so dequantising loses
nothing. With the QAT simulation the product also sums as DeepSeek's FP8/FP4 GEMM kernels do: in
fp32 per weight-scale block of K (128 for FP8 weights, 32 for FP4), the blocks' sums added in
order, rounded to the output dtype once (`blockwise_linear`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import dequant_fp4, dequant_fp8_block, fake_quant_fp8

FP4_K_BLOCK = 32     # K elements per FP4 weight scale


BLOCKWISE_BYTES = 1 << 30   # the batched path's [blocks, rows, N] fp32 products stay below this


def blockwise_linear(x: torch.Tensor, w: torch.Tensor, k_block: int, mm=None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T: fp32 sums per K block of `k_block`, added block by block in order,
    rounded to x.dtype once. `mm(a, b)` = a @ b^T in fp32, one block at a time (a subclass may
    choose the GEMM); by default every block's product is one batched GEMM over as many rows as
    keep it under BLOCKWISE_BYTES (each row's sums are its own: chunking changes no bit)."""
    K, N = x.shape[-1], w.shape[0]
    xf = x.reshape(-1, K).float()
    if mm is None and K % k_block == 0:
        nb = K // k_block
        wb = w.float().view(N, nb, k_block).permute(1, 2, 0)                       # [nb, k, N]
        rows = max(1, BLOCKWISE_BYTES // (4 * nb * N))
        out = [_block_sums(torch.bmm(xf[r:r + rows].view(-1, nb, k_block).transpose(0, 1), wb))
               for r in range(0, xf.shape[0], rows)]                                 # [nb, M, N]
        acc = out[0] if len(out) == 1 else torch.cat(out)
    else:
        mm = mm or F.linear
        acc = _block_sums([mm(xf[:, k0:k0 + k_block], w[:, k0:k0 + k_block].float())
                           for k0 in range(0, K, k_block)])
    return acc.to(x.dtype).view(*x.shape[:-1], N)


def _block_sums(parts) -> torch.Tensor:
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc


class PortableLinearMethod:
    batch_invariant = False     # torch GEMMs pick their tiles by the number of rows

    def __init__(self, dtype: torch.dtype, simulate_qat: bool, block=(128, 128)):
        self.dtype, self.simulate_qat, self.block = dtype, simulate_qat, tuple(block)

    def process_weights(self, layer) -> None:
        dtype = layer.compute_dtype or self.dtype
        w, scale = layer.weight, getattr(layer, "scale", None)
        layer.k_block = None       # bf16 weights: one plain product
        if scale is None:
            w = w.to(dtype)
        elif w.dtype == torch.int8:
            w, layer.k_block = dequant_fp4(w, scale, FP4_K_BLOCK, dtype), FP4_K_BLOCK
        else:
            w, layer.k_block = dequant_fp8_block(w, scale, self.block, dtype), self.block[1]
        layer.register_buffer("weight", w.contiguous(), persistent=False)
        layer.scale = None

    def _quant_input(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.act_quant and self.simulate_qat:
            x = fake_quant_fp8(x, 128)
        return x.to(layer.weight.dtype)

    def _blockwise(self, layer) -> bool:
        """Sum as the FP8/FP4 GEMM kernels do: QAT on, an FP8-quantised input, quantised weights."""
        return self.simulate_qat and layer.act_quant and layer.k_block is not None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        xq = self._quant_input(layer, x)
        if self._blockwise(layer):
            return blockwise_linear(xq, layer.weight, layer.k_block)
        return F.linear(xq, layer.weight)

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal projection: x [T, G, in/G] -> [T, G, out/G] (V4's wo_a)."""
        G = x.shape[1]
        w = layer.weight.view(G, -1, x.shape[-1])
        return torch.einsum("tgi,goi->tgo", self._quant_input(layer, x), w)
