"""The DSpark drafter (dspark.md §3), the `deepinfer_proposer` of this feature plugin: a parallel block forward over `[anchor, noise x (gamma-1)]`
through the checkpoint's stages (model/dspark.py), then left-to-right sampling with the Markov head's
bias, and a confidence per draft for VARLEN.

Context: every row the target runs (prefill chunks, verify rows) leaves its features, the residual
streams entering the attention of each `dspark_target_layer_ids` layer averaged over the mHC streams
(`DeepseekV4Model.capture_layers`); `observe` projects them (`main_h = main_norm(main_proj(concat))`)
and writes each stage's key for that position into the stage's window ring, as DS-DeepInfer injects it
(`k_i[p] = RoPE(kv_norm_i(wkv_i(main_h[p])), p)`, FP8-rounded under QAT like a main key). Rows a
verification rejects leave keys at positions past the accepted prefix, which later target rows
overwrite before any draft reads them (a draft reads the main keys ending at its anchor's position -
1), so rollback is again only the sequence's next position.

Draft: the anchor (the token the step just committed, at position n) and gamma - 1 noise tokens at
positions n..n+gamma-1 run through the stages; each row attends, with the stage's sink, to the last
`window` main keys ending at n - 1 and to every block row (non-causal); the block's own keys are not
written to the ring. The last stage collapses the streams (hc_head) into h_k, then norm and the shared
head give U_k. Position k's logits are `U_k + markov_w1[prev] @ markov_w2^T` (prev: the anchor, then
each drawn draft), its confidence `sigmoid(proj . [h_k ; markov_w1[prev]] / T_k)` (pre-norm h_k, as
DS-DeepInfer feeds it), and the draft is drawn with the request's own parameters (mtp.draw: argmax, or
a sample of the processed distribution with the "draft" uniform of (seed, position)).

This path is portable PyTorch, run per request for the attention, and eager only: a runner with CUDA
graphs runs the target eagerly while DSpark drafts (the graphs do not return the features yet).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer_core.model.deepseek_v4 import DeepseekV4Model, ModelOutput
from deepinfer_core.model.forward_batch import ForwardBatch
from deepinfer_core.ops.kv_fp8 import unpack_kv_fp8
from deepinfer_core.ops.portable_attention import (
    PortableAttentionBackend,
    ring_rope_dim,
)
from deepinfer_core.speculative.mtp import Drafts, draw


def parse_temperatures(value: Sequence[float], num_drafts: int) -> list[float]:
    """DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE: one value for every position, or one per draft
    position; each clamped to >= 1e-5."""
    temps = [float(t) for t in value]
    if len(temps) == 1:
        temps *= num_drafts
    if len(temps) != num_drafts:
        raise ValueError(f"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE has {len(temps)} values; allowed: 1 or "
                         f"{num_drafts} (DEEPINFER_USE_NEXTN_DECODE)")
    return [max(t, 1e-5) for t in temps]


class DSparkDrafter:
    def __init__(self, model: DeepseekV4Model, num_drafts: int, temperatures: Sequence[float] = (1.0,)):
        if model.cfg.dspark is None or not len(model.mtp):
            raise ValueError("the checkpoint has no DSpark drafter (dspark_* config keys and mtp.* stages)")
        self.model, self.stages, self.num_drafts = model, model.mtp, num_drafts
        self.noise = model.cfg.dspark.noise_token_id
        self.temperatures = parse_temperatures(temperatures, num_drafts)
        model.capture_layers = model.cfg.dspark.target_layer_ids

    # ---- context: inject the target rows' keys ---------------------------------------------------
    def observe(self, batch: ForwardBatch, target: ModelOutput) -> None:
        """Write every stage's key of every row of a target forward into that stage's ring."""
        first = self.stages[0]
        main_h = first.main_norm(first.main_proj(target.features))
        for i, stage in enumerate(self.stages):
            kv = self._keys(stage.attn, main_h, batch.positions)
            for sl, start, st in zip(batch.seq_slices(), batch.starts, batch.states):
                PortableAttentionBackend.write_ring(st.mtp_layers[i], kv[sl], start)

    @staticmethod
    def _keys(attn, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return attn.pointwise.norm_rope_quant(
            attn.wkv(x), positions, attn.rope, norm="weighted", weight=attn.kv_norm.weight, eps=attn.cfg.rms_norm_eps,
            quant="fp8_nope" if attn.numerics.simulate_qat else "none", nope_dim=attn.nope_dim)

    # ---- drafts ----------------------------------------------------------------------------------
    def propose(self, anchors: torch.Tensor, anchor_positions: list[int], states: list, params: Sequence[Any],
                seeds: Sequence[int]) -> Drafts:
        """gamma drafts per request after its anchor (the token at `anchor_positions[i]`)."""
        n, k, dev = anchors.shape[0], self.num_drafts, anchors.device
        ids = torch.full((n, k), self.noise, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        ids = ids.flatten()
        positions = torch.tensor([p + j for p in anchor_positions for j in range(k)], dtype=torch.long, device=dev)
        model = self.model
        h = model.embed_tokens(ids)[:, None, :].expand(-1, model.cfg.hc_mult, -1).contiguous()
        for i, stage in enumerate(self.stages):
            h = self._stage(stage, h, ids, positions, anchor_positions, [st.mtp_layers[i] for st in states], k)
        last = self.stages[-1]
        hidden = last.mhc.head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base)       # [n*k, D]
        base = model.lm_head(last.norm(hidden)).view(n, k, -1)
        hidden = hidden.view(n, k, -1)
        w1, w2 = last.markov_head.markov_w1, last.markov_head.markov_w2.float()
        proj = last.confidence_head.proj.float()
        greedy = all(p.temperature < 1e-5 for p in params)
        prev, drafted, dists, conf = anchors, [], [], []
        for j in range(k):
            e = w1[prev].float()
            logits = base[:, j] + e @ w2.T
            z = torch.cat([hidden[:, j].float(), e], -1) @ proj.T
            conf.append(torch.sigmoid((z.squeeze(-1) / self.temperatures[j]).clamp(-60.0, 60.0)))
            tok, q = draw(logits, params, [p + 1 + j for p in anchor_positions], seeds, greedy)
            drafted.append(tok)
            dists.append(q)
            prev = tok
        return Drafts(torch.stack(drafted, 1), None if greedy else torch.stack(dists, 1), torch.stack(conf, 1))

    def _stage(self, stage, h, ids, positions, anchors: list[int], rings, k: int) -> torch.Tensor:
        y, post, comb = stage.mhc.pre(h, stage.hc_attn_fn, stage.hc_attn_scale, stage.hc_attn_base)
        h = stage.mhc.post(self._attention(stage.attn, stage.attn_norm(y), positions, anchors, rings, k), h, post, comb)
        y, post, comb = stage.mhc.pre(h, stage.hc_ffn_fn, stage.hc_ffn_scale, stage.hc_ffn_base)
        return stage.mhc.post(stage.ffn(stage.ffn_norm(y), ids), h, post, comb)

    def _attention(self, attn, x: torch.Tensor, positions: torch.Tensor, anchors: list[int], rings: list,
                   k: int) -> torch.Tensor:
        """Each request's k block rows over [its last `window` main keys ending at the anchor's
        position - 1 | its k block keys], non-causal, with the sink in the softmax denominator."""
        T, pw, eps = x.shape[0], attn.pointwise, attn.cfg.rms_norm_eps
        q = pw.norm_rope_quant(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(T, attn.n_heads, attn.head_dim), positions,
                               attn.rope, norm="head", eps=eps)
        kv = self._keys(attn, x, positions)
        out = torch.empty_like(q)
        sink = attn.attn_sink.float()
        for r, (st, anchor) in enumerate(zip(rings, anchors)):      # host positions: no device sync
            rows = slice(r * k, (r + 1) * k)
            ring_pos = torch.arange(max(0, anchor - attn.window), anchor, device=x.device)
            main = st.ring[ring_pos % st.ring.shape[0]]
            if st.ring.dtype == torch.uint8:
                main = unpack_kv_fp8(main, kv.shape[1], ring_rope_dim(st.ring, kv), kv.dtype)
            keys = torch.cat([main.to(kv.dtype), kv[rows]])
            logits = torch.einsum("thd,kd->thk", q[rows].float(), keys.float()) * attn.scale
            both = torch.cat([logits, sink[None, :, None].expand(logits.shape[0], -1, 1)], dim=-1)
            probs = torch.softmax(both, dim=-1)[..., :-1]
            out[rows] = torch.einsum("thk,kd->thd", probs.to(keys.dtype), keys).to(q.dtype)
        o = pw.inverse_rope(out, positions, attn.rope)
        z = attn.wo_a.method.apply_grouped(attn.wo_a, o.reshape(T, attn.cfg.o_groups, -1))
        return attn.wo_b(z.flatten(1))
