"""The DeepSeek-V4 module graph: embedding -> hc_mult residual streams -> blocks (mHC around
attention and MoE) -> hc_head collapse -> norm -> fp32 LM head; plus the MTP block(s).

V4.1 is the same graph under config switches (config_v41.py): shifted mHC (each sub-layer's input
collapsed with the previous sub-layer's `pre`, the last one's ending the stack: no hc_head),
cross-layer sharing and YOCO inside the attention layers, Engram before a layer's attention.

Backend-agnostic: every layer holds op objects chosen once at start-up (`bind_ops`); this file
never calls pluggy. Layer kinds come from `compress_ratios` in config.json.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention, Numerics
from .dspark import build_stages
from .engram import Engram, EngramInputs, table_rows
from .forward_batch import ForwardBatch
from .layers import Embedding, Linear, RMSNorm, empty, weight_format
from .moe import MoE
from .yoco import compact


def _hc_params(module: nn.Module, prefix: str, cfg: ModelConfig, n_out: int, device) -> None:
    """Register `{prefix}_fn`, `{prefix}_base`, `{prefix}_scale` (fp32) as in the checkpoint."""
    module.register_buffer(f"{prefix}_fn", empty((n_out, cfg.hc_mult * cfg.hidden_size), torch.float32, device))
    module.register_buffer(f"{prefix}_base", empty((n_out,), torch.float32, device))
    module.register_buffer(f"{prefix}_scale", empty((3 if n_out > cfg.hc_mult else 1,), torch.float32, device))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ratio: int, hash_routed: bool, device="cpu",
                 engram_rows: int = 0):
        super().__init__()
        self.layer_id, self.ratio = layer_id, ratio
        n_mix = (2 + cfg.hc_mult) * cfg.hc_mult
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device)
        _hc_params(self, "hc_attn", cfg, n_mix, device)
        _hc_params(self, "hc_ffn", cfg, n_mix, device)
        self.attn = Attention(cfg, layer_id, ratio, device=device)
        self.ffn = MoE(cfg, layer_id, hash_routed, device=device)
        self.engram = Engram(cfg, engram_rows, device=device) if engram_rows else None
        self.mhc = None   # bound by bind_ops()

    def forward(self, h: torch.Tensor, batch: ForwardBatch, states, input_ids: torch.Tensor) -> torch.Tensor:
        y, post, comb = self.mhc.pre(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        h = self.mhc.post(self.attn(self.attn_norm(y), batch, states), h, post, comb)
        y, post, comb = self.mhc.pre(h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        return self.mhc.post(self.ffn(self.ffn_norm(y), input_ids), h, post, comb)

    def forward_shifted(self, h: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch, states,
                        input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shifted mHC (V4.1): each sub-layer's input is collapsed with the `pre` weights of the
        sub-layer before it; returns (streams, this block's ffn `pre`)."""
        y, pre, post, comb = self.mhc.pre_shifted(h, pre, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        h = self.mhc.post(self.attn(self.attn_norm(y), batch, states), h, post, comb)
        y, pre, post, comb = self.mhc.pre_shifted(h, pre, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        return self.mhc.post(self.ffn(self.ffn_norm(y), input_ids), h, post, comb), pre


class MTPBlock(Block):
    """Multi-token prediction block: predicts token t+2 from the main streams at t and token t+1."""

    def __init__(self, cfg: ModelConfig, mtp_id: int, device="cpu"):
        super().__init__(cfg, cfg.num_hidden_layers + mtp_id, cfg.mtp_ratio(mtp_id), False, device=device)
        fmt, block = weight_format(cfg, "dense"), cfg.weight_block_size or (128, 128)
        D = cfg.hidden_size
        self.e_proj = Linear(D, D, fmt, block=block, device=device)
        self.h_proj = Linear(D, D, fmt, block=block, device=device)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, device=device)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, device=device)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, device=device)
        _hc_params(self, "hc_head", cfg, cfg.hc_mult, device)

    def forward_mtp(self, h_main: torch.Tensor, next_embed: torch.Tensor, batch: ForwardBatch,
                    states, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed hidden [T, D] for the head, output streams [T, hc, D])."""
        e = self.e_proj(self.enorm(next_embed))
        u = e[:, None, :] + self.h_proj(self.hnorm(h_main))
        u = super().forward(u, batch, states, next_ids)
        x = self.mhc.head(u, self.hc_head_fn, self.hc_head_scale, self.hc_head_base)
        return self.norm(x), u


@dataclass
class ModelOutput:
    logits: torch.Tensor          # [N, vocab] fp32 for batch.logits_rows
    streams: torch.Tensor         # [T, hc, D] final streams before hc_head (MTP input)
    features: torch.Tensor | None = None   # [T, m*D] DSpark's target features (capture_layers), else None


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        engram = dict(zip(cfg.engram.layer_ids, table_rows(cfg))) if cfg.engram else {}
        self.layers = nn.ModuleList(
            Block(cfg, i, cfg.layer_ratio(i), cfg.is_hash_layer(i), device=device, engram_rows=engram.get(i, 0))
            for i in range(cfg.num_hidden_layers))
        # Engram's hashing (set by the loader from the checkpoint's tokenizer.json: bind_engram)
        self.engram_inputs: EngramInputs | None = None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device)
        # [vocab, D] bf16 in the checkpoint, an fp32 product in the reference: computed by the bf16
        # linear method like every other GEMM (so a backend or feature that replaces GEMMs covers it)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, "bf16", act_quant=False, device=device)
        self.head.compute_dtype = torch.float32
        if not cfg.hc_shifted:
            _hc_params(self, "hc_head", cfg, cfg.hc_mult, device)
        if cfg.dspark is not None:      # mtp.* holds a DSpark drafter's stages (model/dspark.py)
            self.mtp = build_stages(cfg, Block, _hc_params, device=device)
        else:
            self.mtp = nn.ModuleList(MTPBlock(cfg, i, device=device) for i in range(cfg.num_nextn_predict_layers))
        self.numerics = Numerics()
        self.mhc = None   # bound by bind_ops()
        # layers whose attention input streams, averaged over the mHC streams, the forward returns
        # as `features` (set by the DSpark drafter)
        self.capture_layers: tuple[int, ...] = ()

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).to(self.numerics.dtype)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] (the bf16 linear method: on a GPU with bf16 activations an
        fp32-accumulating bf16 GEMM, exact products; elsewhere an fp32 product)."""
        return self.head(x)

    def bind_engram(self, tokenizer_json, device) -> None:
        """Engram's compressed vocabulary and hash tables (a no-op without Engram layers)."""
        if self.cfg.engram is not None:
            self.engram_inputs = EngramInputs(self.cfg, tokenizer_json, device)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        if self.cfg.engram is not None:
            if self.engram_inputs is None:
                raise RuntimeError("Engram layers need bind_engram(tokenizer.json) before a forward")
            rows = self.engram_inputs.rows(batch)
            batch.shared["engram_rows"] = dict(zip(self.cfg.engram.layer_ids, rows))
        e = self.embed_tokens(batch.input_ids)
        h = e[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        captured = {}
        pre = None
        if self.cfg.hc_shifted:         # the first sub-layer reads stream 0
            pre = torch.zeros(h.shape[:2], dtype=torch.float32, device=h.device)
            pre[:, 0] = 1.0
        compact_at = self.cfg.n_prefill_layer if batch.truncation and batch.truncation[0] == "compact" else -1
        for i, layer in enumerate(self.layers):
            if i == compact_at:          # bounded replay: the consumer half runs on the kept rows
                batch, h, pre = compact(batch, h, pre, lambda: layer.attn_norm(self.mhc.collapse(h, pre)))
            if layer.engram is not None:     # on the trunk entering the layer's attention
                h = layer.engram(h, batch.shared["engram_rows"][i])
            if i in self.capture_layers:
                captured[i] = h.mean(1)
            states = [st.layers[i] for st in batch.states]
            if pre is None:
                h = layer(h, batch, states, batch.input_ids)
            else:
                h, pre = layer.forward_shifted(h, pre, batch, states, batch.input_ids)
        rows = batch.logits_rows
        if pre is None:
            x = self.mhc.head(h[rows], self.hc_head_fn, self.hc_head_scale, self.hc_head_base)
        else:
            x = self.mhc.collapse(h[rows], pre[rows])
        features = torch.cat([captured[i] for i in self.capture_layers], -1) if captured else None
        return ModelOutput(logits=self.lm_head(self.norm(x)), streams=h, features=features)

    def forward_mtp(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch,
                    mtp_id: int = 0) -> torch.Tensor:
        """MTP logits [N, vocab] for batch.logits_rows; `next_ids[t]` is the token after row t."""
        return self.mtp_step(streams, next_ids, batch, mtp_id)[0]

    def mtp_step(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch,
                 mtp_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(MTP logits [N, vocab] for batch.logits_rows, the block's output streams [T, hc, D]: the
        `streams` input of a further draft step, EAGLE-style)."""
        block = self.mtp[mtp_id]
        x, u = block.forward_mtp(streams, self.embed_tokens(next_ids), batch,
                                 [st.mtp_layers[mtp_id] for st in batch.states], next_ids)
        return self.lm_head(x[batch.logits_rows]), u


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> DeepseekV4Model:
    """The module graph with checkpoint-format buffers (uninitialised unless loaded)."""
    return DeepseekV4Model(cfg, device=device)
