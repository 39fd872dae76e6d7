"""Batch invariance on the nvidia backend (bf16, the QAT numerics, CUDA graphs on): bitwise-equal
logprobs alone, in batches of 2..256 at shuffled positions and under chunked-prefill sizes 1..512;
the same check with the feature off finds differences (so it can fail); 1000 runs of one seeded
sampled request among random traffic give one output. Run on a GPU machine:
`python -m pytest -q -m gpu tests/gpu`."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from deepinfer_batch_invariant.check import random_prompts, repeat_check, run_check
from deepinfer_core import LLM

pytestmark = pytest.mark.gpu      # deselected in CI; on a machine without CUDA these fail, not skip


def _llm(ckpt, invariant: bool) -> LLM:
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    gc.collect()
    torch.cuda.empty_cache()
    return LLM(model=str(ckpt), dtype="bfloat16", device="cuda", batch_invariant=invariant, max_num_seqs=256,
               kv_cache_memory_bytes=2 << 30)


@pytest.fixture(scope="module")
def invariant_llm(tiny_ckpt_dir):
    return _llm(tiny_ckpt_dir, True)


def _targets(llm, n=8):
    return random_prompts(n, random.Random(7), 20, 200, llm.vocab_size)


def test_bitwise_equal_on_cuda(invariant_llm):
    assert invariant_llm.runner.graphs is not None           # decode steps replay CUDA graphs
    layer = invariant_llm.runner.model.layers[0]      # the QAT numerics' kernels (the default)
    backend = layer.attn.backend
    assert backend.batch_invariant and backend.official and layer.mhc.official
    report = run_check(invariant_llm, _targets(invariant_llm), batch_sizes=(2, 3, 8, 64, 256),
                       chunk_sizes=(1, 5, 64, 512))
    print(report.table())
    assert report.all_equal, report.table()


def test_feature_off_differs_on_cuda(tiny_ckpt_dir):
    llm = _llm(tiny_ckpt_dir, False)
    report = run_check(llm, _targets(llm), batch_sizes=(2, 8, 64, 256), chunk_sizes=(5, 64))
    print(report.table())
    del llm
    assert not report.all_equal


def test_1000_seeded_runs_one_output(invariant_llm):
    got = repeat_check(invariant_llm, 1000, batch_range=(1, 32), max_tokens=6)
    print(f"[gpu] {got}")
    assert got["distinct_outputs"] == 1, got


def test_tile_families_used_by_invariant_mode_are_row_equivalent():
    """On SM90 the invariant mode switches tiles by M within families measured to round every row
    identically (benchmarks/tile_equivalence.py); if a compiler or driver change broke that, this fails."""
    from deepinfer_kernels.fp8_gemm import INVARIANT_CONFIG, INVARIANT_WIDE_CONFIG, fp8_gemm, w8a16_gemm
    from deepinfer_kernels.fp8_quant import act_quant
    from deepinfer_kernels.moe import fused_moe, invariant_moe_config
    from deepinfer_kernels.moe_routing import route_topk
    assert torch.cuda.get_device_capability()[0] == 9, "these families were measured on SM90"
    torch.manual_seed(0)
    x = torch.randn(200, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(768, 2048, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    sw = torch.rand(6, 16, device="cuda") + 0.5
    qa, sa = act_quant(x)
    for cfg_a, cfg_b in ((INVARIANT_CONFIG, INVARIANT_WIDE_CONFIG),):
        assert torch.equal(fp8_gemm(qa, sa, w, sw, out_dtype=torch.float32, config=cfg_a, splits=1),
                           fp8_gemm(qa, sa, w, sw, out_dtype=torch.float32, config=cfg_b, splits=1))
        assert torch.equal(w8a16_gemm(x, w, sw, out_dtype=torch.float32, config=cfg_a),
                           w8a16_gemm(x, w, sw, out_dtype=torch.float32, config=cfg_b))
    E, D, I, T = 33, 1024, 512, 256       # 256 x 5 slots over 33 experts: ~39 rows each, the wide set
    w13 = (torch.randn(E, 2, I, D, device="cuda") * 0.03).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2, I // 128, D // 128, device="cuda") + 0.5
    w2 = (torch.randn(E, D, I, device="cuda") * 0.03).to(torch.float8_e4m3fn)
    s2 = torch.rand(E, D // 128, I // 128, device="cuda") + 0.5
    xm = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids, rw = route_topk(torch.randn(T, E - 1, device="cuda"), 4, bias=torch.zeros(E - 1, device="cuda"),
                         shared_expert=True)
    small, large = invariant_moe_config(1, 1, E, mma_v2_family=True), invariant_moe_config(T, 5, E, mma_v2_family=True)
    assert small != large
    outs = [fused_moe(xm, ids, rw, w13, s13, w2, s2, n_clamped=E - 1, swiglu_limit=10.0, quant_in=q, quant_mid=q,
                      compute_dtype=torch.bfloat16, config=c) for q in (True, False) for c in (small, large)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
