"""The DSpark drafter's module graph, as stored under `mtp.*` in DeepSeek's
`*-DSpark` and V4-Flash-0731 checkpoints.

Stages `mtp.0 .. mtp.{n-1}` are full V4 blocks with window-only attention (no compressor, no indexer)
and their own MoE size (`dspark_n_routed_experts`); stage 0 also holds `main_proj` (FP8, [D, m*D]:
the m target layers' attention inputs, averaged over the mHC streams and concatenated) and
`main_norm`; the last stage holds the stream collapse (`hc_head_*`), the final `norm`, the Markov
head (`markov_w1`, `markov_w2`: [V, r] bf16; the bias `W1[prev] @ W2^T` added to position k's logits)
and the confidence head (`proj` [1, D + r] bf16 over [h_k ; W1[prev]]). The checkpoint stores no MTP
hallmarks (`e_proj`, `h_proj`, `enorm`, `hnorm`).

Loading: these are the V4-Flash-0731 names; DS-DeepInfer's V4.1 names (`markov_head.embed.weight`,
`markov_head.head.weight`, `confidence_head.proj.weight`) load into the same buffers
(`weights.TENSOR_ALIASES`). The drafter that runs them comes from the deepinfer-dspark feature plugin
(`deepinfer_proposer`); the target's forward hands it its features (`DeepseekV4Model.capture_layers`).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..config import ModelConfig
from .layers import Linear, RMSNorm, empty, weight_format


class MarkovHead(nn.Module):
    """The bias of position k's logits is `markov_w1[prev] @ markov_w2^T` (prev: the token before k)."""

    def __init__(self, vocab: int, rank: int, device="cpu"):
        super().__init__()
        self.register_buffer("markov_w1", empty((vocab, rank), torch.bfloat16, device))   # embedding of prev
        self.register_buffer("markov_w2", empty((vocab, rank), torch.bfloat16, device))   # Linear r -> V


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj . [h_k ; markov_w1[prev]] / T_k): the chance draft k survives verification."""

    def __init__(self, dim: int, device="cpu"):
        super().__init__()
        self.register_buffer("proj", empty((1, dim), torch.bfloat16, device))


def stage_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config with the drafter's MoE size."""
    d = cfg.dspark
    return replace(cfg, n_routed_experts=d.n_routed_experts, num_experts_per_tok=d.num_experts_per_tok)


def build_stages(cfg: ModelConfig, block_cls, hc_params, device="cpu") -> nn.ModuleList:
    """The `num_nextn_predict_layers` stages; `block_cls`, `hc_params`: deepseek_v4's Block and
    _hc_params (passed in: that module imports this one)."""
    scfg = stage_config(cfg)
    n, dim = cfg.num_nextn_predict_layers, cfg.hidden_size
    stages = nn.ModuleList()
    for i in range(n):
        stage = block_cls(scfg, cfg.num_hidden_layers + i, 0, False, device=device)
        if i == 0:
            m = len(cfg.dspark.target_layer_ids)
            stage.main_proj = Linear(m * dim, dim, weight_format(cfg, "dense"),
                                     block=cfg.weight_block_size or (128, 128), device=device)
            stage.main_norm = RMSNorm(dim, cfg.rms_norm_eps, device=device)
        if i == n - 1:
            if not cfg.hc_shifted:       # V4.1 (shifted mHC): the last stage's pre collapses
                hc_params(stage, "hc_head", cfg, cfg.hc_mult, device)
            stage.norm = RMSNorm(dim, cfg.rms_norm_eps, device=device)
            stage.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark.markov_rank, device=device)
            stage.confidence_head = ConfidenceHead(dim + cfg.dspark.markov_rank, device=device)
        stages.append(stage)
    return stages
