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
from ..ops.portable_pointwise import PORTABLE, V41_KV_QUANTS, fake_quant_kv_row
from .layers import Linear, RMSNorm, empty, weight_format
from .rope import RotaryTable


@dataclass
class Numerics:
    """Numerics switches shared by every layer of one model instance."""

    dtype: torch.dtype = torch.float32
    simulate_qat: bool = True


class Compressor(nn.Module):
    """Gated pooling of `ratio` tokens into one KV row: V4 pools 2*ratio overlapping tokens for
    ratio 4 and adds a learned position bias (APE); V4.1 (`compress_overlap` off) pools `ratio`
    tokens without APE, and its ratio-1 compressor has no gate (one row per token).

    QAT fake-quant of the rows (`quant`, with simulate_qat): V4 KV rows "fp8_nope", V4 indexer keys
    "hadamard_fp4"; V4.1 KV rows "fp4_kv" (`use_fp4_sparse_kv`) or "mxfp8_kv" over every channel."""

    def __init__(self, cfg: ModelConfig, ratio: int, dim: int, kind: str, device="cpu"):
        super().__init__()
        self.ratio, self.dim, self.kind = ratio, dim, kind          # kind: "kv" (main) | "index"
        self.overlap = ratio == 4 and cfg.compress_overlap
        width = (2 if self.overlap else 1) * dim
        if cfg.compress_overlap:
            self.register_buffer("ape", empty((ratio, width), torch.float32, device))
        else:
            self.ape = None
        # The reference computes these projections in fp32 on fp32 input, unquantised (V4.1's C1
        # projection runs in the activation dtype).
        self.wkv = Linear(cfg.hidden_size, width, "bf16", act_quant=False, device=device)
        self.wgate = Linear(cfg.hidden_size, width, "bf16", act_quant=False, device=device) if ratio > 1 else None
        if self.wgate is not None:
            self.wkv.compute_dtype = self.wgate.compute_dtype = torch.float32
        self.norm = RMSNorm(dim, cfg.rms_norm_eps, device=device)
        self.nope_dim = dim - cfg.qk_rope_head_dim
        self.quant = self.row_quant(cfg, kind)
        self.rope: RotaryTable | None = None
        self.numerics = Numerics()

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token (kv, gate logits [+ ape]) [T, c*dim] (fp32 layers: see __init__); no gate
        logits (None) for an ungated ratio-1 compressor."""
        kv = self.wkv(x)
        if self.wgate is None:
            return kv.float(), None
        z = self.wgate(x)
        return kv, (z if self.ape is None else z + self.ape[positions % self.ratio])

    def finalize(self, pooled: torch.Tensor, block_starts: torch.Tensor) -> torch.Tensor:
        """Norm, RoPE at the block's first position, and the QAT fake-quant of a pooled row."""
        return self._rope_quant(pooled.to(self.numerics.dtype), block_starts, norm="weighted",
                                weight=self.norm.weight, eps=self.norm.eps)

    def finalize_with_prerope(self, pooled: torch.Tensor, block_starts: torch.Tensor):
        """(`finalize`'s rows, the normalised rows before RoPE): V4.1 projects its index keys from
        the latter, which stay unquantised."""
        pre = self.norm(pooled.to(self.numerics.dtype))
        return self._rope_quant(pre, block_starts), pre

    def _rope_quant(self, x: torch.Tensor, block_starts: torch.Tensor, **norm) -> torch.Tensor:
        """The pointwise op (an optional norm, RoPE, the fake-quant) on rows. A V4.1 KV mode is
        applied here in PyTorch after the op (quant "none"), so any backend's PointwiseMethod
        serves it."""
        quant = self.quant if self.numerics.simulate_qat else "none"
        late = quant in V41_KV_QUANTS
        rows = self.norm.pointwise.norm_rope_quant(x, block_starts, self.rope,
                                                   quant="none" if late else quant,
                                                   nope_dim=self.nope_dim, **norm)
        return fake_quant_kv_row(rows, quant) if late else rows

    @staticmethod
    def row_quant(cfg: ModelConfig, kind: str) -> str:
        """The QAT fake-quant of a compressor's rows. V4.1's compressed-KV precision follows
        `use_fp4_sparse_kv`; a V4 model keeps "fp8_nope" whatever that field says."""
        if kind == "index":
            return "hadamard_fp4"
        if kind != "kv":
            raise ValueError(f"Compressor kind={kind!r}; allowed: ['kv', 'index']")
        if cfg.family == "v41":
            return "fp4_kv" if cfg.use_fp4_sparse_kv else "mxfp8_kv"
        return "fp8_nope"


