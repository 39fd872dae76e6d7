"""Interleaved ("GPT-J" pair) rotary embedding on the trailing `rope_dim` channels.

Two tables per model: plain (theta 10000) for window-only layers, YaRN (compress theta) for layers
with a compressor. No YaRN mscale: cos/sin have unit modulus. Tables are fp32; the rotation runs
in fp32 and casts back.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig, YarnScaling, yarn_inv_freq


class RotaryTable:
    def __init__(self, rope_dim: int, base: float, yarn: YarnScaling | None, device="cpu"):
        self.rope_dim = rope_dim
        freqs = yarn_inv_freq(rope_dim, base, yarn or YarnScaling())
        self.inv_freq = torch.tensor(freqs, dtype=torch.float32, device=device)
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


def rope_tables(cfg: ModelConfig, device="cpu") -> dict[str, RotaryTable]:
    return {
        "main": RotaryTable(cfg.qk_rope_head_dim, cfg.rope_theta, None, device),
        "compress": RotaryTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling, device),
    }
