"""The nvidia backend's batch-invariant kernel modes: a row's bits do not depend on how many rows share
the launch (dense and FP8 GEMMs), and a query's attention does not depend on the batch's key-list bound
or its number of splits. Bitwise compiled on a GPU (`rows_match`'s gpu variant); under the interpreter
on the CPU (tiny shapes) to rounding, since there the host BLAS does the products."""
from __future__ import annotations

import pytest
import torch

import deepinfer_kernels.sparse_attention as sa
from deepinfer_kernels.dense_gemm import dense_gemm
from deepinfer_kernels.fp8_gemm import fp8_gemm, invariant_plan
from deepinfer_kernels.fp8_quant import act_quant

from test_sparse_attention import TOL, build, check, reference, run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gemm_matches_torch_and_is_row_invariant(kdev, rows_match, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 192, generator=g).to(dtype).to(kdev)
    w = (torch.randn(80, 192, generator=g) * 0.1).to(dtype).to(kdev)
    y = dense_gemm(x, w, torch.float32)
    torch.testing.assert_close(y.cpu(), x.float().cpu() @ w.float().cpu().t(), rtol=1e-5, atol=1e-4)
    for rows in (slice(5, 6), slice(0, 17), slice(20, 37)):
        rows_match(dense_gemm(x[rows], w, torch.float32), y[rows])


def test_dense_gemm_grouped_and_split(kdev, rows_match):
    import deepinfer_kernels.dense_gemm as dg
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2, 512, generator=g).to(kdev)
    w = (torch.randn(2, 16, 512, generator=g) * 0.1).to(kdev)
    want = torch.einsum("tgi,goi->tgo", x.cpu(), w.cpu())
    y = dense_gemm(x, w)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-4)
    assert dg.splits_for(16, 512, 2, dg.FP32_CONFIG, 132) > 1        # this shape takes the split-K path
    rows_match(dense_gemm(x[3:4], w), y[3:4])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        dense_gemm(x.half(), w.half())


def test_fp8_gemm_invariant_plan_is_row_invariant(kdev, rows_match):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 256, generator=g).to(kdev)
    w = (torch.randn(256, 256, generator=g) * 0.05).to(torch.float8_e4m3fn).to(kdev)
    sw = torch.ones(2, 2, device=kdev)
    cfg, splits = invariant_plan(256, 256, torch.device(kdev))
    qa, sa_ = act_quant(x)
    full = fp8_gemm(qa, sa_, w, sw, out_dtype=torch.float32, config=cfg, splits=splits)
    for rows in (slice(0, 1), slice(3, 20), slice(64, 70)):
        q1, s1 = act_quant(x[rows])
        rows_match(fp8_gemm(q1, s1, w, sw, out_dtype=torch.float32, config=cfg, splits=splits), full[rows])
    # default mode changes its tiles with M (which is what the invariant plan prevents)
    assert invariant_plan(256, 256, torch.device(kdev)) == (cfg, splits)


def _one(args, i):
    """Query row i of `args` as a batch of its own (its sequence's slot, table row and start)."""
    s = int(args["token_seq"][i])
    one = dict(args)
    one.update(q=args["q"][i:i + 1], kv=args["kv"][i:i + 1], cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
               seq_start=torch.tensor([int(args["positions"][i])], dtype=torch.int32),
               token_seq=torch.zeros(1, dtype=torch.int32), positions=args["positions"][i:i + 1],
               slots=args["slots"][s:s + 1])
    if "block_table" in args:
        one["block_table"] = args["block_table"][s:s + 1, :]
    if "comp_idx" in args:
        one["comp_idx"] = args["comp_idx"][i:i + 1]
    return one


@pytest.mark.parametrize("comp,official",
                         [("csa", False), ("hca", False), ("csa", True), ("hca", True)])
def test_sparse_attention_invariant_mode(kdev, rows_match, monkeypatch, comp, official):
    """Fixed split size: a decode query gives the same bits alone (fewer splits in the launch, a
    narrower block table) and inside a batch whose longest list needs several splits. `official`:
    the QAT numerics' softmax ending (the sink's term added once, after the splits)."""
    monkeypatch.setattr(sa, "INVARIANT_SPLIT_KEYS", 16)
    args, n_rows = build([(60, 1), (7, 1), (300, 1), (129, 1)], comp=comp, K=12, ratio=4 if comp == "csa" else 8,
                         window=8, seed=12)
    full = run(args, kdev, batch_invariant=True, official=official)
    check(full, reference(args, n_rows, official), TOL[torch.float32])
    for i in range(4):
        one = _one(args, i)
        if comp == "hca":       # this query's own bound only: its table row trimmed to the blocks it has
            need = max(1, -(-int(n_rows[i]) // (128 // 8)))
            one["block_table"] = one["block_table"][:, :need]
        rows_match(run(one, kdev, batch_invariant=True, official=official)[0], full[i])


def test_tile_family_policy(monkeypatch):
    """Where a tile family is known row-equivalent (SM90) the tile follows M within it; elsewhere one
    tile for every M. The split-K count never follows M."""
    import deepinfer_kernels.fp8_gemm as fg
    from deepinfer_kernels.moe import invariant_moe_config
    dev = torch.device("cpu")
    assert fg.invariant_plan(512, 4096, dev, 1) == fg.invariant_plan(512, 4096, dev, 5000)
    monkeypatch.setattr(fg, "wgmma_family", lambda device: True)
    (small, s1), (wide, s2) = fg.invariant_plan(512, 4096, dev, 64), fg.invariant_plan(512, 4096, dev, 65)
    assert small == fg.INVARIANT_CONFIG and wide == fg.INVARIANT_WIDE_CONFIG and s1 == s2 > 1
    assert min(small["BLOCK_M"], wide["BLOCK_M"]) >= 64          # both wgmma tiles
    decode, prefill = invariant_moe_config(8, 8, 256, mma_v2_family=True), invariant_moe_config(4096, 8, 256, mma_v2_family=True)
    assert decode["block_m1"] == 16 and prefill["block_m1"] == 32
    assert invariant_moe_config(8, 8, 256) == invariant_moe_config(4096, 8, 256)            # not measured: one set
    assert max(c["block_m1"] for c in (decode, prefill)) < 64       # never the wgmma set (another family)
