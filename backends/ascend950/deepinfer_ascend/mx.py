"""MX (OCP microscaling) scale layouts for torch_npu's MXFP8 matmul, built from DeepSeek's scales.

The A5 MX form of `npu_quant_matmul` takes one E8M0 scale per 32 elements along K, stored in
pairs: activations `pertoken_scale` [M, ceil(K/64), 2], weights `scale` [ceil(K/64), N, 2]
(the layout vllm-ascend uses and the torch_npu 2.13.0 meta registration declares; no doc page
[UNCONFIRMED]). DeepSeek's scales are coarser powers of two: 128x128 (V4) or 32x32 (V4.1) weight
blocks and one activation scale per 128 channels. Repeating each coarse scale over the 32-groups
it covers gives the same products exactly (a power-of-two scale per 32 that happens to be equal
across four groups is still that scale), so no value changes.
"""
from __future__ import annotations

import torch

MX_GROUP = 32


def e8m0_codes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales (normal) or float8_e8m0fnu -> uint8 E8M0 codes."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype != torch.float32:
        raise TypeError(f"e8m0_codes: scale dtype {scale.dtype}; allowed: float32 powers of two, "
                        "float8_e8m0fnu")
    return ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _pairs(codes: torch.Tensor) -> torch.Tensor:
    """[..., groups] -> [..., ceil(groups/2), 2] (an odd last group padded with code 0)."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes.unflatten(-1, (-1, 2))


def groups_of(k: int) -> int:
    return -(-k // MX_GROUP)


def weight_mx_scale(scale: torch.Tensor, out_features: int, in_features: int,
                    block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N/bo), ceil(K/bi)] (E8M0) -> MX weight scales [ceil(K/64), N, 2] uint8."""
    bo, bi = block
    if bi % MX_GROUP:
        raise ValueError(f"weight block {block}: the K side must be a multiple of {MX_GROUP}")
    codes = e8m0_codes(scale).repeat_interleave(bo, 0)[:out_features]           # [N, K/bi]
    codes = codes.repeat_interleave(bi // MX_GROUP, 1)[:, :groups_of(in_features)]  # [N, K/32]
    return _pairs(codes).permute(1, 0, 2).contiguous()                           # [K/64, N, 2]


def act_mx_scale(scale: torch.Tensor, in_features: int, act_block: int) -> torch.Tensor:
    """Activation scales [M, ceil(K/act_block)] (float32 powers of two) -> [M, ceil(K/64), 2]."""
    if act_block % MX_GROUP:
        raise ValueError(f"activation block {act_block}: must be a multiple of {MX_GROUP}")
    codes = e8m0_codes(scale).repeat_interleave(act_block // MX_GROUP, -1)
    return _pairs(codes[..., :groups_of(in_features)]).contiguous()
