"""Float32 building blocks of the independent DeepSeek-V4.1 reference forward (test-only).

Each function transcribes one formula of the model specification (`deepseek_v4.md`,
`deepseek_v41.md`) as fixed by this package's brief. Nothing here imports the engine; the only
dependency is torch. Everything computes in float32 except the RoPE angles, which are formed in
float64 so that cos/sin are the correctly rounded float32 values at every position.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BF16_MAX = 3.3895313892515355e38
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TEXT_PREFIXES = ("embed.", "head.", "norm.", "layers.")


# ---- checkpoint decoding ------------------------------------------------------------------------

def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale bytes (float8_e8m0fnu or raw uint8) to float32 `2^(b - 127)`; scales
    stored as ordinary floats are taken as they are."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        return scale.float()
    raw = scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)
    out = torch.exp2(raw.float() - 127.0)
    return out.masked_fill(raw == 255, float("nan"))


def dequant_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 `[out, in]` times one E8M0 scale per `block x block` tile (tile (i//b, j//b))."""
    rows, cols = weight.shape
    if scale.shape != (math.ceil(rows / block), math.ceil(cols / block)):
        raise ValueError(f"scale {tuple(scale.shape)} does not tile {tuple(weight.shape)}")
    s = e8m0_to_float(scale).repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)
    return weight.float() * s[:, :cols]


def dequant_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP8 E4M3 `[rows, n]` times one E8M0 scale per row per `group` consecutive values."""
    return dequant_rows_like(weight.float(), scale, group)


def e2m1_table() -> torch.Tensor:
    """The 16 E2M1 code values: bit 3 = sign, bits 0-2 index the magnitude list."""
    return torch.tensor([(-1.0 if code & 8 else 1.0) * E2M1_MAGNITUDES[code & 7]
                         for code in range(16)])


def dequant_fp4(weight: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Packed E2M1 `[out, in/2]` (low nibble = element 2j, high nibble = 2j+1) times one E8M0
    scale per `group` input channels."""
    packed = weight if weight.dtype == torch.uint8 else weight.view(torch.uint8)
    table = e2m1_table()
    low = table[(packed & 0xF).long()]
    high = table[(packed >> 4).long()]
    values = torch.stack([low, high], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])
    return dequant_rows_like(values, scale, group)


def dequant_rows_like(values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Multiply float `values` by per-row, per-`group` E8M0 scales."""
    rows, cols = values.shape
    if scale.shape != (rows, math.ceil(cols / group)):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit {tuple(values.shape)}")
    return values * e8m0_to_float(scale).repeat_interleave(group, 1)[:, :cols]


def dequantise_checkpoint(tensors: dict[str, torch.Tensor],
                          block: int = 32) -> dict[str, torch.Tensor]:
    """Text-model tensors of an official-format state dict, dequantised to float32.

    A `model.` prefix is stripped. `X.weight` with a partner `X.scale` is FP8 (`block` x `block`
    tiles; per row per 32 for `engram.embed`) or packed FP4 (int8 / uint8 / float4_e2m1fn_x2); scales are
    consumed. Every other tensor is upcast. Tensors outside the text model (vision, drafter,
    image embeddings) are dropped.
    """
    named = {k.removeprefix("model."): v for k, v in tensors.items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in named.items():
        if not name.startswith(TEXT_PREFIXES):
            continue
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in named:
            continue
        scale = named.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is None:
            if value.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8):
                raise ValueError(f"{name}: quantised weight without a scale")
            out[name] = value.float()
        elif value.dtype == torch.float8_e4m3fn:
            per_row = name.endswith("engram.embed.weight")
            out[name] = (dequant_fp8_rows(value, scale) if per_row
                         else dequant_fp8_blocks(value, scale, block))
        elif value.dtype in (torch.int8, torch.uint8) or "float4" in str(value.dtype):
            out[name] = dequant_fp4(value, scale)
        else:
            raise ValueError(f"{name}: cannot dequantise dtype {value.dtype} with a scale")
    return out


# ---- norms and rotary embedding -----------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * x * rsqrt(mean(x^2) + eps)` over the last dim (unweighted when `weight` is None)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_frequencies(rope_dim: int, base: float, yarn: dict | None = None) -> torch.Tensor:
    """Per-pair angular frequencies `base^(-2i/R)`, i < R/2, optionally YaRN-blended.

    YaRN (no magnitude scaling): `corr(r) = R ln(orig / (2 pi r)) / (2 ln base)`, `low =
    max(floor(corr(beta_fast)), 0)`, `high = min(ceil(corr(beta_slow)), R - 1)`, ramp = clamp((i -
    low) / (high - low), 0, 1), `f' = f / factor * ramp + f * (1 - ramp)`. Returned in float64.
    """
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    freqs = base ** (-2.0 * i / rope_dim)
    if yarn:
        orig = yarn["original_max_position_embeddings"]

        def corr(rotations: float) -> float:
            return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
        freqs = freqs / yarn["factor"] * ramp + freqs * (1.0 - ramp)
    return freqs


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing `2 * len(freqs)` channels of `x` (interleaved pairs 2i, 2i+1) by
    `+-positions * freqs`. `x` is `[N, ..., dim]` with `positions` `[N]`."""
    rot = 2 * freqs.shape[0]
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[0],)
    cos = torch.cos(angles).float().view(shape)
    sin = torch.sin(angles).float().view(shape) * (-1.0 if inverse else 1.0)
    even, odd = x[..., -rot::2], x[..., -rot + 1::2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rot], rotated], dim=-1)


