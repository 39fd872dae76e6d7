"""The fused MoE's decode kernels on mma.sync fragments built in registers (deepinfer_kernels.moe_mma):
FP4 experts give their FP8 re-encoding's bits (the same e4m3 operands in the same fragments), e4m3
subnormals included; the result is the tensor-core tiles' up to float32 rounding; a row's result does
not depend on the rows that share its tile; unquantised activations fall back to the tensor-core
tiles; bad arguments are refused by name. Compiled on a GPU (inline PTX) and under the interpreter
(its emulation of the same fragments).
"""
from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.fp4_experts import Fp4Experts, to_resident
from deepinfer_kernels.moe import expert_outputs, moe_tile_config
from deepinfer_kernels.moe_mma import mma_w2
from deepinfer_kernels.moe_routing import route_topk
from test_fp4_experts import E, K, _to, random_fp4, stacked_experts
from test_moe_gemv import run

from deepinfer_core.ops.quant import e8m0_to_float, fp4_to_fp8_block, quantize_fp8_block


def mma(warps: int = 2, prefetch: bool = True) -> dict:
    return dict(mma_warps=warps, mma_prefetch=prefetch)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("D,I,T,dtype,warps,prefetch", [(256, 128, 5, torch.bfloat16, 2, False),
                                                        (128, 256, 3, torch.float32, 1, True),
                                                        (384, 256, 21, torch.float32, 4, True)])
def test_fp4_experts_give_the_re_encoded_bits_and_the_tensor_core_result(kdev, D, I, T, dtype, warps, prefetch):
    """T = 21 on 4 experts + the shared one: experts with more than one 8-row tile."""
    fp8_form, fp4_form = stacked_experts(D, I, seed=D + I + T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    want = run(x, fp8_form, True, dtype, kdev, mma(warps, prefetch))
    got = run(x, fp4_form, True, dtype, kdev, mma(warps, prefetch))
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want)
    tensor_cores = run(x, fp8_form, True, dtype, kdev, moe_tile_config(16, 1, 1, cuda_cores=False))
    assert rel(got, tensor_cores) < (1e-5 if dtype == torch.float32 else 2e-2)


def wide_experts(D: int, I: int, spread: int, seed: int):
    """Random FP4 routed experts whose group scales span `spread` binades (e4m3 subnormals in the
    re-encoding) and an FP8 shared expert: (FP8 form, FP4 form) as `stacked_experts` gives them."""
    gen = torch.Generator().manual_seed(seed)
    forms: dict[str, list] = {"fp8": [], "fp4": []}
    for rows, (n, k) in (((2,), (I, D)), ((), (D, I))):
        per_expert = rows[0] if rows else 1
        codes, groups = zip(*[random_fp4(n, k, gen, spread) for _ in range(E * per_expert)])
        q, s = [], []
        for c, g in zip(codes, groups):
            qe, se = fp4_to_fp8_block(c.view(torch.int8), g)
            q.append(qe)
            s.append(e8m0_to_float(se))
        for _ in range(per_expert):
            w, sc = quantize_fp8_block(torch.randn(n, k, generator=gen) * k ** -0.5)
            q.append(w)
            s.append(e8m0_to_float(sc))
        w8 = torch.stack(q).view(E + 1, *rows, n, k)
        s8 = torch.stack(s).view(E + 1, *rows, *s[0].shape)
        packed = torch.stack(codes).view(E, *rows, n, k // 2)
        scales = torch.stack(groups).view(E, *rows, n, k // 32)
        forms["fp8"] += [w8, s8]
        forms["fp4"] += [Fp4Experts(*to_resident(packed, scales), w8[E:].contiguous()), s8]
    return forms["fp8"], forms["fp4"]


def test_groups_down_to_e4m3_subnormals_keep_the_bits(kdev):
    fp8_form, fp4_form = wide_experts(128, 128, spread=14, seed=5)
    assert (fp8_form[0][:E].view(torch.uint8) & 0x78 == 0).logical_and(fp8_form[0][:E].view(torch.uint8) & 7 != 0).any()
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(6))
    want = run(x, fp8_form, True, torch.float32, kdev, mma(4))
    assert torch.equal(run(x, fp4_form, True, torch.float32, kdev, mma(4)), want)
    assert rel(want, run(x, fp8_form, True, torch.float32, kdev, moe_tile_config(16, 1, 1, cuda_cores=False))) < 1e-5


def test_a_row_does_not_depend_on_the_rows_sharing_its_tile(kdev):
    """Tokens alone and inside a batch of 7 (tiles of several tokens), 2 or 4 warps, loads ahead or
    not: the same bits."""
    _, fp4_form = stacked_experts(128, 128, seed=9)
    w13, s13, w2, s2 = [_to(t, kdev) for t in fp4_form]
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(9)).to(kdev)
    ids, rw = route_topk(torch.randn(7, E, generator=torch.Generator().manual_seed(8)).to(kdev), K,
                         bias=torch.zeros(E, device=kdev), renormalize=True, routed_scale=1.5, shared_expert=True)

    def outputs(rows: slice, cfg: dict) -> torch.Tensor:
        return expert_outputs(x[rows], ids[rows], rw[rows], w13, s13, w2, s2, n_clamped=E, swiglu_limit=0.8,
                              quant_in=True, quant_mid=True, compute_dtype=torch.float32, config=cfg).cpu()

    batch = outputs(slice(0, 7), mma(2))
    for i in (0, 3, 6):
        assert torch.equal(outputs(slice(i, i + 1), mma(4, False))[0], batch[i])


