"""Roofline arithmetic of one DeepSeek-V4.1 forward step: `roofline`'s rules (weights read once per
step at checkpoint format, state at the cache's dtype, FLOPs by class) applied to V4.1's layers
(spec deepseek_v41.md §3-§11). `roofline.step_roofline` sends a V4.1 config here.

What differs from a V4 layer:

* ratios 0 / 1 / 2: C2 compressors pool pairs of tokens with a gate (fp32 tails of kv + gate per
  token), C1 ones emit one row per token, ungated and without tails; no overlap, no APE;
* cross-layer sharing: only a KV source owns a compressor and writes compressed rows and index keys
  (keys projected from its normalised rows by `indexer.wk`, once per new row); only an index source
  owns an indexer and scores keys; every compressed layer attends its index source's top-k rows,
  read from its KV source's cache; a sharing layer has no compressor or indexer weights;
* two-level candidate blocks: an index source after the candidate source scores only the
  candidate tokens (candidate_topk_blocks x candidate_block_size), the others every visible row;
* Engram layers gather (max_ngram - 1) x n_heads table rows per token (FP8 + one UE8M0 byte per
  32 values), project them with the FP8 `engram.wkv` and read `q_weight` / `k_weight` (bf16);
* no hash-routed layers (every gate has its bias), no hc_head (shifted mHC, `roofline.head_cost`).
"""
from __future__ import annotations

from roofline import (
    Cost,
    LinearSpec,
    Queries,
    _cls,
    _dense_fmt,
    expected_distinct_experts,
    expert_bytes,
    expert_linears,
    linear_bytes,
    sum_floordiv,
    sum_min,
    sum_min_floordiv,
)

ASSUMPTIONS = [
    "DeepSeek-V4.1 layers (benchmarks/roofline_v41.py): only KV sources hold a compressor and "
    "write compressed rows and index keys; only index sources hold an indexer and score keys; "
    "sharing layers hold neither and read their sources' rows",
    "weights counted at checkpoint format: FP8 e4m3 + 1 UE8M0 byte per weight block, FP4 experts "
    "0.5 B + 1 UE8M0 byte per 32, bf16, fp32 (mHC, sinks, gate bias)",
    "each weight is read once per step (per forward chunk); routed experts: expected distinct "
    "experts hit, E*(1-(1-k/E)^tokens) (uniform routing)",
    "embedding: only the step's rows; LM head: the whole bf16 weight (our runtime holds it in "
    "fp32: see roofline 'head_fp32_extra_bytes'); no hc_head (shifted mHC)",
    "state at the cache dtype: every layer's window ring rows; every compressed layer the top-k "
    "rows it attends (min(index_topk, visible rows); C1: one row per token, C2: one per 2 "
    "tokens); index sources the index keys they score (every visible row; candidate consumers at "
    "most candidate_topk_blocks x candidate_block_size); C2 tails fp32 written per token, read "
    "when a block closes (amortised); C1 has no tails; prefill: state written per token, "
    "compressed rows, index keys and (for a later chunk) the earlier window read once per layer",
    "Engram: (max_ngram-1) x n_heads table rows gathered per token and layer (FP8 + 1 UE8M0 byte "
    "per 32), counted at HBM bandwidth although tables in pinned host memory (ops.engram_tables, "
    "the engine's default on CUDA) are read over the host link; the id ring and the hashing are "
    "not counted; bounded replay (yoco_prefill_truncation_mode) off",
    "activations, softmax, norms, RoPE, pooling, top-k and Engram's gate are not counted",
    "FLOP classes: FP8 = linears with FP8/FP4 weights and quantised inputs (Engram's wkv "
    "included) + indexer scores; bf16 = wo_a, compressor, indexer-weight and index-key "
    "projections, gate, mHC mixes, attention, LM head",
    "time floor = max(bytes / peak_bw, fp8_flops / peak_fp8 + bf16_flops / peak_bf16)",
]


def _is_engram(cfg, i: int) -> bool:
    return cfg.engram is not None and i in cfg.engram.layer_ids


