"""FP4 experts at prefill sizes (deepinfer_kernels.moe: `_by_fp8_chunks`): the experts are decoded to
their FP8 re-encoding a chunk at a time (`fp4_experts.decode_experts`: the load-time re-encoding's
bytes) and each chunk runs the FP8 tensor-core tiles, so the result is the FP8 experts' bit for bit,
whatever the chunk size; the heuristic takes that path above the mma.sync kernels' sizes only.
"""
from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import moe
from deepinfer_kernels.fp4_experts import decode_experts
from deepinfer_kernels.moe import invariant_moe_config, moe_tile_config
from test_fp4_experts import E, K, _to, stacked_experts
from test_moe_gemv import run
from test_moe_mma import wide_experts


@pytest.mark.parametrize("spread", [None, 14])
def test_decoded_experts_are_the_re_encoded_bytes(kdev, spread):
    """spread 14: group scales down to e4m3 subnormals in the re-encoding."""
    fp8_form, fp4_form = stacked_experts(256, 128, seed=2) if spread is None else wide_experts(128, 128, spread, 3)
    w13, s13, w2, s2 = [_to(t, kdev) for t in fp4_form]
    assert torch.equal(decode_experts(w13, s13, 1, 3).cpu().view(torch.uint8), fp8_form[0][1:3].view(torch.uint8))
    assert torch.equal(decode_experts(w2, s2, 0, E).cpu().view(torch.uint8), fp8_form[2][:E].view(torch.uint8))
    with pytest.raises(ValueError, match=r"experts \[2, 5\) must lie in the 4 FP4 experts"):
        decode_experts(w2, s2, 2, 5)


@pytest.mark.parametrize("qat,dtype,chunk_experts", [(True, torch.bfloat16, 1), (False, torch.float32, 3),
                                                     (True, torch.float32, 8)])
def test_prefill_sizes_give_the_fp8_experts_bits(kdev, monkeypatch, qat, dtype, chunk_experts):
    D, I, T = 128, 128, 40                      # 40 tokens x 3 slots over 5 experts: 24 rows per expert
    monkeypatch.setattr(moe, "FP8_CHUNK_BYTES", chunk_experts * 3 * I * D)
    monkeypatch.setattr(moe, "FP8_CHUNK_ROWS", 16.0)
    cfg = moe_tile_config(T, K + 1, E + 1, fp4=True, fp8_activations=qat)
    assert cfg.get("fp8_chunks") and "mma_warps" not in cfg
    fp8_form, fp4_form = stacked_experts(D, I, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    got = run(x, fp4_form, qat, dtype, kdev, None)
    want = run(x, fp8_form, qat, dtype, kdev, moe_tile_config(T, K + 1, E + 1, cuda_cores=False))
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want)


def test_the_heuristic_decodes_in_chunks_only_above_its_rows():
    """`FP8_CHUNK_ROWS` (48 mean rows per expert: V4-Flash prefills above ~1.8k tokens); the mma.sync
    kernels up to 16; the FP4 tensor-core tiles between."""
    assert moe_tile_config(16384, 7, 257, fp4=True)["fp8_chunks"]
    assert moe_tile_config(4096, 7, 257, fp4=True)["fp8_chunks"]
    assert "fp8_chunks" not in moe_tile_config(1024, 7, 257, fp4=True)
    assert moe_tile_config(512, 7, 257, fp4=True) == {"mma_warps": 4, "mma_prefetch": False}
    assert "fp8_chunks" not in moe_tile_config(4096, 7, 257)
    assert "fp8_chunks" not in invariant_moe_config(4096, 7, 257)


def test_expert_outputs_write_into_a_given_output_or_refuse_it(kdev):
    """`out`: the chunks write their pairs into one tensor; rows of ids outside every expert (-1) keep
    what was there; a tensor of the wrong shape is refused by name."""
    D, I, T = 128, 128, 6
    _, fp4_form = stacked_experts(D, I, seed=9)
    w13, s13, w2, s2 = [_to(t, kdev) for t in fp4_form]
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(9)).to(kdev)
    ids = torch.tensor([[0, 2, E]] * T, dtype=torch.int32, device=kdev)
    ids[0, 1] = -1
    kw = dict(n_clamped=E, swiglu_limit=0.0, quant_in=True, quant_mid=True, compute_dtype=torch.float32)
    out = torch.full((T, K + 1, D), 7.0, device=kdev)
    got = moe.expert_outputs(x, ids, torch.ones(T, K + 1, device=kdev), w13, s13, w2, s2, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert (out[0, 1] == 7.0).all() and not (out[1, 1] == 7.0).all()
    with pytest.raises(ValueError, match="out must be a contiguous"):
        moe.expert_outputs(x, ids, torch.ones(T, K + 1, device=kdev), w13, s13, w2, s2, out=out[:, :2], **kw)
