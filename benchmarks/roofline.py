"""Roofline arithmetic of one DeepSeek-V4 forward step: the bytes it must move and the FLOPs it must do.
A DeepSeek-V4.1 config's layers are costed by `roofline_v41` (its own rules and ASSUMPTIONS).

Pure arithmetic over a `ModelConfig` (no torch, no GPU), so it can be checked by hand and against the
model's own buffers. A step's time floor is max(bytes / HBM bandwidth, sum over FLOP classes of
flops / that class's peak). What counts (stated again in the sweep's JSON, `ASSUMPTIONS`):

* weights at their checkpoint format (FP8 e4m3 + one UE8M0 byte per 128x128 block, bf16, fp32 mHC),
  each read once per step; routed experts only as many distinct ones as the step's tokens hit
  (expected value E * (1 - (1 - k/E)^tokens) for uniform routing); the embedding reads only the rows
  of the step's tokens; the LM head reads its whole bf16 weight;
* state at the cache's dtype: per query the window ring rows, the CSA indexer keys of every visible
  compressed row plus the top-k selected rows, every visible HCA row; compressor tails (fp32) written
  per token and read when a block closes (amortised per token); new ring rows and compressed rows
  written;
* FLOPs: 2 x params x tokens for every linear (FP8 class when the weight is FP8/FP4 and the input is
  quantised, bf16 class otherwise), 4 x heads x head_dim per (query, key) for attention (bf16 class),
  2 x index_heads x index_head_dim per (query, visible row) for the indexer (FP8 class: FP4 in V4,
  FP8 on Hopper), mHC mixes (bf16 class); activations, softmaxes, norms and pooling are not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

ASSUMPTIONS = [
    "weights counted at checkpoint format: FP8 e4m3 + 1 UE8M0 byte per 128x128 block, bf16, fp32 (mHC, ape, sinks)",
    "each weight is read once per step (per forward chunk); routed experts: expected distinct experts hit, "
    "E*(1-(1-k/E)^tokens) (uniform routing), the same formula for hash-routed layers",
    "embedding: only the step's rows; LM head: the whole bf16 weight (our runtime holds it in fp32: "
    "see roofline 'head_fp32_extra_bytes')",
    "state at the cache dtype: window ring rows, CSA indexer keys of all visible rows + top-k selected rows, "
    "all visible HCA rows; compressor tails fp32 written per token, read when a block closes (amortised per token); "
    "prefill: state written per token, compressed rows (and a later chunk's earlier window) read once",
    "activations, softmax, norms, RoPE, pooling and top-k are not counted in bytes or FLOPs",
    "FLOP classes: FP8 = linears with FP8/FP4 weights and quantised inputs + indexer scores; bf16 = wo_a, "
    "compressor and indexer-weight projections, gate, mHC mixes, attention, LM head",
    "time floor = max(bytes / peak_bw, fp8_flops / peak_fp8 + bf16_flops / peak_bf16)",
]


@dataclass(frozen=True)
class Peaks:
    bw: float = 4.8e12          # H200 HBM3e bytes/s
    bf16: float = 790e12        # dense bf16 FLOP/s (measured-class figure, not the 989 datasheet)
    fp8: float = 1580e12        # dense FP8 FLOP/s (2 x bf16)

    @classmethod
    def for_device(cls, name: str) -> "Peaks":
        """The H200's figures, with the HBM bandwidth of the part `name` (torch's device name) names:
        the H100 SXM (HBM3) has the same tensor cores and 3.35 TB/s, the H100 NVL 3.9 TB/s, the H100
        PCIe 2.0 TB/s and 756/989 of the SXM's clocks. Other names keep the H200's."""
        if "H100" not in name:
            return cls()
        if "PCIe" in name:
            scale = 756 / 989
            return cls(2.0e12, cls.bf16 * scale, cls.fp8 * scale)
        return cls(3.9e12 if "NVL" in name else 3.35e12)


@dataclass
class Cost:
    """Bytes by category and FLOPs by class ("fp8" | "bf16") of some piece of a step."""

    bytes: dict[str, float] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)

    def add_bytes(self, cat: str, n: float) -> None:
        self.bytes[cat] = self.bytes.get(cat, 0.0) + n

    def add_flops(self, cls: str, n: float) -> None:
        self.flops[cls] = self.flops.get(cls, 0.0) + n

    def __iadd__(self, other: "Cost") -> "Cost":
        for k, v in other.bytes.items():
            self.add_bytes(k, v)
        for k, v in other.flops.items():
            self.add_flops(k, v)
        return self

    def scaled(self, f: float) -> "Cost":
        return Cost({k: v * f for k, v in self.bytes.items()}, {k: v * f for k, v in self.flops.items()})

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def t_memory(self, p: Peaks) -> float:
        return self.total_bytes / p.bw

    def t_compute(self, p: Peaks) -> float:
        return self.flops.get("fp8", 0.0) / p.fp8 + self.flops.get("bf16", 0.0) / p.bf16

    def t_floor(self, p: Peaks) -> float:
        return max(self.t_memory(p), self.t_compute(p))

    def to_dict(self, p: Peaks) -> dict:
        return {"bytes": dict(self.bytes), "flops": dict(self.flops), "total_bytes": self.total_bytes,
                "total_flops": self.total_flops, "t_memory_ms": 1e3 * self.t_memory(p),
                "t_compute_ms": 1e3 * self.t_compute(p), "t_floor_ms": 1e3 * self.t_floor(p),
                "bound": "memory" if self.t_memory(p) >= self.t_compute(p) else "compute"}


# ---- weights -----------------------------------------------------------------------------------

def linear_bytes(out_f: int, in_f: int, fmt: str, block: tuple[int, int] | None) -> int:
    """Checkpoint bytes of one linear: fp8 = e4m3 + UE8M0 per block; fp4 = packed e2m1 + UE8M0 per 32."""
    if fmt == "fp8":
        bo, bi = block or (128, 128)
        return out_f * in_f + math.ceil(out_f / bo) * math.ceil(in_f / bi)
    if fmt == "fp4":
        return out_f * in_f // 2 + out_f * in_f // 32
    if fmt == "bf16":
        return 2 * out_f * in_f
    raise ValueError(f"linear_bytes: fmt={fmt!r}; allowed: fp8, fp4, bf16")


@dataclass(frozen=True)
class LinearSpec:
    name: str
    out_f: int
    in_f: int
    fmt: str          # checkpoint storage: fp8 | fp4 | bf16
    flop_class: str   # fp8 | bf16

    @property
    def params(self) -> int:
        return self.out_f * self.in_f


def _dense_fmt(cfg) -> str:
    return "fp8" if cfg.fp8_weights else "bf16"


def _expert_fmt(cfg) -> str:
    return cfg.expert_dtype if cfg.fp8_weights else "bf16"


def _cls(fmt: str, act_quant: bool = True) -> str:
    return "fp8" if fmt in ("fp8", "fp4") and act_quant else "bf16"


def dense_linears(cfg, ratio: int) -> list[LinearSpec]:
    """Every non-routed-expert linear of one block (attention, compressors, indexer, gate, shared expert)."""
    D, H, Dh, qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    f = _dense_fmt(cfg)
    out = [LinearSpec("attn.wq_a", qr, D, f, _cls(f)), LinearSpec("attn.wq_b", H * Dh, qr, f, _cls(f)),
           LinearSpec("attn.wkv", Dh, D, f, _cls(f)),
           # wo_a: bf16 product in the reference (no activation quantisation)
           LinearSpec("attn.wo_a", cfg.o_groups * cfg.o_lora_rank, H * Dh // cfg.o_groups, f, "bf16"),
           LinearSpec("attn.wo_b", D, cfg.o_groups * cfg.o_lora_rank, f, _cls(f))]
    if ratio:
        w = (2 if ratio == 4 else 1) * Dh
        out += [LinearSpec("attn.compressor.wkv", w, D, "bf16", "bf16"),
                LinearSpec("attn.compressor.wgate", w, D, "bf16", "bf16")]
    if ratio == 4:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        out += [LinearSpec("attn.indexer.wq_b", Hi * Di, qr, f, _cls(f)),
                LinearSpec("attn.indexer.weights_proj", Hi, D, "bf16", "bf16"),
                LinearSpec("attn.indexer.compressor.wkv", 2 * Di, D, "bf16", "bf16"),
                LinearSpec("attn.indexer.compressor.wgate", 2 * Di, D, "bf16", "bf16")]
    I = cfg.moe_intermediate_size
    out += [LinearSpec("ffn.gate", cfg.n_routed_experts, D, "bf16", "bf16"),
            LinearSpec("ffn.shared_experts.w1", I, D, f, _cls(f)),
            LinearSpec("ffn.shared_experts.w3", I, D, f, _cls(f)),
            LinearSpec("ffn.shared_experts.w2", D, I, f, _cls(f))]
    return out


def expert_linears(cfg) -> list[LinearSpec]:
    D, I, f = cfg.hidden_size, cfg.moe_intermediate_size, _expert_fmt(cfg)
    return [LinearSpec("w1", I, D, f, _cls(f)), LinearSpec("w3", I, D, f, _cls(f)), LinearSpec("w2", D, I, f, _cls(f))]


def expert_bytes(cfg) -> int:
    return sum(linear_bytes(s.out_f, s.in_f, s.fmt, cfg.weight_block_size) for s in expert_linears(cfg))


def block_small_bytes(cfg, ratio: int, hash_routed: bool) -> dict[str, int]:
    """Non-linear tensors of one block: mHC (fp32), norms (bf16), sinks/ape/bias (fp32); tid2eid is
    read per token (counted with the tokens, not here)."""
    D, hc, Dh = cfg.hidden_size, cfg.hc_mult, cfg.head_dim
    n_mix = (2 + hc) * hc
    mhc = 2 * 4 * (n_mix * hc * D + n_mix + 3)
    norms = 2 * (2 * D + cfg.q_lora_rank + Dh)                      # attn/ffn norm, q_norm, kv_norm
    other = 4 * cfg.num_attention_heads                             # attn_sink
    if ratio:
        norms += 2 * Dh
        other += 4 * ratio * (2 if ratio == 4 else 1) * Dh           # ape
    if ratio == 4:
        norms += 2 * cfg.index_head_dim
        other += 4 * 4 * 2 * cfg.index_head_dim
    if not hash_routed:
        other += 4 * cfg.n_routed_experts                           # gate.bias
    return {"mhc": mhc, "norms": norms, "other_fp32": other}


def expected_distinct_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected number of distinct experts hit when each of `tokens` tokens picks k distinct experts
    uniformly at random: E * (1 - (1 - k/E)^tokens)."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


# ---- sums over query positions (closed forms; u = t + 1 runs over 1..n) -------------------------

def sum_min(n: int, cap: int) -> int:
    """sum_{u=1}^{n} min(u, cap)."""
    if n <= 0:
        return 0
    if n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def sum_floordiv(n: int, r: int) -> int:
    """sum_{u=1}^{n} floor(u / r)."""
    if n <= 0:
        return 0
    q, rem = divmod(n, r)
    return r * (q - 1) * q // 2 + q * (rem + 1)


def sum_min_floordiv(n: int, r: int, cap: int) -> int:
    """sum_{u=1}^{n} min(cap, floor(u / r))."""
    if n // r <= cap:
        return sum_floordiv(n, r)
    u0 = cap * r                       # first u with floor(u / r) = cap
    return sum_floordiv(u0 - 1, r) + cap * (n - u0 + 1)


@dataclass(frozen=True)
class Queries:
    """`count` query tokens at positions start..start+count-1 of each of `seqs` sequences."""

    seqs: int
    start: int
    count: int

    def over(self, fn) -> int:
        """seqs x sum over the positions t of fn-prefix-sum, i.e. F(start+count) - F(start)."""
        return self.seqs * (fn(self.start + self.count) - fn(self.start))

    @property
    def tokens(self) -> int:
        return self.seqs * self.count


def attention_pairs(cfg, ratio: int, q: Queries) -> dict[str, int]:
    """(query, key) pairs of the step: window keys, compressed rows attended, rows the indexer scores."""
    W = cfg.sliding_window
    out = {"window": q.over(lambda n: sum_min(n, W)), "compressed": 0, "indexed": 0}
    if ratio == 4:
        out["compressed"] = q.over(lambda n: sum_min_floordiv(n, 4, cfg.index_topk))
        out["indexed"] = q.over(lambda n: sum_floordiv(n, 4))
    elif ratio:
        out["compressed"] = q.over(lambda n: sum_floordiv(n, ratio))
    return out


# ---- one block, one step -----------------------------------------------------------------------

def block_cost(cfg, ratio: int, hash_routed: bool, q: Queries, cache_elem: int, decode: bool) -> Cost:
    """Bytes and FLOPs of one block for the step's queries. `decode`: every query reads its visible
    state from the cache (written by earlier steps). Prefill (`decode` False): keys come from the chunk
    itself; the state is counted as written per token, the compressed rows and (for a later chunk)
    the earlier window read once."""
    c = Cost()
    T, D, Dh = q.tokens, cfg.hidden_size, cfg.head_dim
    blk = cfg.weight_block_size
    for s in dense_linears(cfg, ratio):
        cat = "gate" if s.name == "ffn.gate" else ("shared_expert" if "shared" in s.name else
                                                   ("compressor_bf16" if s.fmt == "bf16" else "attn_fp8"))
        c.add_bytes(cat, linear_bytes(s.out_f, s.in_f, s.fmt, blk))
        c.add_flops(s.flop_class, 2 * s.params * T)
    for k, v in block_small_bytes(cfg, ratio, hash_routed).items():
        c.add_bytes(k, v)
    if hash_routed:
        c.add_bytes("other_fp32", 8 * cfg.num_experts_per_tok * T)        # tid2eid rows
    hit = expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, T)
    c.add_bytes("routed_experts", hit * expert_bytes(cfg))
    for s in expert_linears(cfg):
        c.add_flops(s.flop_class, 2 * s.params * T * cfg.num_experts_per_tok)
    hc, n_mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    c.add_flops("bf16", 2 * 2 * n_mix * hc * D * T)                      # mHC pre-mixes (attn, ffn)

    pairs = attention_pairs(cfg, ratio, q)
    c.add_flops("bf16", 4 * cfg.num_attention_heads * Dh * (pairs["window"] + pairs["compressed"]))
    c.add_flops("fp8", 2 * cfg.index_n_heads * cfg.index_head_dim * pairs["indexed"])

    # state: ring row written per token; window rows read (decode: all but the new token's own)
    c.add_bytes("state_write", T * Dh * cache_elem)
    if decode:
        c.add_bytes("state_read", (pairs["window"] - T) * Dh * cache_elem)
        c.add_bytes("state_read", pairs["compressed"] * Dh * cache_elem)
        c.add_bytes("state_read", pairs["indexed"] * cfg.index_head_dim * cache_elem)
    elif q.start:                                                         # a later prefill chunk reads
        c.add_bytes("state_read", q.seqs * min(q.start, cfg.sliding_window) * Dh * cache_elem)  # the state once
    comps = [(ratio, Dh)] if ratio else []
    if ratio == 4:
        comps.append((4, cfg.index_head_dim))
    for r, d in comps:
        coff = 2 if r == 4 else 1
        c.add_bytes("state_write", T * coff * d * 4 * 2)                 # tails: kv + z, fp32
        c.add_bytes("state_write", T / r * d * cache_elem)                # compressed rows
        if decode:                                                        # tails pooled when a block
            c.add_bytes("state_read", T * coff * d * 4 * 2)              # closes (amortised per token)
        else:                                                             # prefill: rows of this and
            c.add_bytes("state_read", q.seqs * (q.start + q.count) // r * d * cache_elem)  # earlier chunks, once
    return c


def head_cost(cfg, tokens: int, logit_rows: int) -> Cost:
    """Embedding rows, hc_head collapse, final norm, bf16 LM head for `logit_rows` rows."""
    c = Cost()
    D, hc, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    c.add_bytes("embed", tokens * D * 2)
    if getattr(cfg, "hc_shifted", False):       # V4.1: no hc_head, the streams collapse with the
        c.add_flops("bf16", 2 * hc * D * logit_rows)                 # last sub-layer's pre weights
    else:
        c.add_bytes("mhc", 4 * (hc * hc * D + hc + 1))
        c.add_flops("bf16", 2 * hc * hc * D * logit_rows)
    c.add_bytes("norms", 2 * D)
    c.add_bytes("lm_head", V * D * 2)
    c.add_flops("bf16", 2 * V * D * logit_rows)
    return c


@dataclass
class StepRoofline:
    layers: list[Cost]
    head: Cost
    ratios: tuple[int, ...]
    head_fp32_extra_bytes: float     # what an fp32 LM head weight adds (our runtime form)
    kinds: tuple[str, ...] | None = None   # V4.1: each layer's kind (roofline_v41.layer_kind)

    @property
    def total(self) -> Cost:
        c = Cost()
        for part in self.layers + [self.head]:
            c += part
        return c

    def to_dict(self, p: Peaks) -> dict:
        by_kind: dict[str, dict] = {}
        for r, layer in zip(self.kinds or self.ratios, self.layers):
            by_kind.setdefault(str(r), layer.to_dict(p))
        tot = self.total
        out = tot.to_dict(p)
        out.update(layers=len(self.layers), per_kind=by_kind, head=self.head.to_dict(p),
                   layers_t_floor_ms=1e3 * sum(layer.t_floor(p) for layer in self.layers),
                   head_fp32_extra_bytes=self.head_fp32_extra_bytes,
                   t_floor_fp32_head_ms=1e3 * max((tot.total_bytes + self.head_fp32_extra_bytes) / p.bw,
                                                  tot.t_compute(p)))
        return out


def step_roofline(cfg, ratios: list[int] | tuple[int, ...], q: Queries, cache_elem: int, decode: bool,
                  logit_rows: int) -> StepRoofline:
    kinds = None
    if getattr(cfg, "family", "v4") == "v41":
        import roofline_v41 as V41
        main = [cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)]
        if list(ratios) != main:
            raise ValueError(f"roofline: ratios {list(ratios)} are not the V4.1 config's "
                             f"layers {main}")
        layers = [V41.block_cost(cfg, i, q, cache_elem, decode) for i in range(len(main))]
        kinds = tuple(V41.layer_kind(cfg, i) for i in range(len(main)))
    else:
        layers = [block_cost(cfg, r, i < cfg.num_hash_layers, q, cache_elem, decode)
                  for i, r in enumerate(ratios)]
    return StepRoofline(layers, head_cost(cfg, q.tokens, logit_rows), tuple(ratios),
                        head_fp32_extra_bytes=2.0 * cfg.vocab_size * cfg.hidden_size, kinds=kinds)


def decode_roofline(cfg, ratios, batch: int, context: int, cache_elem: int = 2) -> StepRoofline:
    """One decode step: `batch` sequences, one new token each at position `context`."""
    return step_roofline(cfg, ratios, Queries(batch, context, 1), cache_elem, True, batch)


def prefill_roofline(cfg, ratios, tokens: int, chunk: int | None = None, cache_elem: int = 2) -> StepRoofline:
    """One sequence's prompt of `tokens` tokens from position 0, in chunks of `chunk` (weights are
    read once per chunk; later chunks read the state earlier ones wrote)."""
    chunk = chunk or tokens
    total: StepRoofline | None = None
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        part = step_roofline(cfg, ratios, Queries(1, start, n), cache_elem, False, 1)
        if total is None:
            total = part
        else:
            for a, b in zip(total.layers, part.layers):
                a += b
            total.head += part.head
    return total
