"""V4 attention: q LoRA + per-head norm, shared K=V, partial RoPE, window + compressed KV with a
learned sink, inverse RoPE, grouped low-rank output projection.

The modules here hold the weights and do the per-token math on the flat batch. Everything that
touches per-sequence state (compressor tails, compressed rows, indexer top-k, the window ring,
the sparse attention itself) is the attention backend's job (`deepinfer_attention_backend`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.portable_pointwise import PORTABLE
from .layers import Linear, RMSNorm, empty, weight_format
from .rope import RotaryTable


@dataclass
class Numerics:
    """Numerics switches shared by every layer of one model instance."""

    dtype: torch.dtype = torch.float32
    simulate_qat: bool = True


class Compressor(nn.Module):
    """Gated pooling of `ratio` tokens (2*ratio, overlapping, for ratio 4) into one KV row."""

    def __init__(self, cfg: ModelConfig, ratio: int, dim: int, kind: str, device="cpu"):
        super().__init__()
        self.ratio, self.dim, self.kind = ratio, dim, kind          # kind: "kv" (main) | "index"
        self.overlap = ratio == 4
        width = (2 if self.overlap else 1) * dim
        self.register_buffer("ape", empty((ratio, width), torch.float32, device))
        # The reference computes these projections in fp32 on fp32 input, unquantised.
        self.wkv = Linear(cfg.hidden_size, width, "bf16", act_quant=False, device=device)
        self.wgate = Linear(cfg.hidden_size, width, "bf16", act_quant=False, device=device)
        self.wkv.compute_dtype = self.wgate.compute_dtype = torch.float32
        self.norm = RMSNorm(dim, cfg.rms_norm_eps, device=device)
        self.nope_dim = dim - cfg.qk_rope_head_dim
        self.rope: RotaryTable | None = None
        self.numerics = Numerics()

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (kv, gate logits + ape), both fp32 [T, c*dim] (fp32 layers: see __init__)."""
        kv = self.wkv(x)
        z = self.wgate(x) + self.ape[positions % self.ratio]
        return kv, z

    def finalize(self, pooled: torch.Tensor, block_starts: torch.Tensor) -> torch.Tensor:
        """Norm, RoPE at the block's first position, and the QAT fake-quant of a pooled row."""
        quant = ("fp8_nope" if self.kind == "kv" else "hadamard_fp4") if self.numerics.simulate_qat else "none"
        return self.norm.pointwise.norm_rope_quant(
            pooled.to(self.numerics.dtype), block_starts, self.rope, norm="weighted", weight=self.norm.weight,
            eps=self.norm.eps, quant=quant, nope_dim=self.nope_dim)


class Indexer(nn.Module):
    """Lightning indexer of CSA layers: scores compressed blocks, the backend keeps the top-k."""

    def __init__(self, cfg: ModelConfig, device="cpu"):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, weight_format(cfg, "dense"),
                           block=cfg.weight_block_size or (128, 128), device=device)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, "bf16", act_quant=False, device=device)
        self.compressor = Compressor(cfg, 4, self.head_dim, "index", device=device)
        self.numerics = Numerics()
        self.pointwise = PORTABLE    # bound by bind_ops()

    def queries(self, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        return self.pointwise.norm_rope_quant(q, positions, self.compressor.rope,
                                              quant="hadamard_fp4" if self.numerics.simulate_qat else "none")

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head score weights [T, n_heads] with the 1/sqrt(head_dim) score scale folded in:
        rounded to the activation dtype with the QAT numerics (the official order), fp32 without."""
        w = self.weights_proj(x)
        scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        return w * scale if self.numerics.simulate_qat else w.float() * scale


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, device="cpu"):
        super().__init__()
        self.cfg, self.ratio = cfg, ratio
        H, Dh, D = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        fmt, block = weight_format(cfg, "dense"), cfg.weight_block_size or (128, 128)
        self.n_heads, self.head_dim, self.nope_dim = H, Dh, cfg.nope_head_dim
        self.window, self.scale = cfg.sliding_window, Dh ** -0.5
        self.register_buffer("attn_sink", empty((H,), torch.float32, device))
        self.wq_a = Linear(D, cfg.q_lora_rank, fmt, block=block, device=device)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, device=device)
        self.wq_b = Linear(cfg.q_lora_rank, H * Dh, fmt, block=block, device=device)
        self.wkv = Linear(D, Dh, fmt, block=block, device=device)
        self.kv_norm = RMSNorm(Dh, cfg.rms_norm_eps, device=device)
        # wo_a: grouped projection, bf16 einsum in the reference (no activation quant).
        self.wo_a = Linear(H * Dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, fmt, block=block,
                           act_quant=False, device=device, groups=cfg.o_groups)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, fmt, block=block, device=device)
        self.compressor = Compressor(cfg, ratio, Dh, "kv", device=device) if ratio else None
        self.indexer = Indexer(cfg, device=device) if ratio == 4 else None
        self.rope: RotaryTable | None = None
        self.backend = None          # bound by bind_ops()
        self.pointwise = PORTABLE    # bound by bind_ops()
        self.numerics = Numerics()

    def forward(self, x: torch.Tensor, batch, states) -> torch.Tensor:
        T, pos, pw, eps = x.shape[0], batch.positions, self.pointwise, self.cfg.rms_norm_eps
        qr = self.q_norm(self.wq_a(x))
        q = pw.norm_rope_quant(self.wq_b(qr).view(T, self.n_heads, self.head_dim), pos, self.rope,
                               norm="head", eps=eps)
        kv = pw.norm_rope_quant(self.wkv(x), pos, self.rope, norm="weighted", weight=self.kv_norm.weight, eps=eps,
                                quant="fp8_nope" if self.numerics.simulate_qat else "none", nope_dim=self.nope_dim)
        extras = AttentionInputs(q=q, kv=kv)
        if self.compressor is not None:
            extras.comp_kv, extras.comp_z = self.compressor.project(x, pos)
        if self.indexer is not None:
            extras.idx_kv, extras.idx_z = self.indexer.compressor.project(x, pos)
            extras.idx_q = self.indexer.queries(qr, pos)
            extras.idx_w = self.indexer.head_weights(x)
        o = self.backend.forward(self, extras, batch, states)          # [T, H, Dh]
        o = pw.inverse_rope(o, pos, self.rope)
        z = self.wo_a.method.apply_grouped(self.wo_a, o.reshape(T, self.cfg.o_groups, -1))
        return self.wo_b(z.flatten(1))


@dataclass
class AttentionInputs:
    """Per-token tensors of one layer handed to the attention backend (flat batch rows)."""

    q: torch.Tensor                          # [T, H, Dh] roped, normed
    kv: torch.Tensor                         # [T, Dh] roped (shared K=V)
    comp_kv: torch.Tensor | None = None      # [T, c*Dh] fp32 compressor inputs
    comp_z: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None       # [T, 2*Di] fp32 indexer-compressor inputs
    idx_z: torch.Tensor | None = None
    idx_q: torch.Tensor | None = None        # [T, Hi, Di]
    idx_w: torch.Tensor | None = None        # [T, Hi] head weights x 1/sqrt(Di)
