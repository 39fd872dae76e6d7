"""The nvidia backend's MoE on DeepSeek-V4.1 layers (the tiny V4.1 checkpoint's own: FP4 routed
experts, FP8 in 32x32 blocks elsewhere, a SwiGLU-clamped shared expert) against the core's portable
MoE, the methods bound as the nvidia plugin binds them (the FP8 block is the config's
`weight_block_size`):

* the routed experts are stacked (re-encoded to FP8, or all kept FP4 with `fp4_experts`) and run on
  the grouped GEMMs; the shared expert, whose 32x32 power-of-two scales 128x128 blocks cannot hold
  exactly in general, stays out of the stacks and runs through its own linear layers (FP8 GEMMs
  over 32x32 blocks), clamp included, its output summed first as the stacked one's is; an
  expert-parallel world of one gives the same bits;
* V4's shared expert (128x128 blocks) is still stacked, and clamped there when the model clamps it;
* unservable experts are refused before any stack is allocated; FP4 linears are re-encoded to FP8
  whatever the FP8 block size.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.deepseek_v4 import build_model
from deepinfer_core.model.layers import Linear
from deepinfer_core.model.weights import load_checkpoint
from deepinfer_core.parallel.expert_map import ExpertPlacement

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
from deepinfer_nvidia.fused_spec import FusedAway  # noqa: E402
from deepinfer_nvidia.linear import Fp8LinearMethod  # noqa: E402
from deepinfer_nvidia.moe import NvidiaMoEMethod, _stack_experts  # noqa: E402
from test_moe import SMALL, E, config, inputs, make_moe, prepare, rel, run, tolerance  # noqa: E402
from test_moe_ep import apply, prepare_ep  # noqa: E402


@pytest.fixture(scope="module")
def v41(tiny_v41_dir):
    """(config, a MoE layer of the tiny V4.1 checkpoint as loaded)."""
    cfg = ModelConfig.from_file(tiny_v41_dir)
    model = build_model(cfg, device="meta")
    load_checkpoint(model, tiny_v41_dir)
    return cfg, model.layers[3].ffn


def v41_inputs(cfg: ModelConfig, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations large enough that the SwiGLU clamp (10.0) binds, the shared expert's included."""
    x, tok = inputs(T, seed, D=cfg.hidden_size)
    return x * 4, tok


def linears(expert) -> tuple[Linear, Linear, Linear]:
    return expert.w1, expert.w3, expert.w2


@pytest.mark.parametrize("qat,fp4,tiles", [
    (True, False, SMALL), (False, False, SMALL), (True, True, SMALL), (True, True, None)],
    ids=["qat", "noqat", "fp4kept", "fp4kept-heuristic"])
def test_v41_routed_experts_fuse_and_the_shared_expert_runs_beside(kdev, v41, qat, fp4, tiles):
    cfg, layer = v41
    n, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    block = cfg.weight_block_size
    ours = prepare(copy.deepcopy(layer), True, qat, tiles=tiles, fp4_experts=fp4, block=block)
    ref = prepare(copy.deepcopy(layer), False, qat, block=block)
    spec = ours.nv_fused
    assert NvidiaMoEMethod.fused(ours) and not spec.shared_stacked and spec.n_routed == n
    assert spec.n_fp4 == (n if fp4 else 0) and ours.nv_w13.shape == (n - spec.n_fp4, 2, I, D)
    assert ours.nv_s13.shape[0] == ours.nv_s2.shape[0] == n
    # the stacks clamp the routed experts only; the shared expert clamps itself (Expert.forward)
    assert spec.clamp_shared and spec.n_clamped == n
    assert ours.shared_experts.swiglu_limit == cfg.swiglu_limit
    assert all(isinstance(lin.method, FusedAway) and lin.weight.numel() == 0
               for ex in ours.experts for lin in linears(ex))
    assert all(isinstance(lin.method, Fp8LinearMethod) and lin.method.uses_fp8(lin)     # FP8 GEMMs over
               and lin.weight.dtype == torch.float8_e4m3fn for lin in linears(ours.shared_experts))  # 32x32
    x, tok = v41_inputs(cfg, 5, 1)
    with torch.no_grad():
        assert (ref.shared_experts.w3(x).abs() > cfg.swiglu_limit).any()      # the clamp binds
        want = ref(x, tok)
    got = run(ours, x, tok, kdev)           # (fails on any host synchronisation)
    assert got.shape == (5, D) and rel(got, want) < tolerance(kdev)


