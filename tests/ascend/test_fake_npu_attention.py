"""npu_sparse_flash_attention and npu_lightning_indexer: reference values and constraints."""
from __future__ import annotations

import pytest
import torch


def _sfa_inputs(seed=0, n1=2):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(1, 2, n1, 512, generator=g).to(bf) * 0.05          # BSND, S1 = 2
    qr = torch.randn(1, 2, n1, 64, generator=g).to(bf) * 0.05
    key = torch.randn(3, 16, 1, 512, generator=g).to(bf)                 # PA_BSND, 3 blocks
    kr = torch.randn(3, 16, 1, 64, generator=g).to(bf)
    table = torch.tensor([[2, 0]], dtype=torch.int32)                    # logical blocks 0, 1
    idx = torch.tensor([[[[0, 17, 20, -1]], [[3, 21, -1, -1]]]], dtype=torch.int32)
    kw = dict(block_table=table, actual_seq_lengths_query=torch.tensor([2], dtype=torch.int32),
              actual_seq_lengths_kv=torch.tensor([22], dtype=torch.int32), query_rope=qr,
              key_rope=kr, layout_kv="PA_BSND", attention_mode=2)
    return q, key, idx, kw


def _sfa_independent(q, qr, key, kr, table, idx_rows, sink, scale):
    out = torch.zeros(q.shape[1], q.shape[2], 512)
    for i, idx in enumerate(idx_rows):
        phys = [(int(table[0, j // 16]), j % 16) for j in idx]
        kn = torch.stack([key[b, o, 0] for b, o in phys]).float()
        krr = torch.stack([kr[b, o, 0] for b, o in phys]).float()
        logits = (q[0, i].float() @ kn.T + qr[0, i].float() @ krr.T) * scale   # [N1, K]
        full = torch.cat((logits, sink[:, None]), dim=1).softmax(dim=1)[:, :-1]
        out[i] = full @ kn
    return out


@pytest.mark.parametrize("sparse_mode", [0, 3])
def test_sfa_matches_a_per_token_softmax_with_sink(fake_npu, sparse_mode):
    import torch_npu
    q, key, idx, kw = _sfa_inputs()
    sinks = torch.tensor([0.5, -1.0])
    out, mx, sm = torch_npu.npu_sparse_flash_attention(q, key, key, idx, 0.07, sinks=sinks,
                                                       sparse_mode=sparse_mode, **kw)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and mx.numel() == 0
    # Lq = 2, Lkv = 22: with rightDownCausal, token 0 sees j <= 20 and token 1 sees j <= 21
    rows = [[0, 17, 20], [3, 21]]
    ref = _sfa_independent(q, kw["query_rope"], key, kw["key_rope"], kw["block_table"], rows,
                           sinks, 0.07)
    torch.testing.assert_close(out[0].float(), ref, atol=2e-2, rtol=2e-2)


def test_sfa_causal_mask_drops_future_keys(fake_npu):
    import torch_npu
    q, key, idx, kw = _sfa_inputs()
    kw["actual_seq_lengths_kv"] = torch.tensor([20], dtype=torch.int32)   # token 0 sees j <= 18
    out, _, _ = torch_npu.npu_sparse_flash_attention(q, key, None, idx, 0.07, sparse_mode=3, **kw)
    ref = _sfa_independent(q, kw["query_rope"], key, kw["key_rope"], kw["block_table"],
                           [[0, 17], [3]], torch.full((2,), -torch.inf), 0.07)
    torch.testing.assert_close(out[0].float(), ref, atol=2e-2, rtol=2e-2)


def test_sfa_constraints(fake_npu):
    import torch_npu
    q, key, idx, kw = _sfa_inputs()
    sfa = torch_npu.npu_sparse_flash_attention
    with pytest.raises(ValueError, match="npu_sparse_flash_attention: query has D = 256"):
        sfa(q[..., :256], key[..., :256], None, idx, 0.1, **kw)
    with pytest.raises(ValueError, match="npu_sparse_flash_attention: sinks has shape"):
        sfa(q, key, None, idx, 0.1, sinks=torch.zeros(3), **kw)
    with pytest.raises(ValueError, match="npu_sparse_flash_attention: sinks has dtype"):
        sfa(q, key, None, idx, 0.1, sinks=torch.zeros(2, dtype=torch.bfloat16), **kw)
    with pytest.raises(ValueError, match="npu_sparse_flash_attention: sparse_indices has dtype"):
        sfa(q, key, None, idx.long(), 0.1, **kw)
    with pytest.raises(ValueError, match="sparse_indices has a valid entry after an invalid"):
        sfa(q, key, None, idx.flip(-1).contiguous(), 0.1, **kw)
    with pytest.raises(ValueError, match="npu_sparse_flash_attention: attention_mode is 0"):
        sfa(q, key, None, idx, 0.1, **{**kw, "attention_mode": 0})
    with pytest.raises(ValueError, match="npu_sparse_flash_attention: key has block_size 8"):
        sfa(q, key[:, :8], None, idx, 0.1, **{**kw, "key_rope": kw["key_rope"][:, :8]})
    with pytest.raises(ValueError, match="actual_seq_lengths_kv has dtype int64"):
        sfa(q, key, None, idx, 0.1, **{**kw, "actual_seq_lengths_kv": torch.tensor([22])})
    with pytest.raises(TypeError, match="npu_sparse_flash_attention: takes 5 positional"):
        sfa(q, key, None, idx, 0.1, kw["block_table"])


@pytest.mark.parametrize("fake_npu", [223], indirect=True)
def test_sfa_sinks_refused_on_a2(fake_npu):
    import torch_npu
    q, key, idx, kw = _sfa_inputs()
    with pytest.raises(ValueError, match="npu_sparse_flash_attention: sinks is set"):
        torch_npu.npu_sparse_flash_attention(q, key, None, idx, 0.1, sinks=torch.zeros(2), **kw)


def _indexer_inputs(n1=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, n1, 128, generator=g).bfloat16()               # BSND, S1 = 2
    k = torch.randn(1, 5, 1, 128, generator=g).bfloat16()                # BSND, S2 = 5
    w = torch.randn(1, 2, n1, generator=g).bfloat16()
    return q, k, w


def test_lightning_indexer_top_k(fake_npu):
    import torch_npu
    q, k, w = _indexer_inputs()
    ind, val = torch_npu.npu_lightning_indexer(q, k, w, sparse_count=4, return_value=True)
    assert ind.dtype == torch.int32 and ind.shape == (1, 2, 1, 4)
    for i in range(2):                     # rightDownCausal: Lq 2, Lkv 5 -> j <= 3 + i
        visible = 4 + i
        scores = [float(sum(w[0, i, h].float() * torch.relu(q[0, i, h].float() @ k[0, j, 0].float())
                            for h in range(8))) for j in range(visible)]
        best = sorted(range(visible), key=lambda j: -scores[j])[:4]
        assert ind[0, i, 0].tolist() == best
        torch.testing.assert_close(val[0, i, 0].float(),
                                   torch.tensor([scores[j] for j in best]).bfloat16().float())
    ind0, _ = torch_npu.npu_lightning_indexer(q, k, w, sparse_count=6, sparse_mode=0)
    assert ind0[0, 0, 0, 5].item() == -1 and sorted(ind0[0, 0, 0, :5].tolist()) == [0, 1, 2, 3, 4]


def test_lightning_indexer_constraints(fake_npu):
    import torch_npu
    q, k, w = _indexer_inputs()
    li = torch_npu.npu_lightning_indexer
    with pytest.raises(ValueError, match="npu_lightning_indexer: query has N1 = 4"):
        li(*_indexer_inputs(n1=4))
    with pytest.raises(ValueError, match="npu_lightning_indexer: weights is float32"):
        li(q, k, w.float())
    with pytest.raises(ValueError, match="npu_lightning_indexer: sparse_count is 2049"):
        li(q, k, w, sparse_count=2049)
    with pytest.raises(ValueError, match="npu_lightning_indexer: key has N = 2"):
        li(q, k.expand(1, 5, 2, 128), w)
    with pytest.raises(ValueError, match="npu_lightning_indexer: query has D = 64"):
        li(q[..., :64], k[..., :64], w)
    with pytest.raises(TypeError, match="npu_lightning_indexer: unexpected keyword argument"):
        li(q, k, w, topk=4)


def test_sfa_and_indexer_capture_and_replay(fake_npu):
    import torch_npu
    q, key, idx, kw = _sfa_inputs()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        out, _, _ = torch_npu.npu_sparse_flash_attention(q, key, None, idx, 0.07, sparse_mode=0,
                                                         **kw)
    new_idx = torch.tensor([[[[5, 6, -1, -1]], [[1, 2, 3, 4]]]], dtype=torch.int32)
    idx.copy_(new_idx)
    g.replay()
    ref, _, _ = torch_npu.npu_sparse_flash_attention(q, key, None, new_idx, 0.07, sparse_mode=0,
                                                     **kw)
    torch.testing.assert_close(out, ref)
    qi, ki, wi = _indexer_inputs()
    g2 = torch.npu.NPUGraph()
    with torch.npu.graph(g2):
        ind, _ = torch_npu.npu_lightning_indexer(qi, ki, wi, sparse_count=4)
    wi.neg_()
    g2.replay()
    assert torch.equal(ind, torch_npu.npu_lightning_indexer(qi, ki, wi, sparse_count=4)[0])
