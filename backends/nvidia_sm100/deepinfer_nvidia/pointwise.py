"""The pointwise glue on the NVIDIA backend: the same interface and values as the core's
`PortablePointwise`, each call one fused Triton pass (`deepinfer_kernels.pointwise`) instead of a
chain of torch elementwise kernels; the inverse RoPE rotates the attention output in place.
`official` (the QAT numerics) rounds the per-head norm as the portable op's `official=True` does.
Engram's table gather reads pinned host memory directly (`deepinfer_kernels.engram`)."""
from __future__ import annotations

import torch

from deepinfer_kernels.engram import engram_gather
from deepinfer_kernels.pointwise import norm_rope_quant, rms_norm, rope_inplace


class NvidiaPointwise:
    batch_invariant = True      # every row alone; tiles and splits fixed by the model shape
    reads_host_memory = True    # gather_rows: unified addressing into pinned host tables

    def __init__(self, official: bool = False):
        self.official = official

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def norm_rope_quant(self, x: torch.Tensor, positions: torch.Tensor, rope, *, norm: str = "none",
                        weight: torch.Tensor | None = None, eps: float = 1e-6, quant: str = "none",
                        nope_dim: int | None = None) -> torch.Tensor:
        return norm_rope_quant(x, positions, rope.inv_freq_on(x.device), norm=norm, weight=weight, eps=eps,
                               quant=quant, nope_dim=nope_dim, official=self.official)

    def inverse_rope(self, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        return rope_inplace(x, positions, rope.inv_freq_on(x.device), inverse=True)

    def gather_rows(self, table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return engram_gather(table, scale, rows)