def test_the_heuristic_takes_them_for_fp4_experts_with_fp8_activations(monkeypatch):
    """`MMA_TILES`: FP4 experts up to 16 rows per expert (batch ~590 of V4-Flash) when the activations
    are FP8; FP8 experts keep their tensor-core tiles; the CUDA-core override and batch-invariant mode
    keep theirs."""
    from deepinfer_kernels import moe
    for tokens in (1, 64, 512):
        assert moe_tile_config(tokens, 7, 257, fp4=True) == {"mma_warps": 4, "mma_prefetch": False}
    assert "mma_warps" not in moe_tile_config(1024, 7, 257, fp4=True)
    assert "mma_warps" not in moe_tile_config(1, 7, 257)
    assert "mma_warps" not in moe_tile_config(1, 7, 257, fp4=True, fp8_activations=False)
    assert "mma_warps" not in moe_tile_config(1, 7, 257, fp4=True, cuda_cores=False)
    monkeypatch.setattr(moe, "GEMV_MAX_ROWS", 0.0)
    assert "mma_warps" not in moe_tile_config(1, 7, 257, fp4=True)


def test_unquantised_activations_take_the_other_tiles(kdev):
    """An mma config with unquantised activations: FP8 experts get the tensor-core tiles, FP4 ones the
    CUDA-core kernels at this size (what the heuristic picks without FP8 activations)."""
    fp8_form, fp4_form = stacked_experts(128, 128, seed=4)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    want = run(x, fp8_form, False, torch.float32, kdev, moe_tile_config(1, 1, 1, cuda_cores=False))
    assert torch.equal(run(x, fp8_form, False, torch.float32, kdev, mma(2)), want)
    cuda_cores = moe_tile_config(3, K + 1, E + 1, fp4=True, fp8_activations=False)
    assert "gemv_rows" in cuda_cores
    assert torch.equal(run(x, fp4_form, False, torch.float32, kdev, mma(2)),
                       run(x, fp4_form, False, torch.float32, kdev, cuda_cores))


def test_bad_arguments_are_refused(kdev):
    fp8_form, _ = stacked_experts(128, 128, seed=1)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="num_warps=8 must be 1, 2 or 4"):
        run(x, fp8_form, True, torch.float32, kdev, mma(8))
    w2, s2 = _to(fp8_form[2], kdev), _to(fp8_form[3], kdev)
    order = torch.zeros(2, dtype=torch.int64, device=kdev)
    with pytest.raises(ValueError, match="activations must be float8_e4m3fn"):
        mma_w2(torch.zeros(2, 128, device=kdev), torch.ones(2, 1, device=kdev), w2, s2, order, order, 1,
               out_dtype=torch.float32)
