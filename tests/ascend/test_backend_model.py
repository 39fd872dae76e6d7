"""Tiny V4 models through `LLM` on the Ascend backend (the simulated torch_npu of an Ascend 950,
alias mode: the engine picks the `ascend` platform from DEEPINFER_ACCELERATOR, the ops run on the
CPU) against the portable CPU backend (DEEPINFER_ACCELERATOR=cpu, a fresh plugin manager), as the
nvidia backend's tests compare it with the CPU backend:

* the suite's tiny model (head_dim 128, so attention stays portable): bf16 + QAT greedy tokens
  identical, through the pointwise, MXFP8 linear and W4A8 MoE ops;
* the tiny model of `model_fixtures.ascend_config` (head_dim 512, the indexer's documented sizes),
  where every hook the op table maps serves, SFA and the lightning indexer included, as the
  recorded fake calls show: float32 (QAT off, fewer hooks mapped): greedy tokens identical and
  logprobs equal to rounding; bf16, with and without QAT: the logit error against float32 no
  larger than the portable bf16 backend's own (tests/gpu/test_nvidia_backend.py's criterion).
Eager (enforce_eager): decode graphs replay what eager runs and are tested on their own.
"""
from __future__ import annotations

import pytest
import torch
from model_fixtures import (
    LI,
    LINEAR,
    MHC,
    MOE,
    POINTWISE,
    SFA,
    ascend_checkpoint,
    build_pair,
    called,
    greedy,
    random_prompts,
    simulated_ascend,
    teacher_forced,
    use_accelerator,
)

from deepinfer_core import LLM, SamplingParams

PROMPTS = ["To be, or not to be", "Now is the winter of our discontent"]
# 150 tokens: past the 16-token window, 37 CSA rows for a top-4 pick, the first HCA row (128)
LENGTHS = (150, 9, 40)
STEPS = 6
OPTS = dict(num_cache_blocks=8, max_num_seqs=4, num_speculative_tokens=0, enforce_eager=True)
FP4_CODE = 296      # torch_npu.float4_e2m1fn_x2: the W4A8 MX grouped matmul's weight dtype


@pytest.fixture(scope="module")
def ascend(tmp_path_factory):
    """(FakeNpu, MonkeyPatch): the simulated Ascend 950 for this module (see model_fixtures)."""
    with simulated_ascend(tmp_path_factory.mktemp("ascend_platform")) as got:
        yield got


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ascend_checkpoint(tmp_path_factory)


def test_tiny_model_greedy_tokens_equal_the_portable_backend(tiny_ckpt_dir, ascend):
    """The suite's tiny model, bf16 + QAT: the pointwise, MXFP8 linear and W4A8 MoE ops serve
    (attention stays portable: head_dim 128), and its greedy tokens equal the portable backend's
    on these two prompts for six tokens (a near-tie could part two bf16 implementations: the
    bf16 tests below compare logits instead)."""
    from deepinfer_ascend.linear import MxFp8LinearMethod
    from deepinfer_ascend.moe import AscendMoE
    from deepinfer_ascend.pointwise import AscendPointwise
    fake, mp = ascend
    ours, ref = build_pair(tiny_ckpt_dir, mp, dtype="bfloat16", max_num_seqs=2)
    loaded = ours.runner.loaded
    assert isinstance(loaded.ops.pointwise, AscendPointwise)
    assert isinstance(loaded.ops.linear["fp8"], MxFp8LinearMethod)
    assert isinstance(loaded.ops.moe, AscendMoE) and loaded.ops.moe.form == "mx"
    # the tiny model's FP4 experts stay FP4 (W4A8 MXFP), stacked per layer
    ffn = loaded.model.layers[0].ffn
    assert ffn.npu_moe.fmt == "fp4" and ffn.npu_w13.dtype == torch.uint8
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    start = len(fake.calls)
    got = [o.outputs[0].token_ids for o in ours.generate(PROMPTS, params, use_tqdm=False)]
    assert POINTWISE | LINEAR | MOE <= called(fake, start), called(fake, start)
    assert all(args["weight_dtype"] == FP4_CODE for name, args in fake.calls[start:]
               if name == "npu_grouped_matmul")
    assert got == [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]


