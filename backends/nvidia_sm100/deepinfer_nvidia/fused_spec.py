"""What the NVIDIA MoE method leaves on a MoE layer whose experts it stacked (`NvidiaMoEMethod`),
read by the method and by its expert-parallel seam (`ep_experts.py`) alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class FusedSpec:
    """Per-layer numerics of the fused path (tensors live as buffers on the MoE module); the
    stacks hold the routed experts 0..n_routed-1 and, when `shared_stacked`, the shared expert at
    n_routed (else it runs beside them through its own linear layers, which clamp it themselves)."""
    n_routed: int
    compute_dtype: torch.dtype
    quant_in: bool          # act_quant of the w1/w3 input
    quant_mid: bool         # act_quant of the w2 input
    swiglu_limit: float
    n_fp4: int              # experts 0..n_fp4-1 kept FP4 (nv_*_codes / nv_*_groups), rest FP8
    clamp_shared: bool = False      # the shared expert is SwiGLU-clamped too (V4.1)
    shared_stacked: bool = True     # False: the shared expert is not in the stacks (V4.1)

    @property
    def n_clamped(self) -> int:
        """Stacked experts 0..n_clamped-1 get the SwiGLU clamp."""
        return self.n_routed + int(self.clamp_shared and self.shared_stacked)


class FusedAway:
    """Stand-in linear method for expert layers whose weights moved into the MoE's stacks."""

    def process_weights(self, layer) -> None:
        pass

    def apply(self, layer, x):
        raise RuntimeError("this expert's weights were moved into its MoE layer's fused tensors "
                           "(NvidiaMoEMethod); run the MoE layer instead")


class FusingMoEMethod(Protocol):
    """What the expert-parallel seam uses of `NvidiaMoEMethod`."""

    portable: Any

    def fused(self, moe: nn.Module) -> bool: ...

    def route(self, moe: nn.Module, x: torch.Tensor,
              input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _config(self, spec: FusedSpec, rows: int, k: int, experts: int,
                device: Any) -> dict | None: ...
