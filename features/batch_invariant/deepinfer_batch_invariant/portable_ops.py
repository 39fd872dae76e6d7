"""Batch-invariant versions of the core's portable PyTorch ops (the CPU backend).

Why the plain ops are not invariant: a CPU BLAS picks its kernel by the GEMM's shape (a 1-row product
is a GEMV, 9 rows take another blocking than 16), so a row's bits change with the number of rows that
share the call; the attention's key list starts wherever the chunk's ring starts, so the same key
sits in another SIMD lane under another chunking; reductions over a dimension of varying length
group their additions differently.

What these do instead:
* every GEMM (`fixed_tile_mm`) runs as products of exactly TILE rows by the whole (padded) weight,
  one call per TILE rows: the BLAS sees one shape whatever the batch, so a row's result depends on
  that row alone. Padding M instead (one call of a varying multiple of TILE rows) is not enough: MKL's
  AVX2 kernels, and its AVX-512 ones for wider products, block a row differently as M grows;
* attention lays out each query's keys canonically: the sink, then window slot j for position
  p - W + 1 + j, then the visible compressed rows in ascending order, padded at the end; masked
  slots are exact zeros in every sum;
* the indexer sums its heads in a fixed sequential order; mHC's post mix is written out term by term;
* sigmoid, SiLU and softplus are composed from exp, log1p and division (see `sigmoid` below).
Everything else in the portable path (norms, RoPE, quantisation, routing top-k, the sampler) is
already computed row by row with fixed-length reductions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.ops.kv_fp8 import unpack_kv_fp8
from deepinfer_core.ops.portable_attention import (
    PortableAttentionBackend,
    ring_rope_dim,
    sink_softmax_values,
)
from deepinfer_core.ops.portable_linear import PortableLinearMethod, blockwise_linear
from deepinfer_core.ops.portable_mhc import PortableMHC
from deepinfer_core.ops.portable_moe import PortableMoE

TILE = 16            # rows per GEMM call; GEMM columns are padded to a multiple of this
QUERY_CHUNK = 256    # bounds the gathered [queries, keys, dim] tensor on long prefills


def _pad_rows(t: torch.Tensor, multiple: int = TILE) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return t if pad == 0 else torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))])


# fp32 torch.sigmoid / silu / softplus on the CPU take a vectorised path for most elements and a scalar
# one for a tensor's tail, which round differently, so an element's bits depend on the tensor's size.
# exp, log1p and division round the same on both paths.
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))   # F.softplus's threshold


def fixed_tile_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T, TILE rows of a per BLAS call, N padded to a multiple of TILE (see the
    module docstring)."""
    M, N = a.shape[0], b.shape[0]
    if M == 0:
        return a.new_zeros((0, N))
    a, b = _pad_rows(a), _pad_rows(b)
    return torch.cat([F.linear(a[i:i + TILE], b) for i in range(0, a.shape[0], TILE)])[:M, :N]


class InvariantPortableLinear(PortableLinearMethod):
    batch_invariant = True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        xq = self._quant_input(layer, x)
        if self._blockwise(layer):
            return blockwise_linear(xq, layer.weight, layer.k_block, fixed_tile_mm)
        y = fixed_tile_mm(xq.reshape(-1, xq.shape[-1]), layer.weight)
        return y.view(*x.shape[:-1], y.shape[-1])

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        G = x.shape[1]
        xq = self._quant_input(layer, x)
        w = layer.weight.view(G, -1, x.shape[-1])
        return torch.stack([fixed_tile_mm(xq[:, g], w[g]) for g in range(G)], dim=1)


class InvariantPortableMoE(PortableMoE):
    """Experts run through the (invariant) linear method; the combine adds a token's experts in
    ascending expert order after the shared expert, whatever the batch (the base class's order)."""
    batch_invariant = True
    softplus = staticmethod(softplus)
    silu = staticmethod(silu)

    @staticmethod
    def gate_logits(gate, x: torch.Tensor) -> torch.Tensor:
        return fixed_tile_mm(x.float(), gate.weight)