class Indexer(nn.Module):
    """Lightning indexer: scores compressed rows, the backend keeps the top-k. Its keys come from
    a compressor of its own (V4) or, on a V4.1 index-key source (`owns_keys`), from `wk` over the
    main compressor's normalised rows; a V4.1 index source without keys scores its source's."""

    def __init__(self, cfg: ModelConfig, ratio: int = 4, owns_keys: bool = True, device="cpu"):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, weight_format(cfg, "dense"),
                           block=cfg.weight_block_size or (128, 128), device=device)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, "bf16", act_quant=False, device=device)
        self.compressor = self.wk = self.k_norm = None
        if not cfg.index_keys_projected:
            self.compressor = Compressor(cfg, ratio, self.head_dim, "index", device=device)
        elif owns_keys:
            self.wk = Linear(cfg.head_dim, self.head_dim, "bf16", act_quant=False, device=device)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, device=device)
        self.rope: RotaryTable | None = None
        self.numerics = Numerics()
        self.pointwise = PORTABLE    # bound by bind_ops()

    def queries(self, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        return self.pointwise.norm_rope_quant(q, positions, self.rope,
                                              quant="hadamard_fp4" if self.numerics.simulate_qat else "none")

    def keys(self, pre_rope: torch.Tensor, block_starts: torch.Tensor) -> torch.Tensor:
        """V4.1 index keys of new compressed rows: RoPE(k_norm(wk . rows before RoPE))."""
        return self.pointwise.norm_rope_quant(
            self.wk(pre_rope), block_starts, self.rope, norm="weighted", weight=self.k_norm.weight,
            eps=self.k_norm.eps, quant="hadamard_fp4" if self.numerics.simulate_qat else "none")

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head score weights [T, n_heads] with the 1/sqrt(head_dim) score scale folded in:
        rounded to the activation dtype with the QAT numerics (the official order), fp32 without."""
        w = self.weights_proj(x)
        scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        return w * scale if self.numerics.simulate_qat else w.float() * scale


class Attention(nn.Module):
    """One layer's attention. Under cross-layer sharing (V4.1) only a KV source holds a
    compressor and only an index source an indexer; the others read their sources' rows and
    selections (`kv_source`, `index_source`) through the backend."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ratio: int, device="cpu"):
        super().__init__()
        self.cfg, self.ratio, self.layer_id = cfg, ratio, layer_id
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
        self.kv_source, self.index_source = cfg.kv_source(layer_id), cfg.index_source(layer_id)
        self.compressor = Compressor(cfg, ratio, Dh, "kv", device=device) if self.kv_source == layer_id else None
        self.indexer = None
        if self.index_source == layer_id:
            self.indexer = Indexer(cfg, ratio, owns_keys=self.compressor is not None, device=device)
        topo = cfg.topology if layer_id < cfg.num_hidden_layers else None
        # YOCO: the first consumer layer's input is the shared hidden every consumer-half
        # compressor reads; candidate blocks: "source" scores them, "consumer" selects inside
        self.yoco_capture = topo is not None and layer_id == topo.n_prefill_layer
        self.yoco_consumer = topo is not None and layer_id >= topo.n_prefill_layer
        self.candidate = (None if topo is None or topo.candidate_source is None else
                          "source" if layer_id == topo.candidate_source else
                          "consumer" if topo.candidate_consumer(layer_id) else None)
        self.rope: RotaryTable | None = None
        self.backend = None          # bound by bind_ops()
        self.pointwise = PORTABLE    # bound by bind_ops()
        self.numerics = Numerics()

    def forward(self, x: torch.Tensor, batch, states) -> torch.Tensor:
        T, pos, pw, eps = x.shape[0], batch.positions, self.pointwise, self.cfg.rms_norm_eps
        qr = self.q_norm(self.wq_a(x))
        q = pw.norm_rope_quant(self.wq_b(qr).view(T, self.n_heads, self.head_dim), pos, self.rope,
                               norm="head" if self.cfg.use_q_head_norm else "none", eps=eps)
        kv = pw.norm_rope_quant(self.wkv(x), pos, self.rope, norm="weighted", weight=self.kv_norm.weight, eps=eps,
                                quant="fp8_nope" if self.numerics.simulate_qat else "none", nope_dim=self.nope_dim)
        extras = AttentionInputs(q=q, kv=kv)
        full = batch.shared.get("yoco_full")       # compact bounded replay: the uncompacted batch
        if self.yoco_capture and full is None:
            batch.shared["yoco_hidden"] = x
        if self.compressor is not None:             # consumer-half sources: every row, shared hidden
            xc = batch.shared["yoco_hidden"] if self.yoco_consumer else x
            extras.comp_kv, extras.comp_z = self.compressor.project(
                xc, full.positions if self.yoco_consumer and full is not None else pos)
        if self.indexer is not None:
            if self.indexer.compressor is not None:
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
    comp_z: torch.Tensor | None = None       # None for an ungated (ratio-1) compressor
    idx_kv: torch.Tensor | None = None       # [T, 2*Di] fp32 indexer-compressor inputs
    idx_z: torch.Tensor | None = None
    idx_q: torch.Tensor | None = None        # [T, Hi, Di]
    idx_w: torch.Tensor | None = None        # [T, Hi] head weights x 1/sqrt(Di)