def layer_kind(cfg, i: int) -> str:
    """What a layer's step costs depend on: "SWA", or "C<ratio> source" (owns a compressor and
    an indexer), "C<ratio> index" (owns an indexer only), "C<ratio> shared" (neither);
    "+Engram"."""
    r = cfg.layer_ratio(i)
    if not r:
        kind = "SWA"
    elif cfg.kv_source(i) == i:
        kind = f"C{r} source"
    else:
        kind = f"C{r} index" if cfg.index_source(i) == i else f"C{r} shared"
    return kind + ("+Engram" if _is_engram(cfg, i) else "")


def dense_linears(cfg, i: int) -> list[tuple[LinearSpec, float]]:
    """Every non-routed-expert linear of layer `i`, with the rows it runs on per token (1, or
    1/ratio for the index-key projection of new compressed rows)."""
    D, H, Dh, qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    f, r, lo = _dense_fmt(cfg), cfg.layer_ratio(i), cfg.o_groups * cfg.o_lora_rank
    attn = [LinearSpec("attn.wq_a", qr, D, f, _cls(f)),
            LinearSpec("attn.wq_b", H * Dh, qr, f, _cls(f)),
            LinearSpec("attn.wkv", Dh, D, f, _cls(f)),
            LinearSpec("attn.wo_a", lo, H * Dh // cfg.o_groups, f, "bf16"),
            LinearSpec("attn.wo_b", D, lo, f, _cls(f))]
    out = [(s, 1.0) for s in attn]
    source = bool(r) and cfg.kv_source(i) == i
    if source:
        out.append((LinearSpec("attn.compressor.wkv", Dh, D, "bf16", "bf16"), 1.0))
        if r > 1:
            out.append((LinearSpec("attn.compressor.wgate", Dh, D, "bf16", "bf16"), 1.0))
    if r and cfg.index_source(i) == i:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        out += [(LinearSpec("attn.indexer.wq_b", Hi * Di, qr, f, _cls(f)), 1.0),
                (LinearSpec("attn.indexer.weights_proj", Hi, D, "bf16", "bf16"), 1.0)]
        if source:
            out.append((LinearSpec("attn.indexer.wk", Di, Dh, "bf16", "bf16"), 1.0 / r))
    inter = cfg.moe_intermediate_size
    out += [(LinearSpec("ffn.gate", cfg.n_routed_experts, D, "bf16", "bf16"), 1.0),
            (LinearSpec("ffn.shared_experts.w1", inter, D, f, _cls(f)), 1.0),
            (LinearSpec("ffn.shared_experts.w3", inter, D, f, _cls(f)), 1.0),
            (LinearSpec("ffn.shared_experts.w2", D, inter, f, _cls(f)), 1.0)]
    if _is_engram(cfg, i):
        ec = cfg.engram
        width = (ec.max_ngram - 1) * ec.n_heads * ec.head_dim
        out.append((LinearSpec("engram.wkv", (cfg.hc_mult + 1) * D, width, f, _cls(f)), 1.0))
    return out


def block_small_bytes(cfg, i: int) -> dict[str, int]:
    """Non-linear tensors of layer `i`: mHC (fp32), norms (bf16), sinks and gate bias (fp32),
    Engram's q / k weights (bf16)."""
    D, hc, Dh, r = cfg.hidden_size, cfg.hc_mult, cfg.head_dim, cfg.layer_ratio(i)
    n_mix = (2 + hc) * hc
    out = {"mhc": 2 * 4 * (n_mix * hc * D + n_mix + 3),
           "norms": 2 * (2 * D + cfg.q_lora_rank + Dh),       # attn/ffn norm, q_norm, kv_norm
           "other_fp32": 4 * cfg.num_attention_heads + 4 * cfg.n_routed_experts}   # sink, bias
    if r and cfg.kv_source(i) == i:
        out["norms"] += 2 * Dh                                         # compressor.norm
        if cfg.index_source(i) == i:
            out["norms"] += 2 * cfg.index_head_dim                     # indexer.k_norm
    if _is_engram(cfg, i):
        out["engram"] = 2 * 2 * hc * D                                 # q_weight, k_weight
    return out


def candidate_tokens(cfg, i: int) -> int | None:
    """The compressed rows a candidate consumer scores (None: every visible row)."""
    topo = cfg.topology
    if topo is not None and topo.candidate_consumer(i):
        return topo.candidate_topk_blocks * topo.candidate_block_size
    return None


def attention_pairs(cfg, i: int, q: Queries) -> dict[str, int]:
    """(query, key) pairs of layer `i`: window keys, compressed rows attended (top-k), rows the
    indexer scores (index sources only)."""
    W, r = cfg.sliding_window, cfg.layer_ratio(i)
    out = {"window": q.over(lambda n: sum_min(n, W)), "compressed": 0, "indexed": 0}
    if r:
        out["compressed"] = q.over(lambda n: sum_min_floordiv(n, r, cfg.index_topk))
        if cfg.index_source(i) == i:
            cap = candidate_tokens(cfg, i)
            out["indexed"] = q.over(lambda n: sum_floordiv(n, r) if cap is None
                                    else sum_min_floordiv(n, r, cap))
    return out


def _category(s: LinearSpec) -> str:
    if s.name == "ffn.gate":
        return "gate"
    if "shared" in s.name:
        return "shared_expert"
    if s.name.startswith("engram."):
        return "engram"
    return "compressor_bf16" if s.fmt == "bf16" else "attn_fp8"


def block_cost(cfg, i: int, q: Queries, cache_elem: float, decode: bool) -> Cost:
    """Bytes and FLOPs of layer `i` for the step's queries (`roofline.block_cost`'s conventions)."""
    c = Cost()
    T, D, Dh, Di = q.tokens, cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    r = cfg.layer_ratio(i)
    for s, per_token in dense_linears(cfg, i):
        c.add_bytes(_category(s), linear_bytes(s.out_f, s.in_f, s.fmt, cfg.weight_block_size))
        c.add_flops(s.flop_class, 2 * s.params * T * per_token)
    for k, v in block_small_bytes(cfg, i).items():
        c.add_bytes(k, v)
    hit = expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, T)
    c.add_bytes("routed_experts", hit * expert_bytes(cfg))
    for s in expert_linears(cfg):
        c.add_flops(s.flop_class, 2 * s.params * T * cfg.num_experts_per_tok)
    hc, n_mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    c.add_flops("bf16", 2 * 2 * n_mix * hc * D * T)                      # mHC mixes (attn, ffn)
    if _is_engram(cfg, i):
        ec = cfg.engram
        rows = T * (ec.max_ngram - 1) * ec.n_heads
        c.add_bytes("engram_gather", rows * (ec.head_dim + ec.head_dim // 32))

    pairs = attention_pairs(cfg, i, q)
    keys = pairs["window"] + pairs["compressed"]
    c.add_flops("bf16", 4 * cfg.num_attention_heads * Dh * keys)
    c.add_flops("fp8", 2 * cfg.index_n_heads * Di * pairs["indexed"])

    c.add_bytes("state_write", T * Dh * cache_elem)                      # the ring row
    if decode:
        c.add_bytes("state_read", (pairs["window"] - T) * Dh * cache_elem)
        c.add_bytes("state_read", pairs["compressed"] * Dh * cache_elem)
        c.add_bytes("state_read", pairs["indexed"] * Di * cache_elem)
    else:
        visible = q.seqs * (q.start + q.count) // r if r else 0   # rows of this + earlier chunks
        if q.start:
            earlier = q.seqs * min(q.start, cfg.sliding_window)
            c.add_bytes("state_read", earlier * Dh * cache_elem)
        c.add_bytes("state_read", visible * Dh * cache_elem)
        if pairs["indexed"]:
            c.add_bytes("state_read", visible * Di * cache_elem)
    if r and cfg.kv_source(i) == i:
        c.add_bytes("state_write", T / r * (Dh + Di) * cache_elem)   # compressed rows, index keys
        if r > 1:
            c.add_bytes("state_write", T * Dh * 4 * 2)             # tails: kv + gate, fp32
            if decode:                                             # pooled when a block closes
                c.add_bytes("state_read", T * Dh * 4 * 2)         # (amortised per token)
    return c
