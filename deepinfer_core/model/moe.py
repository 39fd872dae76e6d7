"""V4 MoE: sqrt-softplus scores, bias for selection only (or a token-id hash table), renormalised
top-k weights times the routed scale, SwiGLU-clamped routed experts, one shared expert (unclamped in
V4, clamped in V4.1: `shared_expert_clamp`). The MoE method (`deepinfer_moe_method`) does routing, dispatch,
expert compute and combine; these modules hold the weights.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import Linear, empty, weight_format


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, hash_routed: bool, device="cpu"):
        super().__init__()
        self.hash_routed, self.topk = hash_routed, cfg.num_experts_per_tok
        self.routed_scale, self.renormalize = cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.register_buffer("weight", empty((cfg.n_routed_experts, cfg.hidden_size), torch.bfloat16, device))
        if hash_routed:
            self.register_buffer("tid2eid", empty((cfg.vocab_size, cfg.num_experts_per_tok), torch.int64, device))
            self.bias = None
        else:
            self.register_buffer("bias", empty((cfg.n_routed_experts,), torch.float32, device))
            self.tid2eid = None


class Expert(nn.Module):
    """SwiGLU expert: w2(silu(w1 x) * (w3 x)); `swiglu_limit` clamps routed experts only."""

    def __init__(self, cfg: ModelConfig, fmt: str, swiglu_limit: float, device="cpu"):
        super().__init__()
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        block = cfg.weight_block_size or (128, 128)
        self.swiglu_limit = swiglu_limit
        self.w1 = Linear(D, I, fmt, block=block, device=device)
        self.w2 = Linear(I, D, fmt, block=block, device=device)
        self.w3 = Linear(D, I, fmt, block=block, device=device)

    def forward(self, x: torch.Tensor, route_weight: torch.Tensor | None = None,
                silu=torch.nn.functional.silu) -> torch.Tensor:
        g, u = self.w1(x).float(), self.w3(x).float()
        if self.swiglu_limit > 0:
            u = u.clamp(-self.swiglu_limit, self.swiglu_limit)
            g = g.clamp(max=self.swiglu_limit)
        a = silu(g) * u
        if route_weight is not None:      # the routing weight multiplies before w2 (reference order)
            a = route_weight[:, None] * a
        return self.w2(a.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, hash_routed: bool, device="cpu"):
        super().__init__()
        self.layer_id = layer_id
        self.gate = Gate(cfg, hash_routed, device=device)
        fmt = weight_format(cfg, "expert")
        self.experts = nn.ModuleList(Expert(cfg, fmt, cfg.swiglu_limit, device=device)
                                     for _ in range(cfg.n_routed_experts))
        # V4's shared expert is not clamped (reference); V4.1's is (shared_expert_clamp); FP8 like
        # the dense layers.
        limit = cfg.swiglu_limit if cfg.shared_expert_clamp else 0.0
        self.shared_experts = Expert(cfg, weight_format(cfg, "dense"), limit, device=device)
        self.method = None   # bound by bind_ops()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, input_ids)
