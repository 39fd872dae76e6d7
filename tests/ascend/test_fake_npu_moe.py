"""npu_moe_gating_top_k, npu_moe_init_routing_v2, npu_moe_token_unpermute, npu_grouped_matmul:
reference values against hand / loop formulas, and one broken documented constraint per case."""
from __future__ import annotations

import math

import pytest
import torch

I32 = torch.int32
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _gating_by_hand(x, bias, k, k_group, groups, norm_type, mode, scale=1.0, eps=1e-20):
    """Per-row loops: norm, biased selection scores, group ranking, top-k, renormalised y."""
    ys, ids = [], []
    e = x.shape[1]
    size = e // groups
    for row in x.double().tolist():
        if norm_type == 0:
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            s = [math.exp(v - m) / z for v in row]
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
        sel = [s[j] + (0.0 if bias is None else float(bias[j])) for j in range(e)]
        gs = []
        for g in range(groups):
            vals = sorted(sel[g * size:(g + 1) * size], reverse=True)
            gs.append(vals[0] if mode == 0 else vals[0] + vals[1])
        best = sorted(range(groups), key=lambda g: -gs[g])[:k_group]
        cand = [j for j in range(e) if j // size in best]
        top = sorted(cand, key=lambda j: -sel[j])[:k]
        total = sum(s[j] for j in top)
        ys.append([s[j] / (total + eps) * scale for j in top])
        ids.append(top)
    return torch.tensor(ys), torch.tensor(ids)


@pytest.mark.parametrize("norm_type,mode", [(1, 1), (0, 0)])
def test_gating_top_k_groups_bias_against_loops(fake_npu, norm_type, mode):
    import torch_npu
    g = torch.Generator().manual_seed(norm_type)
    x = torch.randn(3, 12, generator=g)
    bias = torch.randn(12, generator=g)
    y, ids, norm = torch_npu.npu_moe_gating_top_k(
        x, 3, bias=bias, k_group=2, group_count=3, group_select_mode=mode, norm_type=norm_type,
        out_flag=True, routed_scaling_factor=2.5)
    ry, rids = _gating_by_hand(x, bias, 3, 2, 3, norm_type, mode, scale=2.5)
    assert ids.dtype == I32 and y.dtype == x.dtype and norm.dtype == torch.float32
    assert ids.tolist() == rids.tolist()
    torch.testing.assert_close(y.double(), ry.double(), rtol=1e-5, atol=1e-6)
    want = torch.softmax(x, -1) if norm_type == 0 else torch.sigmoid(x)
    torch.testing.assert_close(norm, want)
    # expert 0 is the best single expert, but with top-2 sums (mode 1) its group ranks last
    x = torch.tensor([[5.0, -5, -5, -5, 2, 2.1, 2.2, 2.3, 1.5, 1.6, 1.7, 1.8]])
    _, ids, _ = torch_npu.npu_moe_gating_top_k(x, 3, k_group=2, group_count=3,
                                               group_select_mode=mode, norm_type=norm_type)
    assert ids.tolist() == _gating_by_hand(x, None, 3, 2, 3, norm_type, mode)[1].tolist()
    assert (0 in ids[0].tolist()) == (mode == 0)


def test_gating_top_k_hash_mode_and_out_flag(fake_npu):
    import torch_npu
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]]).bfloat16()
    tid2eid = torch.tensor([[0, 3], [2, 1], [1, 0]], dtype=I32)
    y, ids, norm = torch_npu.npu_moe_gating_top_k(
        x, 2, input_ids=torch.tensor([2, 0]), tid2eid=tid2eid, norm_type=1)
    assert ids.tolist() == [[1, 0], [0, 3]]
    s = torch.sigmoid(x.float())
    want = torch.stack([s[0, [1, 0]], s[1, [0, 3]]])
    torch.testing.assert_close(y.float(), (want / want.sum(-1, keepdim=True)).bfloat16().float())
    assert torch.isnan(norm).all()                       # out_flag False: not output


