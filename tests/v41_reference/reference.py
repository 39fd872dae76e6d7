"""An independent float32 reference forward of DeepSeek-V4.1 (test-only oracle).

Written from `shared/spec/deepseek_v4.md` and `deepseek_v41.md` plus the decisions of this
package's brief, without the engine's code. One whole sequence at a time: no cache, no paging,
no chunking, no activation quantisation; weights are dequantised to float32 once at load.

    ref = ReferenceV41.from_dir(path)          # config.json + *.safetensors + tokenizer.json
    logits = ref.forward([0, 17, 42])          # [T, vocab] float32
    ref.last_state                             # selections etc. of that forward, for debugging
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .engram_ref import EngramTables, engram_update
from .ref_ops import (
    apply_rope,
    candidate_entries,
    collapse,
    dequantise_checkpoint,
    entry_visibility,
    hc_mixes,
    hc_update,
    pool_entries,
    rms_norm,
    rope_frequencies,
    route,
    select_topk,
    sink_attention,
    swiglu,
    window_mask,
)


@dataclass
class ForwardState:
    """Per-forward cross-layer state (keyed by the owning source layer)."""

    shared_hidden: torch.Tensor | None = None                 # YOCO: x of layer n_prefill
    rect_lo: int | None = None          # bounded replay: consumer windows start no earlier
    pre_entries: dict[int, torch.Tensor] = field(default_factory=dict)   # RMSNorm'd, no RoPE
    comp_keys: dict[int, torch.Tensor] = field(default_factory=dict)     # RoPE'd entries
    visible: dict[int, torch.Tensor] = field(default_factory=dict)       # [T, N] per KV source
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    selection: dict[int, torch.Tensor] = field(default_factory=dict)     # [T, N] bool
    candidates: torch.Tensor | None = None                    # [T, N] bool: kept-block entries


def _latest(sources: list[int], layer: int) -> int:
    """The largest source id <= layer."""
    found = [s for s in sources if s <= layer]
    if not found:
        raise ValueError(f"layer {layer} has no source at or before it in {sources}")
    return max(found)


class ReferenceV41:
    """Float32 DeepSeek-V4.1 text model over official-format tensors."""

    # The shared expert takes the SwiGLU clamp as the routed ones (V4.1, per the brief); the V4
    # reference leaves it unclamped. Flip on the instance to compare against V4 behaviour.
    clamp_shared_expert = True

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor],
                 tokenizer_json: str | None):
        """`config`: the HF config dict (text keys under `text_config`, or flat); `tensors`:
        official names (an optional `model.` prefix is stripped); `tokenizer_json`: JSON text
        or a path, needed only when Engram layers are configured."""
        c = config.get("text_config", config)
        self.cfg = c
        self.n_layers = c["num_hidden_layers"]
        self.ratios = [int(r) for r in c.get("compress_ratios", [0] * self.n_layers)]
        self.ratios = self.ratios[: self.n_layers]
        self.dim, self.heads = c["hidden_size"], c["num_attention_heads"]
        self.head_dim = c["head_dim"]
        self.rope_dim = c["qk_rope_head_dim"]
        self.eps, self.m = c["rms_norm_eps"], c["hc_mult"]
        self.window = c["sliding_window"]
        compressed = [i for i, r in enumerate(self.ratios) if r > 0]
        self.kv_sources = sorted(c.get("kv_source_layer_ids") or compressed)
        self.index_sources = sorted(c.get("index_source_layer_ids") or compressed)
        self.ik_sources = sorted(c.get("index_k_source_layer_ids") or self.kv_sources)
        self.cand_source = c.get("candidate_source_layer_id")
        self.n_prefill = next((i for i, r in enumerate(self.ratios) if r == 1), self.n_layers)
        if c.get("hc_shifted") is False:
            raise ValueError("only shifted mHC (V4.1) is implemented")
        self.freqs_plain = rope_frequencies(self.rope_dim, c["rope_theta"])
        yarn = c.get("rope_scaling")
        if yarn and yarn.get("type", yarn.get("rope_type")) != "yarn":
            raise ValueError(f"unsupported rope_scaling {yarn}")
        self.freqs_comp = rope_frequencies(self.rope_dim, c.get("compress_rope_theta",
                                                                c["rope_theta"]), yarn)
        block = (config.get("quantization_config") or {}).get("weight_block_size", [32, 32])
        if len(set(block)) != 1:
            raise ValueError(f"non-square weight blocks {block} are not supported")
        self.w = dequantise_checkpoint(tensors, block[0])
        self.engram = None
        if c.get("engram_layer_ids"):
            if tokenizer_json is None:
                raise ValueError("Engram layers need tokenizer.json (compressed ids)")
            self.engram = EngramTables(c, tokenizer_json)
            stated = c.get("engram_compressed_vocab_size")
            if stated and stated != self.engram.compressed_vocab:
                warnings.warn(f"tokenizer.json compresses to {self.engram.compressed_vocab} ids, "
                              f"the config states {stated}; the hash uses the former",
                              stacklevel=2)
            for layer in self.engram.layer_ids:
                rows = self.w[f"layers.{layer}.engram.embed.weight"].shape[0]
                if rows != sum(self.engram.primes[layer]):
                    raise ValueError(f"layer {layer}: Engram table has {rows} rows, the primes "
                                     f"sum to {sum(self.engram.primes[layer])}")
        self.last_state: ForwardState | None = None

    @classmethod
    def from_dir(cls, path) -> ReferenceV41:
        """Load `config.json`, every `*.safetensors` and (if present) `tokenizer.json`."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(shard)))
        tok = path / "tokenizer.json"
        return cls(config, tensors, tok.read_text() if tok.is_file() else None)

    def _w(self, name: str) -> torch.Tensor:
        if name in self.w:
            return self.w[name]
        return self.w[name + ".weight"]

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, token_ids: list[int], rect_lo: int | None = None) -> torch.Tensor:
        """`[T, vocab]` float32 logits of every position of `token_ids` (positions 0..T-1).
        `rect_lo`: SWA bounded replay in 'mask' form (deepinfer_surface.md §8.2): in the YOCO
        consumer layers no query sees a window key at a position before `rect_lo`."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        t = ids.shape[0]
        c = self.cfg
        trunk = self._w("embed")[ids][:, None, :].repeat(1, self.m, 1)
        pre_next = torch.zeros(t, self.m)
        pre_next[:, 0] = 1.0
        state = ForwardState(rect_lo=rect_lo)
        for layer in range(self.n_layers):
            if self.engram is not None and layer in self.engram.layer_ids:
                trunk = self._engram(layer, trunk, ids.tolist())
            for site in ("attn", "ffn"):
                p = f"layers.{layer}."
                x = rms_norm(collapse(trunk, pre_next), self._w(p + f"{site}_norm"), self.eps)
                out = self._attention(layer, x, state) if site == "attn" else self._moe(layer, x)
                pre, post, comb = hc_mixes(trunk, self._w(p + f"hc_{site}_fn"),
                                           self._w(p + f"hc_{site}_base"),
                                           self._w(p + f"hc_{site}_scale"), self.eps,
                                           c["hc_eps"], c["hc_sinkhorn_iters"])
                trunk = hc_update(trunk, out, post, comb)
                pre_next = pre
        self.last_state = state
        h = rms_norm(collapse(trunk, pre_next), self._w("norm"), self.eps)
        return h @ self._w("head").T

    def _engram(self, layer: int, trunk: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        p = f"layers.{layer}.engram."
        weights = {k: self._w(p + k) for k in ("embed", "wkv", "q_weight", "k_weight")}
        return engram_update(trunk, self.engram.rows(layer, token_ids), weights, self.eps)

    # ---- attention ------------------------------------------------------------------------------

    def _attention(self, layer: int, x: torch.Tensor, st: ForwardState) -> torch.Tensor:
        """One attention sub-layer on the normed collapsed hidden `x [T, D]`."""
        p = f"layers.{layer}.attn."
        t = x.shape[0]
        pos = torch.arange(t)
        ratio = self.ratios[layer]
        freqs = self.freqs_comp if ratio > 0 else self.freqs_plain
        if layer == self.n_prefill:
            st.shared_hidden = x
        qr = rms_norm(x @ self._w(p + "wq_a").T, self._w(p + "q_norm"), self.eps)
        q = apply_rope((qr @ self._w(p + "wq_b").T).view(t, self.heads, self.head_dim), pos, freqs)
        kv = apply_rope(rms_norm(x @ self._w(p + "wkv").T, self._w(p + "kv_norm"), self.eps),
                        pos, freqs)
        keys, mask = kv, window_mask(t, self.window)
        if st.rect_lo is not None and layer >= self.n_prefill:
            mask = mask & (pos[None, :] >= st.rect_lo)
        if ratio > 0:
            if layer in self.kv_sources:
                self._compress(layer, x, st)
            if layer in self.ik_sources:
                self._index_keys(layer, st)
            if layer in self.index_sources:
                st.selection[layer] = self._select(layer, qr, x, st)
            kv_src = _latest(self.kv_sources, layer)
            selection = st.selection[_latest(self.index_sources, layer)]
            if selection.shape[1] != st.comp_keys[kv_src].shape[0]:
                raise ValueError(f"layer {layer}: selection and compressed entries disagree")
            keys = torch.cat([kv, st.comp_keys[kv_src]], dim=0)
            mask = torch.cat([mask, selection], dim=1)
        o = sink_attention(q, keys, mask, self._w(p + "attn_sink"), self.head_dim ** -0.5)
        o = apply_rope(o, pos, freqs, inverse=True)
        groups = self.cfg["o_groups"]
        wo_a = self._w(p + "wo_a").view(groups, self.cfg["o_lora_rank"], -1)
        z = torch.einsum("tgi,goi->tgo", o.reshape(t, groups, -1), wo_a).reshape(t, -1)
        return z @ self._w(p + "wo_b").T

    def _compress(self, layer: int, x: torch.Tensor, st: ForwardState) -> None:
        """KV source: pooled, normed and RoPE'd compressed entries (YOCO consumers pool the
        shared hidden instead of their own)."""
        p = f"layers.{layer}.attn.compressor."
        ratio = self.ratios[layer]
        xc = st.shared_hidden if layer >= self.n_prefill else x
        latent = xc @ self._w(p + "wkv").T
        score = xc @ self._w(p + "wgate").T if ratio > 1 else None
        pre = rms_norm(pool_entries(latent, score, ratio), self._w(p + "norm"), self.eps)
        bpos = torch.arange(pre.shape[0]) * ratio
        st.pre_entries[layer] = pre
        st.comp_keys[layer] = apply_rope(pre, bpos, self.freqs_comp)
        st.visible[layer] = entry_visibility(x.shape[0], pre.shape[0], ratio)

    def _index_keys(self, layer: int, st: ForwardState) -> None:
        """Index-K source: `RoPE(RMSNorm(wk pre_b; k_norm), b * r)`."""
        p = f"layers.{layer}.attn.indexer."
        pre = st.pre_entries[layer]
        k = rms_norm(pre @ self._w(p + "wk").T, self._w(p + "k_norm"), self.eps)
        st.index_keys[layer] = apply_rope(k, torch.arange(pre.shape[0]) * self.ratios[layer],
                                          self.freqs_comp)

    def _select(self, layer: int, qr: torch.Tensor, x: torch.Tensor,
                st: ForwardState) -> torch.Tensor:
        """Index source: indexer scores over visible entries, candidate blocks, top-k mask."""
        p = f"layers.{layer}.attn.indexer."
        c = self.cfg
        t, n_heads, d_head = x.shape[0], c["index_n_heads"], c["index_head_dim"]
        keys = st.index_keys[_latest(self.ik_sources, layer)]
        visible = st.visible[_latest(self.kv_sources, layer)]
        q = apply_rope((qr @ self._w(p + "wq_b").T).view(t, n_heads, d_head), torch.arange(t),
                       self.freqs_comp)
        w = x @ self._w(p + "weights_proj").T
        dots = torch.relu(torch.einsum("thd,nd->thn", q, keys))
        scores = torch.einsum("th,thn->tn", w, dots) * d_head ** -0.5 * n_heads ** -0.5
        st.index_scores[layer] = scores
        allowed = visible
        if self.cand_source is not None and layer == self.cand_source:
            st.candidates = candidate_entries(scores, visible, c["candidate_block_size"],
                                              c["candidate_topk_blocks"])
        elif self.cand_source is not None and layer > self.cand_source:
            if st.candidates is None or st.candidates.shape != visible.shape:
                raise ValueError(f"layer {layer}: no matching candidate blocks from layer "
                                 f"{self.cand_source}")
            allowed = visible & st.candidates
        return select_topk(scores, allowed, c["index_topk"])

    # ---- MoE ------------------------------------------------------------------------------------

    def _moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Routed experts (sqrt-softplus scores, biased top-k) plus the shared expert."""
        p = f"layers.{layer}.ffn."
        c = self.cfg
        limit = c.get("swiglu_limit")
        logits = x @ self._w(p + "gate").T
        bias = self.w.get(p + "gate.bias", torch.zeros(logits.shape[1]))
        weights, chosen = route(logits, bias, c["num_experts_per_tok"],
                                c.get("routed_scaling_factor", 1.0),
                                c.get("norm_topk_prob", True))
        s = p + "shared_experts."
        y = torch.zeros_like(x)
        if c.get("n_shared_experts", 1):
            y = swiglu(x, self._w(s + "w1"), self._w(s + "w2"), self._w(s + "w3"),
                       limit if self.clamp_shared_expert else None)
        for e in range(logits.shape[1]):
            rows = chosen[:, e].nonzero().flatten()
            if rows.numel() == 0:
                continue
            ep = p + f"experts.{e}."
            out = swiglu(x[rows], self._w(ep + "w1"), self._w(ep + "w2"), self._w(ep + "w3"),
                         limit)
            y[rows] += weights[rows, e, None] * out
        return y