def test_v41_fp4_experts_kept_fp4_give_the_re_encoded_bits(kdev, v41):
    """Every stacked expert FP4 (no FP8 expert at all): bit for bit the FP8 re-encoding's result."""
    cfg, layer = v41
    fp4 = prepare(copy.deepcopy(layer), True, True, fp4_experts=True, block=cfg.weight_block_size)
    fp8 = prepare(copy.deepcopy(layer), True, True, block=cfg.weight_block_size)
    assert fp4.nv_w13.numel() == 0 and fp8.nv_w13.shape[0] == cfg.n_routed_experts
    x, tok = v41_inputs(cfg, 4, 2)
    assert torch.equal(run(fp4, x, tok, kdev), run(fp8, x, tok, kdev))


def test_v41_expert_parallel_world_of_one_gives_the_single_process_bits(kdev, v41):
    """`NvidiaEPExperts.shared` runs the unstacked shared expert through its linears, as `apply`."""
    cfg, layer = v41
    placement = ExpertPlacement.initial(cfg.num_hidden_layers, cfg.n_routed_experts, 1, 0)
    ep = prepare_ep(copy.deepcopy(layer), placement, True, fp4=True, block=cfg.weight_block_size)
    one = prepare(copy.deepcopy(layer), True, True, fp4_experts=True, block=cfg.weight_block_size)
    assert NvidiaMoEMethod.fused(ep) and not ep.nv_fused.shared_stacked
    x, tok = v41_inputs(cfg, 9, 3)
    assert torch.equal(apply(ep, x, tok, kdev), apply(one, x, tok, kdev))


@pytest.mark.parametrize("clamped", [False, True], ids=["v4", "clamped"])
def test_a_shared_expert_in_128_blocks_stays_stacked(kdev, clamped):
    """V4's shared expert is expert E of the stacks (its linears fused away), unclamped; a clamped
    one in 128x128 blocks (V4.1's semantics) is clamped by the grouped GEMMs' epilogue."""
    base = make_moe(config(), False, seed=80)
    if clamped:
        base.shared_experts.swiglu_limit = base.experts[0].swiglu_limit
    ours, ref = prepare(copy.deepcopy(base), True, True), prepare(base, False, True)
    spec = ours.nv_fused
    assert spec.shared_stacked and ours.nv_w13.shape[0] == E + 1 and spec.n_clamped == E + clamped
    assert all(isinstance(lin.method, FusedAway) for lin in linears(ours.shared_experts))
    x, tok = inputs(4, 81)
    assert rel(run(ours, x, tok, kdev), ref(x, tok)) < tolerance(kdev)


def test_unservable_experts_are_refused_before_anything_is_allocated(v41, monkeypatch):
    """`_stack_experts` with an FP8 expert in 32x32 blocks (V4.1's shared expert) returns None
    without allocating a stack (a stack of V4.1's would be tens of GB)."""
    cfg, layer = v41
    moe = copy.deepcopy(layer)
    method = Fp8LinearMethod(torch.float32, True, cfg.weight_block_size)
    for lin in moe.modules():
        if isinstance(lin, Linear):
            lin.method = method
    trios = [linears(ex) for ex in moe.experts]

    def no_allocation(*args, **kwargs):
        raise AssertionError("a stack was allocated")

    monkeypatch.setattr(torch, "empty", no_allocation)
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    assert _stack_experts(trios + [linears(moe.shared_experts)], I, D, 0) is None
    monkeypatch.undo()
    assert _stack_experts(trios, I, D, 0)["nv_w13"].shape == (cfg.n_routed_experts, 2, I, D)


def test_fp4_linears_are_re_encoded_whatever_the_fp8_block_size(v41):
    """With V4.1's 32x32 FP8 blocks, FP4 weights (scales per 32 inputs) still become FP8 in 128x128
    blocks (where exact); FP8 ones stay FP8 in their 32x32 blocks."""
    cfg, layer = v41
    moe = copy.deepcopy(layer)
    method = Fp8LinearMethod(torch.bfloat16, True, cfg.weight_block_size)
    fp4, fp8 = moe.experts[0].w1, moe.shared_experts.w1
    for lin in (fp4, fp8):
        lin.method = method
        method.process_weights(lin)
    assert method.uses_fp8(fp4) and fp4.weight.dtype == torch.float8_e4m3fn
    assert fp4.fp8_block == (128, 128) and fp4.fp8_scale.shape == (-(-fp4.out_features // 128),
                                                                     -(-fp4.in_features // 128))
    assert method.uses_fp8(fp8) and fp8.weight.dtype == torch.float8_e4m3fn and fp8.fp8_block == (32, 32)
    assert fp8.fp8_scale.shape == (-(-fp8.out_features // 32), -(-fp8.in_features // 32))