def test_gating_top_k_constraints(fake_npu):
    import torch_npu
    x = torch.randn(2, 12)
    op = torch_npu.npu_moe_gating_top_k
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: k is 9"):
        op(x, 9, k_group=2, group_count=3)               # > 12 / 3 * 2
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: group_count is 6"):
        op(x, 2, group_count=6)                          # 2 experts per group: not > 2
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: renorm is 1"):
        op(x, 2, renorm=1)
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: norm_type is 2"):
        op(x, 2, norm_type=2)
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: bias has dtype bfloat16"):
        op(x, 2, bias=torch.zeros(12, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: input_ids and tid2eid"):
        op(x, 2, input_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: tid2eid has an expert id"):
        op(x, 2, input_ids=torch.tensor([0, 0]), tid2eid=torch.tensor([[0, 12]]))
    with pytest.raises(ValueError, match="npu_moe_gating_top_k: x has 4096 experts"):
        op(torch.randn(1, 4096), 2, group_count=2)
    with pytest.raises(TypeError, match="npu_moe_gating_top_k: unexpected keyword argument 'topk'"):
        op(x, 2, topk=2)


def _route(**kw):
    import torch_npu
    x = torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])
    idx = torch.tensor([[2, 0], [1, 2], [0, 1]], dtype=I32)     # flat: 2 0 1 2 0 1
    args = dict(expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True) | kw
    return x, torch_npu.npu_moe_init_routing_v2(x, idx, **args)


def test_init_routing_v2_by_hand(fake_npu):
    x, (ex, row_idx, counts, sc) = _route(scale=torch.tensor([10.0, 20.0, 30.0]))
    order = [1, 4, 2, 5, 0, 3]                  # stable by expert: e0 {1,4} e1 {2,5} e2 {0,3}
    assert torch.equal(ex, x[[o // 2 for o in order]])
    assert row_idx.dtype == I32 and row_idx.tolist() == [4, 0, 2, 5, 1, 3]   # [order[i]] = i
    assert counts.dtype == torch.int64 and counts.tolist() == [2, 2, 2, 0]
    assert sc.tolist() == [10.0 * (1 + o // 2) for o in order]
    _, (_, scatter_idx, cum, sc) = _route(row_idx_type=1, expert_tokens_num_type=0)
    assert scatter_idx.tolist() == order and cum.tolist() == [2, 4, 6, 6]
    assert torch.isnan(sc).all()                                  # no scale: undefined
    _, (_, _, pairs, _) = _route(expert_tokens_num_type=2, active_expert_range=[1, 4])
    assert pairs.tolist() == [[1, 2], [2, 2], [0, 0], [0, 0]]
    _, (ex, row_idx, counts, _) = _route(active_expert_range=[1, 3], active_num=5)
    assert row_idx.tolist() == [2, -1, 0, 3, -1, 1] and counts.tolist() == [2, 2]
    assert ex.shape == (5, 2) and torch.equal(ex[:4], x[[1, 2, 0, 1]]) and not ex[4].any()


def test_init_routing_then_unpermute_round_trip(fake_npu):
    import torch_npu
    x, (ex, row_idx, _, _) = _route()
    probs = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 2.0]])
    out = torch_npu.npu_moe_token_unpermute(ex * 2, row_idx, probs=probs)
    torch.testing.assert_close(out, 2 * x * probs.sum(1, keepdim=True))


def test_init_routing_v2_constraints(fake_npu):
    import torch_npu
    op = torch_npu.npu_moe_init_routing_v2
    x, idx = torch.zeros(2, 4), torch.tensor([[0, 1], [1, 3]], dtype=I32)
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: expert_idx has dtype int64"):
        op(x, idx.long(), expert_num=4)
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: expert_idx has an id out"):
        op(x, idx, expert_num=3)
    with pytest.raises(NotImplementedError, match="quant_mode 3"):
        op(x, idx, expert_num=4, quant_mode=3)
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: quant_mode is 10"):
        op(x, idx, expert_num=4, quant_mode=10)
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: drop_pad_mode is 1"):
        op(x, idx, expert_num=4, drop_pad_mode=1, expert_capacity=2)
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: active_expert_range is"):
        op(x, idx, expert_num=4, active_expert_range=[3, 1])
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: scale has shape \\(2, 1\\)"):
        op(x, idx, expert_num=4, scale=torch.ones(2, 1))
    with pytest.raises(ValueError, match="npu_moe_init_routing_v2: expert_num is -1"):
        op(x, idx)
    with pytest.raises(TypeError, match="npu_moe_init_routing_v2: takes 2 positional"):
        op(x, idx, None)


def test_unpermute_doc_example_and_weights(fake_npu):
    import torch_npu
    rows = torch.tensor([[1.0], [2.0], [3.0], [4.0]]).repeat(2, 2).half()
    idx = torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=I32)
    out = torch_npu.npu_moe_token_unpermute(rows, idx, probs=torch.ones(4, 2).half() / 2)
    assert out.dtype == torch.float16 and out.tolist() == [[1, 1], [2, 2], [3, 3], [4, 4]]
    p = torch.randn(6, 3)
    probs = torch.rand(3, 2)
    idx = torch.tensor([5, 0, 3, 1, 4, 2], dtype=I32)
    out = torch_npu.npu_moe_token_unpermute(p, idx, probs=probs)
    want = torch.stack([probs[t, 0] * p[idx[2 * t]] + probs[t, 1] * p[idx[2 * t + 1]]
                        for t in range(3)])
    torch.testing.assert_close(out, want)
    assert torch.equal(torch_npu.npu_moe_token_unpermute(p, idx), p[idx.long()])   # K = 1


def test_unpermute_constraints(fake_npu):
    import torch_npu
    op = torch_npu.npu_moe_token_unpermute
    p, idx, probs = torch.zeros(4, 2), torch.tensor([1, 0, 3, 2], dtype=I32), torch.ones(2, 2)
    with pytest.raises(ValueError, match="npu_moe_token_unpermute: sorted_indices has dtype"):
        op(p, idx.long(), probs=probs)
    with pytest.raises(ValueError, match="npu_moe_token_unpermute: sorted_indices is not a perm"):
        op(p, torch.tensor([1, 1, 3, 2], dtype=I32), probs=probs)
    with pytest.raises(ValueError, match="npu_moe_token_unpermute: padded_mode is True"):
        op(p, idx, probs=probs, padded_mode=True)
    with pytest.raises(ValueError, match="npu_moe_token_unpermute: probs has shape \\(3, 2\\)"):
        op(p, idx, probs=torch.ones(3, 2))
    with pytest.raises(ValueError, match="npu_moe_token_unpermute: permuted_tokens has dtype"):
        op(p.to(torch.int32), idx, probs=probs)
    with pytest.raises(TypeError, match="npu_moe_token_unpermute: unexpected keyword argument"):
        op(p, idx, weights=probs)


def _gmm_loop(x, w, ends):
    """Row m of group e (ends[e-1] <= m < ends[e]) times w[e]; double precision loops."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        for m in range(start, end):
            out[m] = x[m].double() @ w[e].double()
        start = end
    return out


@pytest.mark.parametrize("fake_npu", [223, 260], indirect=True)
def test_grouped_matmul_bf16_cumsum_and_counts(fake_npu):
    import torch_npu
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=g).bfloat16()
    w = torch.randn(3, 2, 4, generator=g).bfloat16().transpose(1, 2)   # [E, N, K] weight, viewed
    for gl, gtype in (([2, 2, 5], 0), ([2, 0, 3], 1)):
        (y,) = torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor(gl), split_item=3,
                                            group_type=0, group_list_type=gtype)
        assert y.dtype == torch.bfloat16 and y.shape == (5, 2)
        torch.testing.assert_close(y.double(), _gmm_loop(x, w, [2, 2, 5]).bfloat16().double())


def _mx(seed, m=3, k=64, n=2, e=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-6, 7, (m, k), generator=g).float().to(torch.float8_e4m3fn)
    ps = torch.randint(124, 130, (m, k // 64, 2), generator=g).to(torch.uint8)
    ws = torch.randint(124, 130, (e, k // 64, n, 2), generator=g).to(torch.uint8)
    return g, x, ps, ws


def _scaled(x, ps, w, ws):
    """Dequantised operands by hand: 2^(code - 127) per 32 along K."""
    k = x.shape[1]
    xd = torch.stack([torch.tensor([float(x[i, j]) * 2.0 ** (int(ps[i, j // 64, j // 32 % 2]) - 127)
                                    for j in range(k)]) for i in range(x.shape[0])])
    wd = w.double().clone()
    for e in range(w.shape[0]):
        for j in range(k):
            for c in range(w.shape[2]):
                wd[e, j, c] *= 2.0 ** (int(ws[e, j // 64, c, j // 32 % 2]) - 127)
    return xd, wd


def test_grouped_matmul_w8a8_mxfp8(fake_npu):
    import torch_npu
    g, x, ps, ws = _mx(1)
    w = torch.randint(-6, 7, (2, 64, 2), generator=g).float().to(torch.float8_e4m3fn)
    (y,) = torch_npu.npu_grouped_matmul(
        [x], [w], scale=[ws], per_token_scale=[ps], group_list=torch.tensor([1, 2]),
        split_item=2, group_type=0, group_list_type=1, output_dtype=torch.bfloat16,
        scale_dtype=torch_npu.float8_e8m0fnu, per_token_scale_dtype=torch_npu.float8_e8m0fnu)
    xd, wd = _scaled(x, ps, w, ws)
    torch.testing.assert_close(y.double(), _gmm_loop(xd, wd, [1, 3]).bfloat16().double())


def test_grouped_matmul_w4a8_mxfp(fake_npu):
    import torch_npu
    g, x, ps, ws = _mx(2)
    codes = torch.randint(0, 16, (2, 64, 2), generator=g)                  # [E, K, N] fp4 codes
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)      # [E, K/2, N]
    w = torch.tensor([[[E2M1[c & 7] * (-1 if c >= 8 else 1) for c in row] for row in mat]
                      for mat in codes.tolist()])
    (y,) = torch_npu.npu_grouped_matmul(
        [x], [packed], antiquant_scale=[ws], per_token_scale=[ps], group_list=torch.tensor([2, 3]),
        split_item=3, group_type=0, output_dtype=torch.bfloat16, weight_dtype=296,
        per_token_scale_dtype=torch_npu.float8_e8m0fnu)
    xd, wd = _scaled(x, ps, w, ws)
    torch.testing.assert_close(y.double(), _gmm_loop(xd, wd, [2, 3]).bfloat16().double())


def test_grouped_matmul_constraints(fake_npu):
    import torch_npu
    op = torch_npu.npu_grouped_matmul
    x, w = torch.zeros(5, 4).bfloat16(), torch.zeros(3, 4, 2).bfloat16()
    ok = dict(group_list=torch.tensor([2, 2, 5]), split_item=2, group_type=0)
    with pytest.raises(ValueError, match="npu_grouped_matmul: group_list is not non-decreasing"):
        op([x], [w], **{**ok, "group_list": torch.tensor([3, 2, 5])})
    with pytest.raises(ValueError, match="npu_grouped_matmul: group_list ends at 4"):
        op([x], [w], **{**ok, "group_list": torch.tensor([2, 2, 4])})
    with pytest.raises(ValueError, match="npu_grouped_matmul: group_list sums to 4"):
        op([x], [w], **{**ok, "group_list": torch.tensor([2, 0, 2]), "group_list_type": 1})
    with pytest.raises(ValueError, match="npu_grouped_matmul: group_list has dtype int32"):
        op([x], [w], **{**ok, "group_list": torch.tensor([2, 2, 5], dtype=I32)})
    with pytest.raises(ValueError, match="npu_grouped_matmul: split_item is 0 with group_type 0"):
        op([x], [w], **{**ok, "split_item": 0})
    with pytest.raises(ValueError, match="npu_grouped_matmul: group_type is None"):
        op([x], [w], **{**ok, "group_type": None})
    with pytest.raises(ValueError, match="npu_grouped_matmul: weight has dtype float16"):
        op([x], [w.half()], **ok)
    with pytest.raises(TypeError, match="npu_grouped_matmul: unexpected keyword argument"):
        op([x], [w], group_lists=torch.tensor([2, 2, 5]))
    g, x8, ps, ws = _mx(3, m=5, e=3)
    w8 = torch.zeros(3, 64, 2, dtype=torch.float8_e4m3fn)
    mx = dict(ok, scale=[ws], per_token_scale=[ps], output_dtype=torch.bfloat16, scale_dtype=293,
              per_token_scale_dtype=293)
    op([x8], [w8], **mx)
    with pytest.raises(ValueError, match="npu_grouped_matmul: scale has shape \\(3, 2, 1, 2\\)"):
        op([x8], [w8], **{**mx, "scale": [ws.transpose(1, 2)]})
    with pytest.raises(ValueError, match="npu_grouped_matmul: scale_dtype is 44"):
        op([x8], [w8], **{**mx, "scale_dtype": torch.float8_e8m0fnu})
    w4 = torch.zeros(3, 32, 2, dtype=torch.uint8)
    w4a8 = dict(ok, antiquant_scale=[ws], per_token_scale=[ps], output_dtype=torch.bfloat16,
                weight_dtype=296, per_token_scale_dtype=293)
    op([x8], [w4], **w4a8)
    with pytest.raises(ValueError, match="npu_grouped_matmul: weight_dtype is None"):
        op([x8], [w4], **{**w4a8, "weight_dtype": None})
    with pytest.raises(ValueError, match="npu_grouped_matmul: output_dtype is 6"):
        op([x8], [w4], **{**w4a8, "output_dtype": torch.float32})
    with pytest.raises(ValueError, match="npu_grouped_matmul: weight has shape \\(3, 64, 2\\)"):
        op([x8], [torch.zeros(3, 64, 2, dtype=torch.uint8)], **w4a8)


@pytest.mark.parametrize("fake_npu", [223], indirect=True)
def test_grouped_matmul_mx_is_a5_only(fake_npu):
    import torch_npu
    _, x, ps, ws = _mx(4, m=2, e=1)
    with pytest.raises(ValueError, match="npu_grouped_matmul: soc_version is 223"):
        torch_npu.npu_grouped_matmul(
            [x], [torch.zeros(1, 64, 2, dtype=torch.float8_e4m3fn)], scale=[ws],
            per_token_scale=[ps], group_list=torch.tensor([2]), split_item=2, group_type=0,
            output_dtype=torch.bfloat16, scale_dtype=293, per_token_scale_dtype=293)


def test_moe_chain_capture_and_replay(fake_npu):
    import torch_npu
    g = torch.Generator().manual_seed(5)
    logits, x = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
    w = torch.randn(8, 3, 2, generator=g)

    def moe():
        y, ids, _ = torch_npu.npu_moe_gating_top_k(logits, 2, norm_type=1)
        ex, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
            x, ids, expert_num=8, expert_tokens_num_type=1, expert_tokens_num_flag=True)
        (h,) = torch_npu.npu_grouped_matmul([ex], [w], group_list=counts, split_item=2,
                                            group_type=0, group_list_type=1)
        return torch_npu.npu_moe_token_unpermute(h, row_idx, probs=y), y, ids

    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out, _, _ = moe()
    logits.copy_(torch.randn(4, 8, generator=g))
    graph.replay()
    ref, y, ids = moe()
    torch.testing.assert_close(out, ref)
    want = torch.stack([sum(y[t, j] * x[t] @ w[ids[t, j]] for j in range(2)) for t in range(4)])
    torch.testing.assert_close(ref, want)
