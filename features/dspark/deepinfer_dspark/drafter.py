"""The DSpark drafter, the `deepinfer_proposer` of this feature plugin: a parallel block forward over `[anchor, noise x (gamma-1)]`
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

The drafter is portable PyTorch (every request's block in one batched attention). On a GPU with the
runner's CUDA graphs the target's steps replay those (they return the features), `observe` writes
every row's keys with one scatter per stage (observe steps of q rows per sequence replay a graph),
and drafting replays a graph per batch bucket (graphs.py): of the whole block forward and
Markov/confidence loop for greedy drafts, of the block forward alone for sampled ones. Its
pieces (`stage_keys`, `block_hidden`, `draft_heads`) are what tools/train_tiny/dspark.py trains
through.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer_core.model.deepseek_v4 import DeepseekV4Model, ModelOutput
from deepinfer_core.model.forward_batch import ForwardBatch
from deepinfer_core.ops.kv_fp8 import pack_kv_fp8, unpack_kv_fp8
from deepinfer_core.ops.portable_attention import (
    PortableAttentionBackend,
    ring_rope_dim,
)
from deepinfer_core.ops.transfer import to_device
from deepinfer_core.speculative.mtp import Drafts, draw

from .graphs import ObserveGraphs, ProposeGraphs


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
        self.graphs: ProposeGraphs | None = None
        self.observe_graphs: ObserveGraphs | None = None
        self._observe_settings: tuple[int, int, bool] | None = None

    def use_graphs(self, max_seqs: int, pad_slot: int | None = None, capture: bool = True) -> None:
        """Replay CUDA graphs for greedy drafts of up to `max_seqs` requests and, given `pad_slot` (a
        slot no sequence owns: the cache's spare), for observing steps of q <= gamma + 1 rows per
        sequence (the runner calls this when its own steps replay graphs; `capture=False`: the same
        padded fixed-shape batches, run eagerly, for tests without a GPU)."""
        self.graphs = ProposeGraphs({"draft": self._graph_draft, "block": self._graph_hidden}, max_seqs,
                                    self.markov_w2.device, capture)
        self.observe_graphs = None
        self._observe_settings = None if pad_slot is None else (max_seqs, pad_slot, capture)

    def observe(self, batch: ForwardBatch, target: ModelOutput) -> None:
        """Write every stage's key of every row of a target forward into that stage's ring: a graph
        replay for a step of q rows per sequence, else one scatter per stage into the pool when
        every state lives in the engine's cache (a chunk longer than the ring keeps its last
        ring-size rows), else sequence by sequence."""
        states = batch.states
        if not _one_pool(states):
            main_h = main_features(self.stages, target.features)
            for i, stage in enumerate(self.stages):
                kv = stage_keys(stage.attn, main_h, batch.positions)
                for sl, start, st in zip(batch.seq_slices(), batch.starts, states):
                    PortableAttentionBackend.write_ring(st.mtp_layers[i], kv[sl], start)
            return
        pools = tuple(layer.pools.ring for layer in states[0].mtp_layers)
        slots = [st.slot for st in states]
        lens = batch.lens
        if self._observe_settings is not None and all(n == lens[0] for n in lens):
            if self.observe_graphs is None:
                max_seqs, pad_slot, capture = self._observe_settings
                self.observe_graphs = ObserveGraphs(self._write_keys, max_seqs, self.num_drafts + 1,
                                                    target.features, pad_slot, capture)
            if self.observe_graphs.run(target.features, list(batch.starts), slots, lens[0], pools):
                return
        size, dev = pools[0].shape[1], target.features.device
        rows, row_slots = [], []
        for sl, slot in zip(batch.seq_slices(), slots):
            keep = range(max(sl.start, sl.stop - size), sl.stop)
            rows.extend(keep)
            row_slots.extend([slot] * len(keep))
        features, positions = target.features, batch.positions
        if len(rows) < features.shape[0]:
            rows_t = to_device(rows, torch.long, dev)
            features, positions = features.index_select(0, rows_t), positions.index_select(0, rows_t)
        self._write_keys(features, positions, to_device(row_slots, torch.long, dev), pools)

    def _write_keys(self, features: torch.Tensor, positions: torch.Tensor, row_slots: torch.Tensor,
                    pools: tuple[torch.Tensor, ...]) -> None:
        """Each stage's key of every row, scattered into its ring pool at (slot, position % ring)
        (what the observe graphs record; rows of one slot have distinct positions within a ring)."""
        main_h = main_features(self.stages, features)
        for stage, ring in zip(self.stages, pools):
            kv = stage_keys(stage.attn, main_h, positions)
            packed = pack_kv_fp8(kv, ring_rope_dim(ring, kv)) if ring.dtype == torch.uint8 else kv.to(ring.dtype)
            ring[row_slots, positions % ring.shape[1]] = packed

    def propose(self, anchors: torch.Tensor, anchor_positions: list[int], states: list, params: Sequence[Any],
                seeds: Sequence[int]) -> Drafts:
        """gamma drafts per request after its anchor (the token at `anchor_positions[i]`): greedy
        batches replay a graph of the whole draft; sampled ones replay a graph of the block forward
        and draw left to right eagerly (their uniforms are keyed by host seeds and positions)."""
        greedy = all(p.temperature < 1e-5 for p in params)
        slots, n, dev = [st.slot for st in states], anchors.shape[0], anchors.device

        def pick(j: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return draw(logits, params, [p + 1 + j for p in anchor_positions], seeds, greedy)

        pools = tuple(layer.pools.ring for layer in states[0].mtp_layers) if _one_pool(states) else None
        out = None
        if self.graphs is not None and pools is not None:
            out = self.graphs.run("draft" if greedy else "block", anchors, anchor_positions, slots, pools)
        if out is not None and greedy:
            return Drafts(out[0][:n], None, self._confidence(out[1][:n]))
        if out is not None:
            hidden = out[:n * self.num_drafts]
        elif pools is not None:        # the engine's cache: every stage's context in one gather
            hidden = self._graph_hidden(anchors, to_device(anchor_positions, torch.long, dev),
                                        to_device(slots, torch.long, dev), pools)
        else:
            def contexts(i: int, attn) -> tuple[torch.Tensor, torch.Tensor]:
                return ring_context([st.mtp_layers[i] for st in states], anchor_positions, attn.window, attn.head_dim)
            hidden = self._hidden(anchors, to_device(anchor_positions, torch.long, dev), contexts)
        drafted, dists, z = self._heads(hidden, anchors, pick)
        return Drafts(drafted, None if greedy else torch.stack(dists, 1), self._confidence(z))

    def _confidence(self, z: torch.Tensor) -> torch.Tensor:
        temps = torch.tensor(self.temperatures, device=z.device)
        return torch.sigmoid((z / temps).clamp(-60.0, 60.0))

    def _hidden(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, contexts) -> torch.Tensor:
        """The block forward over [anchor, noise x (gamma-1)] at anchor_positions + 0..gamma-1:
        the last stage's collapsed hidden [n*gamma, D]."""
        n, k = anchors.shape[0], self.num_drafts
        ids = torch.full((n, k), self.noise, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        positions = (anchor_positions[:, None] + torch.arange(k, device=anchors.device)[None, :]).flatten()
        return block_hidden(self.model, ids.flatten(), positions, contexts, k)

    def _heads(self, hidden: torch.Tensor, anchors: torch.Tensor, pick):
        """The heads left to right, `pick(j, logits)` drawing draft j: (drafts [n, gamma], their
        distributions (a list, None entries when greedy), confidence logits [n, gamma])."""
        n, k, model = anchors.shape[0], self.num_drafts, self.model
        base = model.lm_head(self.stages[-1].norm(hidden)).view(n, k, -1)
        hidden = hidden.view(n, k, -1)
        prev, drafted, dists, zs = anchors, [], [], []
        for j in range(k):
            logits, z = draft_heads(model, hidden[:, j], base[:, j], prev, self.markov_w2, self.confidence_proj)
            zs.append(z)
            prev, q = pick(j, logits)
            drafted.append(prev)
            dists.append(q)
        return torch.stack(drafted, 1), dists, torch.stack(zs, 1)

    def _graph_hidden(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, slots: torch.Tensor,
                      pools: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The block forward of requests in the engine's cache, every input on the device (the
        contexts gathered from the stage ring pools): what the "block" graphs record (sampled
        drafts), and the eager path for those requests."""

        def contexts(i: int, attn) -> tuple[torch.Tensor, torch.Tensor]:
            return pool_context(pools[i], slots, anchor_positions, attn.window, attn.head_dim)

        return self._hidden(anchors, anchor_positions, contexts)

    def _graph_draft(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, slots: torch.Tensor,
                     pools: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """What the "draft" graphs record (greedy drafts): the block forward and the heads."""
        hidden = self._graph_hidden(anchors, anchor_positions, slots, pools)
        drafted, _, z = self._heads(hidden, anchors, lambda j, logits: (logits.argmax(-1), None))
        return drafted, z


def _one_pool(states: list) -> bool:
    """Whether every state lives in one cache (the engine's), so contexts are one gather per stage."""
    pools = [st.mtp_layers[0].pools for st in states]
    return pools[0] is not None and all(p is pools[0] for p in pools) and min(st.slot for st in states) >= 0


def pool_context(pool: torch.Tensor, slots: torch.Tensor, anchors: torch.Tensor, window: int,
                 dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ring_context` for states of one cache, from device tensors: one gather from the stage's
    ring pool [num_slots, ring_len, row] (no host value, so a CUDA graph can record it)."""
    first = (anchors - window).clamp_min(0)
    offsets = first[:, None] + torch.arange(window, device=pool.device)[None, :]
    packed = pool[slots[:, None], offsets % pool.shape[1]]
    return _context(packed, pool, anchors.clamp_max(window), window, dim)


def ring_context(layers: list, anchors: list[int], window: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's last `window` main keys ending at its anchor's position - 1, read from its
    own stage ring (`layers`: the requests' LayerStates of one stage; standalone states, one by one:
    states of the engine's cache use `pool_context`), as ([N, window, dim], valid [N, window])."""
    ring = layers[0].ring
    dev, size = ring.device, ring.shape[0]
    first = [max(0, anchor - window) for anchor in anchors]
    offsets = to_device(first, torch.long, dev)[:, None] + torch.arange(window, device=dev)[None, :]
    packed = torch.stack([layer.ring[row % size] for layer, row in zip(layers, offsets)])
    counts = to_device([min(anchor, window) for anchor in anchors], torch.long, dev)
    return _context(packed, ring, counts, window, dim)


def _context(packed: torch.Tensor, ring: torch.Tensor, counts: torch.Tensor, window: int,
             dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked context keys and their validity (the first counts[i] rows of request i)."""
    if packed.dtype == torch.uint8:
        packed = unpack_kv_fp8(packed, dim, ring_rope_dim(ring, packed.new_empty(1, dim)), torch.float32)
    valid = torch.arange(window, device=packed.device)[None, :] < counts[:, None]
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
                           attn.rope, norm="head" if attn.cfg.use_q_head_norm else "none", eps=eps)
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
    shifted = model.cfg.hc_shifted          # V4.1: each sub-layer collapses with the previous pre
    pre = torch.zeros(h.shape[:2], dtype=torch.float32, device=h.device) if shifted else None
    if shifted:
        pre[:, 0] = 1.0
    for i, stage in enumerate(model.mtp):
        attn = stage.attn
        if shifted:
            y, pre, post, comb = stage.mhc.pre_shifted(h, pre, stage.hc_attn_fn, stage.hc_attn_scale,
                                                       stage.hc_attn_base)
        else:
            y, post, comb = stage.mhc.pre(h, stage.hc_attn_fn, stage.hc_attn_scale, stage.hc_attn_base)
        h = stage.mhc.post(block_attention(attn, stage.attn_norm(y), positions, *contexts(i, attn), k), h, post, comb)
        if shifted:
            y, pre, post, comb = stage.mhc.pre_shifted(h, pre, stage.hc_ffn_fn, stage.hc_ffn_scale,
                                                       stage.hc_ffn_base)
        else:
            y, post, comb = stage.mhc.pre(h, stage.hc_ffn_fn, stage.hc_ffn_scale, stage.hc_ffn_base)
        h = stage.mhc.post(stage.ffn(stage.ffn_norm(y), ids), h, post, comb)
    last = model.mtp[-1]
    if shifted:
        return last.mhc.collapse(h, pre)
    return last.mhc.head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base)


def draft_heads(model: DeepseekV4Model, hidden: torch.Tensor, base: torch.Tensor, prev: torch.Tensor,
                markov_w2: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position k's logits `U_k + markov_w1[prev] @ markov_w2^T` and confidence logit
    `proj . [h_k ; markov_w1[prev]]` (pre-temperature), in fp32; markov_w2, proj: the last stage's,
    already fp32 (the caller converts them once per step, not once per position)."""
    e = model.mtp[-1].markov_head.markov_w1[prev].float()
    return base.float() + e @ markov_w2.T, (torch.cat([hidden.float(), e], -1) @ proj.T).squeeze(-1)
