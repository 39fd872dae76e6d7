"""Whole-layer checks of the V4.1 reference against naive loops: attention per query and head
(window + selected compressed keys, sink, inverse RoPE through complex numbers, grouped output),
MoE per token (sorted routing), and the YOCO consumer-half compressor input."""
from __future__ import annotations

import math

import pytest
import torch

from ._random_weights import SEQ_LEN as T
from ._random_weights import make_random_tensors, make_tokenizer_json, tiny_config
from .ref_ops import apply_rope, rms_norm
from .reference import ReferenceV41


def test_yoco_consumer_source_pools_shared_hidden(ids):
    tok = make_tokenizer_json(512)
    cfg = tiny_config(kv_source_layer_ids=[2, 4, 5, 6], index_k_source_layer_ids=[2, 4, 5, 6],
                      num_hidden_layers=7, compress_ratios=[0, 0, 2, 2, 2, 1, 1],
                      index_source_layer_ids=[2, 4, 5, 6])
    tensors = make_random_tensors(cfg, seed=3)
    ref = ReferenceV41(cfg, tensors, tok)
    ref.forward(ids[:20])
    st = ref.last_state
    w = ref.w
    pre6 = rms_norm(st.shared_hidden @ w["layers.6.attn.compressor.wkv.weight"].T,
                    w["layers.6.attn.compressor.norm.weight"], 1e-20)
    assert torch.allclose(st.pre_entries[6], pre6, atol=1e-6)



def _unrope(o, p, freqs):
    """Inverse rotation of the trailing pairs at position p, through complex numbers."""
    r = 2 * freqs.shape[0]
    pairs = torch.view_as_complex(o[..., -r:].reshape(*o.shape[:-1], -1, 2).contiguous())
    turned = pairs * torch.polar(torch.ones_like(freqs), -p * freqs).to(torch.complex64)
    return torch.cat([o[..., :-r], torch.view_as_real(turned).flatten(-2)], dim=-1)


@pytest.mark.parametrize("layer", [1, 3, 6])
def test_attention_matches_per_query_loop(model, ids, layer):
    ref = model[3]
    ref.forward(ids)
    st, w, window = ref.last_state, ref.w, ref.cfg["sliding_window"]
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(layer))
    got = ref._attention(layer, x, st)
    p_ = f"layers.{layer}.attn."
    src = {3: 2, 6: 5}.get(layer)
    freqs = ref.freqs_comp if src else ref.freqs_plain
    qr = rms_norm(x @ w[p_ + "wq_a.weight"].T, w[p_ + "q_norm.weight"], 1e-20)
    q = apply_rope((qr @ w[p_ + "wq_b.weight"].T).view(T, 4, 128), torch.arange(T), freqs)
    kv = apply_rope(rms_norm(x @ w[p_ + "wkv.weight"].T, w[p_ + "kv_norm.weight"], 1e-20),
                    torch.arange(T), freqs)
    wo_a = w[p_ + "wo_a.weight"]
    for p in range(T):
        keys = [kv[t] for t in range(max(0, p - window + 1), p + 1)]
        if src:
            keys += [st.comp_keys[src][b] for b in st.selection[src][p].nonzero().flatten()]
        keys = torch.stack(keys)
        heads = []
        for h in range(4):
            logits = keys @ q[p, h] / math.sqrt(128)
            e = torch.exp(logits - logits.max())
            denom = e.sum() + torch.exp(w[p_ + "attn_sink"][h] - logits.max())
            heads.append(_unrope((e[:, None] * keys).sum(0) / denom, p, freqs))
        z = torch.cat([wo_a[g * 128:(g + 1) * 128] @ torch.cat(heads[2 * g:2 * g + 2])
                       for g in range(2)])
        assert torch.allclose(got[p], w[p_ + "wo_b.weight"] @ z, atol=1e-4, rtol=1e-4), p


def test_moe_matches_per_token_loop(model):
    ref = model[3]
    w, layer = ref.w, 4
    f = f"layers.{layer}.ffn."
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    got = ref._moe(layer, x)

    def expert(prefix, v):
        g = (w[prefix + "w1.weight"] @ v).clamp(max=10.0)
        u = (w[prefix + "w3.weight"] @ v).clamp(-10.0, 10.0)
        return w[prefix + "w2.weight"] @ (g * torch.sigmoid(g) * u)
    for t in range(6):
        s = [math.sqrt(math.log1p(math.exp(float(v)))) for v in w[f + "gate.weight"] @ x[t]]
        bias = w[f + "gate.bias"].tolist()
        top = sorted(range(8), key=lambda e: (-(s[e] + bias[e]), e))[:2]
        want = expert(f + "shared_experts.", x[t])
        for e in top:
            want = want + s[e] / sum(s[i] for i in top) * 1.5 * expert(f + f"experts.{e}.", x[t])
        assert torch.allclose(got[t], want, atol=1e-4, rtol=1e-4)