def test_float32_greedy_tokens_and_logprobs_equal_the_portable_backend(ckpt, ascend):
    """float32, QAT off. The Ascend table serves fewer hooks here, and says so: attention stays
    portable (SFA and the indexer take bf16/fp16), so do the FP8 linears (MXFP8 needs bf16 + QAT)
    and mHC (bf16 streams); what runs on torch_npu is RMSNorm / RoPE and the MoE chain with the
    plain grouped matmul on experts dequantised at load. They compute the portable function to
    float32 rounding: greedy tokens identical, logprobs within 1e-3 (the nvidia attention
    backend's CPU-run test, tests/kernels/test_nvidia_attention_backend.py)."""
    fake, mp = ascend
    ours, ref = build_pair(ckpt, mp, dtype="float32", simulate_qat=False, **OPTS)
    assert type(ours.runner.model.layers[0].attn.backend).__name__ == "PortableAttentionBackend"
    prompts = random_prompts(LENGTHS, seed=3)
    start = len(fake.calls)
    got = greedy(ours, prompts, STEPS, logprobs=3)
    ran = called(fake, start)
    assert POINTWISE | MOE <= ran and not ran & (LINEAR | MHC | {SFA, LI}), ran
    assert all(args["weight_dtype"] is None for name, args in fake.calls[start:]
               if name == "npu_grouped_matmul")
    for w, o in zip(greedy(ref, prompts, STEPS, logprobs=3), got):
        assert o.token_ids == w.token_ids
        for lw, lo in zip(w.logprobs, o.logprobs):
            for tok, v in lw.items():
                assert abs(lo[tok].logprob - v.logprob) < 1e-3


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ||a - ref|| / ||ref|| of the logit rows."""
    return ((a - ref).norm(dim=-1) / ref.norm(dim=-1)).mean()


@pytest.mark.parametrize("qat", [True, False], ids=["qat", "clean"])
def test_bf16_logits_are_as_close_to_float32_as_the_portable_bf16_ones(ckpt, ascend, qat):
    """bf16, the numerics the fused ops need. Every mapped hook serves (the recorded calls): SFA
    and the lightning indexer (a top-4 pick among up to 37 CSA rows), RMSNorm / RoPE, the MoE
    chain; with QAT the MXFP8 linears and the W4A8 MX grouped matmul (mHC portable: the fused
    ops cannot follow the QAT rounding order), without QAT npu_mhc_* (the linears portable).

    Greedy tokens of two bf16 implementations of the random tiny model part ways after a few
    steps (its top logits are nearly tied, one FP8 rounding moves them by percents), so, as
    tests/gpu/test_nvidia_backend.py checks the nvidia backend: on the portable bf16 backend's
    greedy continuations (generated through `LLM`), fed to all three, the Ascend backend's logit
    error against the float32 portable backend (same QAT setting) is at most 1.5x the portable
    bf16 backend's own + 1e-3. Without QAT a dropped attention sink, or an indexer that picks
    the wrong rows, fails it (4.5x); with QAT the FP8 rounding flips between bf16 and float32 are
    noise of the same size as such a bug (1.4x, errors add in quadrature), so the QAT run checks
    the MX linears and experts end to end at that coarse level only (tests/ascend/
    test_backend_ops.py and test_backend_moe.py check them op by op)."""
    from deepinfer_ascend.attention import AscendAttentionBackend
    fake, mp = ascend
    ours, ref = build_pair(ckpt, mp, dtype="bfloat16", simulate_qat=qat, **OPTS)
    use_accelerator(mp, "cpu")
    f32 = LLM(model=str(ckpt), device="cpu", dtype="float32", simulate_qat=qat, **OPTS)
    assert isinstance(ours.runner.model.layers[0].attn.backend, AscendAttentionBackend)
    prompts = random_prompts(LENGTHS, seed=9)
    start = len(fake.calls)
    got = greedy(ours, prompts, STEPS)
    ran = called(fake, start)
    assert POINTWISE | MOE | {SFA, LI} <= ran, ran
    expected, absent = (LINEAR, MHC) if qat else (MHC, LINEAR)
    assert expected <= ran and not ran & absent, ran
    gmm = {args["weight_dtype"] for name, args in fake.calls[start:]
           if name == "npu_grouped_matmul"}
    assert gmm == ({FP4_CODE} if qat else {None}), gmm
    picks = [args for name, args in fake.calls[start:] if name == LI]
    assert max(int(a["actual_seq_lengths_key"].max()) for a in picks) > picks[0]["sparse_count"]
    want = greedy(ref, prompts, STEPS)
    agree = [next((i for i, (a, b) in enumerate(zip(o.token_ids, w.token_ids)) if a != b), STEPS)
             for o, w in zip(got, want)]
    ours_err, ref_err = [], []
    for p, w in zip(prompts, want):
        seq = p + list(w.token_ids)
        exact = teacher_forced(f32, seq)
        ours_err.append(rel_err(teacher_forced(ours, seq), exact))
        ref_err.append(rel_err(teacher_forced(ref, seq), exact))
    oe, re_ = torch.stack(ours_err).mean().item(), torch.stack(ref_err).mean().item()
    assert oe <= 1.5 * re_ + 1e-3, (oe, re_, f"greedy tokens identical up to steps {agree}")