# ---- mHC ----------------------------------------------------------------------------------------

def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """Row softmax + eps, a column normalisation, then `iters - 1` (row, column) rounds; each
    normalisation divides by (sum + eps). `logits` is `[..., m, m]` (row j, column k)."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_mixes(trunk: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm_eps: float, hc_eps: float, iters: int):
    """`(pre [T, m], post [T, m], comb [T, m, m])` of one mHC site from the trunk `[T, m, D]`."""
    t, m, _ = trunk.shape
    flat = trunk.reshape(t, -1)
    mix = (flat @ fn.T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mix[:, :m] * scale[0] + base[:m]) + hc_eps
    post = 2.0 * torch.sigmoid(mix[:, m:2 * m] * scale[1] + base[m:2 * m])
    comb = (mix[:, 2 * m:] * scale[2] + base[2 * m:]).view(t, m, m)
    return pre, post, sinkhorn(comb, hc_eps, iters)


def hc_update(trunk: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
    """`R'[k] = post[k] * out + sum_j comb[j, k] * R[j]` (stream k uses column k)."""
    return post[:, :, None] * out[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, trunk)


def collapse(trunk: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`sum_i pre[i] * R[i]`: `[T, m, D]`, `[T, m]` -> `[T, D]`."""
    return (pre[:, :, None] * trunk).sum(1)


# ---- compressed entries, selection, attention ---------------------------------------------------

def pool_entries(latent: torch.Tensor, score: torch.Tensor | None, ratio: int) -> torch.Tensor:
    """Compressed entries: ratio 1 -> one per token (no gate); ratio r > 1 -> one per complete
    block of r tokens, `sum_j softmax_j(score_j[d]) * latent_j[d]` per channel d."""
    if ratio == 1:
        return latent
    n = latent.shape[0] // ratio
    lat = latent[: n * ratio].view(n, ratio, latent.shape[-1])
    gate = torch.softmax(score[: n * ratio].view(n, ratio, score.shape[-1]), dim=1)
    return (gate * lat).sum(1)


def entry_visibility(num_tokens: int, num_entries: int, ratio: int) -> torch.Tensor:
    """`[T, N]` bool: entry b is visible to the query at p iff `b*r + r - 1 <= p`."""
    p = torch.arange(num_tokens)[:, None]
    b = torch.arange(num_entries)[None, :]
    return b * ratio + ratio - 1 <= p


def window_mask(num_tokens: int, window: int) -> torch.Tensor:
    """`[T, T]` bool: key t is in the window of query p iff `p - W < t <= p`."""
    p = torch.arange(num_tokens)[:, None]
    t = torch.arange(num_tokens)[None, :]
    return (t <= p) & (t > p - window)


def select_topk(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, N]` bool mask of the `min(k, #candidates)` highest-scoring candidates of every row;
    ties go to the lower index (a stable descending sort)."""
    t, n = scores.shape
    masked = scores.masked_fill(~candidates, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n).expand(t, n).contiguous())
    keep = candidates.sum(-1, keepdim=True).clamp(max=k)
    return (rank < keep) & candidates


def candidate_entries(scores: torch.Tensor, visible: torch.Tensor, block: int,
                      keep_blocks: int) -> torch.Tensor:
    """`[T, N]` bool: entries inside the kept candidate blocks of every row.

    Block j = entries `[j*block, (j+1)*block)`; its score is the max over its visible entries
    (no visible entry: not a candidate); the last block holding a visible entry scores +inf;
    other scores are capped at the bf16 max; the `keep_blocks` best blocks are kept (ties ->
    lower j).
    """
    t, n = scores.shape
    if n == 0:
        return visible.clone()
    nblk = math.ceil(n / block)
    pad = nblk * block - n
    s = F.pad(scores.masked_fill(~visible, float("-inf")), (0, pad), value=float("-inf"))
    has = F.pad(visible, (0, pad), value=False).view(t, nblk, block).any(-1)
    block_scores = s.view(t, nblk, block).amax(-1).clamp(max=BF16_MAX)
    last = (has.long() * torch.arange(1, nblk + 1)).argmax(-1)
    rows = has.any(-1)
    block_scores[rows, last[rows]] = float("inf")
    kept = select_topk(block_scores, has, keep_blocks)
    return kept.repeat_interleave(block, dim=1)[:, :n]


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Shared-K=V attention: `q [T, H, d]`, `keys [N, d]` (also the values), `mask [T, N]`,
    `sink [H]` joining only the softmax denominator. Returns `[T, H, d]`."""
    logits = torch.einsum("thd,nd->thn", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_col = sink.view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thn,nd->thd", probs, keys)


# ---- MoE ----------------------------------------------------------------------------------------

def route(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float,
          normalise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [T, E], chosen [T, E])`: s = sqrt(softplus(logits)); the top-k of `s + bias`
    (ties -> lower expert) are chosen; weights = chosen s / their sum * scaling."""
    s = torch.sqrt(F.softplus(logits))
    chosen = select_topk(s + bias, torch.ones_like(s, dtype=torch.bool), k)
    w = s * chosen
    if normalise:
        w = w / w.sum(-1, keepdim=True)
    return w * scaling, chosen


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
           limit: float | None) -> torch.Tensor:
    """`w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))` (no clamp when limit is falsy)."""
    gate, up = x @ w1.T, x @ w3.T
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (F.silu(gate) * up) @ w2.T
