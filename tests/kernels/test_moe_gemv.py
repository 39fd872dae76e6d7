"""The fused MoE's CUDA-core kernels at decode sizes (deepinfer_kernels.moe_gemv): FP4 experts give
their FP8 re-encoding's bits with 1, 2 and 4 rows per program (the sums' order is fixed whatever the
layout, so this holds compiled and under the interpreter, on any host: no BLAS is involved); the result
is the tensor-core tiles' up to float32 rounding; a row's result does not depend on the rows that share
its program; the tile heuristic takes them only for about one row per expert, never in batch-invariant
mode; bad arguments are refused by name.
"""
from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.moe import expert_outputs, invariant_moe_config, moe_tile_config
from deepinfer_kernels.moe_gemv import gemv_w2
from deepinfer_kernels.moe_routing import route_topk
from test_fp4_experts import E, K, _to, stacked_experts


def run(x, weights, qat: bool, dtype, kdev, config: dict, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    ids, rw = route_topk(torch.randn(x.shape[0], E, generator=gen).to(kdev), K, bias=torch.zeros(E, device=kdev),
                         renormalize=True, routed_scale=1.5, shared_expert=True)
    w13, s13, w2, s2 = [_to(t, kdev) for t in weights]
    return expert_outputs(x.to(kdev, dtype), ids, rw, w13, s13, w2, s2, n_clamped=E, swiglu_limit=0.8, quant_in=qat,
                          quant_mid=qat, compute_dtype=dtype, config=config).cpu()


def gemv(rows: int, block_n: int = 32, warps: int = 4, stages: int = 1) -> dict:
    return dict(gemv_rows=rows, block_n1=block_n, block_n2=block_n, num_warps1=warps, num_warps2=warps,
                gemv_stages=stages)


@pytest.mark.parametrize("rows,qat,dtype,D,I,stages", [(1, True, torch.bfloat16, 256, 128, 3),
                                                       (2, False, torch.float32, 128, 256, 1),
                                                       (4, True, torch.float32, 128, 128, 2)])
def test_fp4_experts_give_the_re_encoded_bits_and_the_tensor_core_result(kdev, rows, qat, dtype, D, I, stages):
    fp8_form, fp4_form = stacked_experts(D, I, seed=D + I + rows)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(rows))
    want = run(x, fp8_form, qat, dtype, kdev, gemv(rows, stages=stages))
    got = run(x, fp4_form, qat, dtype, kdev, gemv(rows, stages=stages))
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want)
    tensor_cores = run(x, fp8_form, qat, dtype, kdev, moe_tile_config(16, 1, 1, cuda_cores=False))
    tol = 1e-5 if dtype == torch.float32 else 2e-2      # bf16: one rounding of g/u/y may flip
    assert ((got.float() - tensor_cores.float()).norm() / tensor_cores.float().norm()).item() < tol


def test_a_row_does_not_depend_on_its_program_neighbours(kdev):
    """Row results with 1, 2 and 4 rows per program, 32- or 64-wide programs, and a software-pipelined K
    loop (the loads move, the sums' order does not): the same bits."""
    fp8_form, _ = stacked_experts(256, 128, seed=3)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    want = run(x, fp8_form, True, torch.float32, kdev, gemv(1))
    for cfg in (gemv(2), gemv(4, block_n=64, warps=2), gemv(1, stages=3), gemv(2, warps=2, stages=2)):
        assert torch.equal(run(x, fp8_form, True, torch.float32, kdev, cfg), want)


def test_the_heuristic_takes_them_by_weight_form_and_for_about_one_row_per_expert(monkeypatch):
    """By `GEMV_TILES` where the mma.sync kernels do not apply (unquantised activations; measured:
    FP4 experts up to batch 64 of V4-Flash, FP8 never); `GEMV_MAX_ROWS` overrides it for both forms
    (0: never) and for either activation form; batch-invariant mode keeps its tensor-core tiles."""
    from deepinfer_kernels import moe
    assert "gemv_rows" not in moe_tile_config(1, 7, 257)
    assert moe_tile_config(1, 7, 257, fp4=True, fp8_activations=False)["gemv_rows"] == 1
    assert moe_tile_config(64, 7, 257, fp4=True, fp8_activations=False)["gemv_rows"] == 2
    assert "gemv_rows" not in moe_tile_config(256, 7, 257, fp4=True, fp8_activations=False)
    assert "gemv_rows" not in moe_tile_config(1, 7, 257, cuda_cores=False, fp4=True)
    monkeypatch.setattr(moe, "GEMV_MAX_ROWS", 2.0)
    assert moe_tile_config(1, 7, 257)["gemv_rows"] == 1
    assert moe_tile_config(64, 7, 257)["gemv_rows"] == 2
    assert "gemv_rows" not in moe_tile_config(256, 7, 257, fp4=True)
    monkeypatch.setattr(moe, "GEMV_MAX_ROWS", 0.0)
    assert "gemv_rows" not in moe_tile_config(1, 7, 257, fp4=True)
    for tokens in (1, 8, 256):      # batch-invariant mode keeps its tensor-core tiles at every size
        assert "gemv_rows" not in invariant_moe_config(tokens, 7, 257, mma_v2_family=True)


def test_sizes_the_kernels_do_not_take_fall_back_to_the_tensor_cores(kdev, monkeypatch):
    """D = 160 is no multiple of 128: the heuristic's CUDA-core choice gives way to tensor-core tiles."""
    from deepinfer_kernels import moe
    monkeypatch.setattr(moe, "GEMV_MAX_ROWS", 2.0)
    assert "gemv_rows" in moe_tile_config(1, K + 1, E + 1)
    fp8_form, _ = stacked_experts(160, 96, seed=2)
    x = torch.randn(1, 160, generator=torch.Generator().manual_seed(2))
    got = run(x, fp8_form, False, torch.float32, kdev, None)
    want = run(x, fp8_form, False, torch.float32, kdev, moe_tile_config(1, 1, 1, cuda_cores=False))
    assert torch.equal(got, want)


def test_bad_arguments_are_refused(kdev):
    fp8_form, _ = stacked_experts(128, 128, seed=1)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="rows=3 must be 1, 2 or 4"):
        run(x, fp8_form, True, torch.float32, kdev, gemv(3))
    with pytest.raises(ValueError, match="stages=0 must be 1, 2, 3 or 4"):
        run(x, fp8_form, True, torch.float32, kdev, gemv(1, stages=0))
    w2, s2 = _to(fp8_form[2], kdev), _to(fp8_form[3], kdev)
    order = torch.zeros(2, dtype=torch.int64, device=kdev)
    with pytest.raises(ValueError, match="block_n=48, which must divide 128"):
        gemv_w2(torch.zeros(2, 128, device=kdev), w2, s2, order, order, 1, out_dtype=torch.float32, rows=1,
                block_n=48)
