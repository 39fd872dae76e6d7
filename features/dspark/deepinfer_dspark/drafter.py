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

The drafter is portable PyTorch and eager (every request's block in one batched attention; the
target's steps replay the runner's CUDA graphs, which return the features). Its pieces
(`stage_keys`, `block_hidden`, `draft_heads`) are what tools/train_tiny/dspark.py trains through.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
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
        # fp32 copies made once (at V4 size markov_w2 is 129,280 x 256: converting it per step would
        # move 132 MB per step); the same tensors when the model runs in float32
        last = model.mtp[-1]
        self.markov_w2 = last.markov_head.markov_w2.float()
        self.confidence_proj = last.confidence_head.proj.float()

    def observe(self, batch: ForwardBatch, target: ModelOutput) -> None:
        """Write every stage's key of every row of a target forward into that stage's ring."""
        main_h = main_features(self.stages, target.features)
        for i, stage in enumerate(self.stages):
            kv = stage_keys(stage.attn, main_h, batch.positions)
            for sl, start, st in zip(batch.seq_slices(), batch.starts, batch.states):
                PortableAttentionBackend.write_ring(st.mtp_layers[i], kv[sl], start)

    def propose(self, anchors: torch.Tensor, anchor_positions: list[int], states: list, params: Sequence[Any],
                seeds: Sequence[int]) -> Drafts:
        """gamma drafts per request after its anchor (the token at `anchor_positions[i]`)."""
        n, k, dev = anchors.shape[0], self.num_drafts, anchors.device
        ids = torch.full((n, k), self.noise, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        ids = ids.flatten()
        positions = torch.tensor([p + j for p in anchor_positions for j in range(k)], dtype=torch.long, device=dev)
        model = self.model

        slots = [st.slot for st in states]

        def contexts(i: int, attn) -> tuple[torch.Tensor, torch.Tensor]:
            return ring_context([st.mtp_layers[i] for st in states], slots, anchor_positions, attn.window,
                                attn.head_dim)

        hidden = block_hidden(model, ids, positions, contexts, k)                           # [n*k, D]
        last = self.stages[-1]
        base = model.lm_head(last.norm(hidden)).view(n, k, -1)
        hidden = hidden.view(n, k, -1)
        greedy = all(p.temperature < 1e-5 for p in params)
        prev, drafted, dists, zs = anchors, [], [], []
        for j in range(k):
            logits, z = draft_heads(model, hidden[:, j], base[:, j], prev, self.markov_w2, self.confidence_proj)
            zs.append(z)
            tok, q = draw(logits, params, [p + 1 + j for p in anchor_positions], seeds, greedy)
            drafted.append(tok)
            dists.append(q)
            prev = tok
        z = torch.stack(zs, 1)
        temps = torch.tensor(self.temperatures, device=dev)
        conf = torch.sigmoid((z / temps).clamp(-60.0, 60.0))
        return Drafts(torch.stack(drafted, 1), None if greedy else torch.stack(dists, 1), conf)


def ring_context(layers: list, slots: list[int], anchors: list[int], window: int,
                 dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's last `window` main keys ending at its anchor's position - 1, read from its
    stage ring (`layers`: the requests' LayerStates of one stage), as ([N, window, dim], valid
    [N, window]). States of one cache (the engine's) are read in one gather from the pool, with
    positions from the host (no device sync); others (standalone states) one by one."""
    ring = layers[0].ring
    dev, size = ring.device, ring.shape[0]
    first = [max(0, anchor - window) for anchor in anchors]
    offsets = torch.tensor(first, device=dev)[:, None] + torch.arange(window, device=dev)[None, :]
    pool = layers[0].pools.ring if layers[0].pools is not None else None
    if pool is not None and min(slots) >= 0 and all(layer.pools is not None and layer.pools.ring is pool
                                                    for layer in layers):
        packed = pool[torch.tensor(slots, device=dev)[:, None], offsets % size]
    else:
        packed = torch.stack([layer.ring[row % size] for layer, row in zip(layers, offsets)])
    if packed.dtype == torch.uint8:
        packed = unpack_kv_fp8(packed, dim, ring_rope_dim(ring, packed.new_empty(1, dim)), torch.float32)
    counts = torch.tensor([min(anchor, window) for anchor in anchors], device=dev)
    valid = torch.arange(window, device=dev)[None, :] < counts[:, None]
    # rows past anchor - 1 may be never-written ring memory (NaN bytes): zero them, 0 x NaN is NaN
    return packed.masked_fill(~valid[..., None], 0.0), valid


def stage_keys(attn, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A stage's key (= value) rows for inputs `x` at `positions`: RoPE(kv_norm(wkv(x))), FP8-rounded
    like a main key under QAT. Main rows inject `main_h` this way; block rows their own states."""
    return attn.pointwise.norm_rope_quant(
        attn.wkv(x), positions, attn.rope, norm="weighted", weight=attn.kv_norm.weight, eps=attn.cfg.rms_norm_eps,
        quant="fp8_nope" if attn.numerics.simulate_qat else "none", nope_dim=attn.nope_dim)


def main_features(stages, features: torch.Tensor) -> torch.Tensor:
    """main_h = main_norm(main_proj(features)): one row per target token."""
    return stages[0].main_norm(stages[0].main_proj(features))


def block_attention(attn, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                    context_valid: torch.Tensor, k: int) -> torch.Tensor:
    """N blocks of k rows (x [N*k, D]); each block's rows attend, non-causally and with the stage's
    sink in the softmax denominator, to its context keys (context [N, W, d], context_valid [N, W]:
    the main keys ending at the anchor's position - 1) and to its own k block keys."""
    T, pw, eps = x.shape[0], attn.pointwise, attn.cfg.rms_norm_eps
    n = T // k
    q = pw.norm_rope_quant(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(T, attn.n_heads, attn.head_dim), positions,
                           attn.rope, norm="head", eps=eps)
    kv = stage_keys(attn, x, positions)
    keys = torch.cat([context.to(kv.dtype), kv.view(n, k, -1)], 1)                          # [N, W + k, d]
    logits = torch.einsum("nthd,nsd->nths", q.view(n, k, attn.n_heads, -1).float(), keys.float()) * attn.scale
    valid = torch.cat([context_valid, context_valid.new_ones(n, k)], 1)
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    sink = attn.attn_sink.float()[None, None, :, None].expand(n, k, -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], -1), dim=-1)[..., :-1]
    out = torch.einsum("nths,nsd->nthd", probs.to(keys.dtype), keys).reshape(T, attn.n_heads, -1).to(q.dtype)
    o = pw.inverse_rope(out, positions, attn.rope)
    z = attn.wo_a.method.apply_grouped(attn.wo_a, o.reshape(T, attn.cfg.o_groups, -1))
    return attn.wo_b(z.flatten(1))


def block_hidden(model: DeepseekV4Model, ids: torch.Tensor, positions: torch.Tensor,
                 contexts: Callable[[int, Any], tuple[torch.Tensor, torch.Tensor]], k: int) -> torch.Tensor:
    """The parallel stage: blocks of k ids (flat [N*k]) through every stage, `contexts(i, attn)`
    giving stage i's (context keys, valid) for `block_attention`; returns the collapsed, pre-norm
    hidden h_k [N*k, D] of the last stage."""
    h = model.embed_tokens(ids)[:, None, :].expand(-1, model.cfg.hc_mult, -1).contiguous()
    for i, stage in enumerate(model.mtp):
        y, post, comb = stage.mhc.pre(h, stage.hc_attn_fn, stage.hc_attn_scale, stage.hc_attn_base)
        attn = stage.attn
        h = stage.mhc.post(block_attention(attn, stage.attn_norm(y), positions, *contexts(i, attn), k), h, post, comb)
        y, post, comb = stage.mhc.pre(h, stage.hc_ffn_fn, stage.hc_ffn_scale, stage.hc_ffn_base)
        h = stage.mhc.post(stage.ffn(stage.ffn_norm(y), ids), h, post, comb)
    last = model.mtp[-1]
    return last.mhc.head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base)


def draft_heads(model: DeepseekV4Model, hidden: torch.Tensor, base: torch.Tensor, prev: torch.Tensor,
                markov_w2: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position k's logits `U_k + markov_w1[prev] @ markov_w2^T` and confidence logit
    `proj . [h_k ; markov_w1[prev]]` (pre-temperature), in fp32; markov_w2, proj: the last stage's,
    already fp32 (the caller converts them once per step, not once per position)."""
    e = model.mtp[-1].markov_head.markov_w1[prev].float()
    return base.float() + e @ markov_w2.T, (torch.cat([hidden.float(), e], -1) @ proj.T).squeeze(-1)
