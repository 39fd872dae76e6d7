"""Interleaved ("GPT-J" pair) rotary embedding on the trailing `rope_dim` channels.

Two tables per model: plain (theta 10000) for window-only layers, YaRN (compress theta) for layers
with a compressor. No YaRN mscale: cos/sin have unit modulus. Tables are fp32; the rotation runs
in fp32 and casts back.

`official=True` (the QAT numerics) rounds as DeepSeek's inference code does: the inverse
frequencies and the YaRN blend computed in float32 tensors (not in double), cos/sin through
`torch.polar`, and the rotation as a complex64 product.
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig, YarnScaling, yarn_inv_freq


def official_inv_freq(rope_dim: int, base: float, yarn: YarnScaling) -> torch.Tensor:
    """The inverse frequencies in float32 arithmetic, in the official code's order of operations."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    orig = yarn.original_max_position_embeddings
    if orig <= 0:
        return freqs

    def corr(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / yarn.factor * (1 - smooth) + freqs * smooth


class RotaryTable:
    def __init__(self, rope_dim: int, base: float, yarn: YarnScaling | None, device="cpu",
                 official: bool = False):
        self.rope_dim, self.official = rope_dim, official
        yarn = yarn or YarnScaling()
        if official:
            self.inv_freq = official_inv_freq(rope_dim, base, yarn).to(device)
        else:
            self.inv_freq = torch.tensor(yarn_inv_freq(rope_dim, base, yarn), dtype=torch.float32,
                                         device=device)
        self._on_device = {self.inv_freq.device: self.inv_freq}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The table on `device`, copied there once (a copy per call would be a host transfer per
        layer, and cannot be captured in a CUDA graph)."""
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq_on(positions.device)[None, :]
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last `rope_dim` channels of x [T, ..., D] by +-pos*f (positions [T])."""
        if self.official:
            return self._apply_complex(x, positions, inverse)
        cos, sin = self.cos_sin(positions)
        if inverse:
            sin = -sin
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        rd = self.rope_dim
        rope = x[..., -rd:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rot = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)

    def _apply_complex(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq_on(positions.device)[None, :]
        cis = torch.polar(torch.ones_like(angles), angles)
        if inverse:
            cis = cis.conj()
        rd = self.rope_dim
        pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
        cis = cis.view((cis.shape[0],) + (1,) * (pairs.dim() - 2) + (cis.shape[1],))
        rot = torch.view_as_real(pairs * cis).flatten(-2)
        return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


def rope_tables(cfg: ModelConfig, device="cpu", official: bool = False) -> dict[str, RotaryTable]:
    """`official`: the QAT numerics' tables (see the module docstring)."""
    return {
        "main": RotaryTable(cfg.qk_rope_head_dim, cfg.rope_theta, None, device, official),
        "compress": RotaryTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling,
                                device, official),
    }