class InvariantPortableMHC(PortableMHC):
    batch_invariant = True
    _sigmoid = staticmethod(sigmoid)

    @staticmethod
    def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fixed_tile_mm(a, b)

    def post(self, f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        if self.official:            # elementwise, j in order: already invariant
            return super().post(f, res, post, comb)
        rf = res.float()
        out = post[..., None] * f.float()[:, None, :]
        for j in range(self.hc):             # sum_j comb[j, k] * res[j], j in order
            out = out + comb[:, j, :, None] * rf[:, j, None, :]
        return out.to(res.dtype)


class InvariantPortableAttention(PortableAttentionBackend):
    batch_invariant = True

    def top_mask(self, scores, valid, topk: int):
        """Always the stable sort (ties: the lowest row wins): torch.topk breaks ties by the row's
        length, which is the number of rows written so far, so it would depend on chunking."""
        k = min(topk, scores.shape[1])
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return torch.zeros_like(valid).scatter_(1, top, True) & valid

    def index_scores(self, q, w, keys) -> torch.Tensor:
        T, H, D = q.shape
        dtype = q.dtype if self.official else torch.float32
        dots = fixed_tile_mm(q.to(dtype).reshape(T * H, D), keys.to(dtype)).view(T, H, keys.shape[0])
        scores = torch.relu(dots) * w.to(dtype)[..., None]
        total = scores[:, 0].float()
        for h in range(1, H):                # heads summed in a fixed order
            total = total + scores[:, h].float()
        return total.to(dtype)

    @staticmethod
    def attend(attn, q, kv, st, start: int, pos, comp_rows, comp_mask,
               official: bool = False, rect_lo: int = 0) -> torch.Tensor:
        W, ring_size, dev = attn.window, st.ring.shape[0], q.device
        lo = min(max(0, start - W + 1, rect_lo), start)
        ring_keys = st.ring[torch.arange(lo, start, device=dev) % ring_size]
        if st.ring.dtype == torch.uint8:
            ring_keys = unpack_kv_fp8(ring_keys, kv.shape[1], ring_rope_dim(st.ring, kv), kv.dtype)
        by_pos = torch.cat([ring_keys, kv])              # row i holds position lo + i
        sink = attn.attn_sink.float()
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], QUERY_CHUNK):
            p = pos[a:a + QUERY_CHUNK]
            win = p[:, None] - W + 1 + torch.arange(W, device=dev)[None, :]      # slot j: p - W + 1 + j
            ok = (win >= 0) & (win >= rect_lo)
            keys = by_pos[(win - lo).clamp(min=0)]                                # [n, W, D]
            if comp_rows is not None and comp_rows.shape[0]:
                ids, c_ok = _visible_rows(comp_mask[a:a + QUERY_CHUNK])
                keys = torch.cat([keys, comp_rows[ids]], dim=1)
                ok = torch.cat([ok, c_ok], dim=1)
            pad = (-keys.shape[1]) % TILE
            if pad:
                keys = torch.cat([keys, keys.new_zeros(keys.shape[0], pad, keys.shape[2])], dim=1)
                ok = torch.cat([ok, ok.new_zeros(ok.shape[0], pad)], dim=1)
            keys_f = keys.float()
            logits = torch.bmm(q[a:a + QUERY_CHUNK].float(), keys_f.transpose(1, 2)) * attn.scale
            logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
            if official:
                o = sink_softmax_values(logits, sink, keys_f, keys.dtype)
                out[a:a + QUERY_CHUNK] = o.to(q.dtype)
                continue
            # the sink first (a logit with a zero value vector), so trailing padding never moves a key
            both = torch.cat([sink[None, :, None].expand(logits.shape[0], -1, 1), logits], dim=-1)
            probs = torch.softmax(both, dim=-1)[..., 1:]
            probs = probs.to(keys.dtype).float()         # rounded to the key dtype, as the reference
            out[a:a + QUERY_CHUNK] = torch.bmm(probs, keys_f).to(q.dtype)
        return out


def _visible_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the ids of its visible compressed rows in ascending order, padded at the end:
    (ids [n, K], ok [n, K]) with K the most any query sees."""
    n, R = mask.shape
    k = max(int(mask.sum(dim=1).max()), 1) if n else 1
    rank = torch.where(mask, torch.arange(R, device=mask.device)[None, :], R)
    ids = torch.sort(rank, dim=1).values[:, :k]
    ok = ids < R
    return ids.clamp(max=R - 1), ok
