"""The nvidia backend's FP8 linear method (act_quant + block-scaled FP8 GEMM) against the core's
portable method with the QAT simulation on: same function, only the summation order differs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.model.layers import Linear
from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.quant import quantize_fp8_block

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
from deepinfer_nvidia.linear import Fp8LinearMethod  # noqa: E402


def make_layer(in_f: int, out_f: int, act_quant: bool, seed: int, block=(128, 128)) -> Linear:
    layer = Linear(in_f, out_f, "fp8", act_quant=act_quant, block=block)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    if block != (128, 128):      # blocks of different magnitudes, so the scale grid matters
        w = w * torch.logspace(-4, 0, 5)[torch.randint(0, 5, layer.scale.shape, generator=g)].repeat_interleave(
            block[0], 0).repeat_interleave(block[1], 1)[:out_f, :in_f]
    q, s = quantize_fp8_block(w, block)
    layer.weight.copy_(q)
    layer.scale.copy_(s)
    return layer


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("tokens,in_f,out_f", [(1, 256, 128), (6, 384, 256), (35, 256, 512)])
def test_fp8_method_equals_the_portable_qat_method(kdev, tokens, in_f, out_f, block):
    """V4's 128x128 weight blocks and V4.1's 32x32 ones both stay FP8 on the GEMM kernel."""
    ours, ref = make_layer(in_f, out_f, True, 1, block), make_layer(in_f, out_f, True, 1, block)
    Fp8LinearMethod(torch.float32, True, block).process_weights(ours)
    PortableLinearMethod(torch.float32, True, block).process_weights(ref)
    assert ours.weight.dtype == torch.float8_e4m3fn          # stays FP8 (1 byte per weight)
    x = torch.randn(2, tokens, in_f, generator=torch.Generator().manual_seed(2)) * 2
    got = Fp8LinearMethod(torch.float32, True, block).apply(ours.to(kdev), x.to(kdev)).cpu()
    want = PortableLinearMethod(torch.float32, True, block).apply(ref, x)
    assert got.shape == want.shape == (2, tokens, out_f)
    # the FP8 tensor cores' short accumulator on a GPU (see test_fp8_kernels.fp8_tolerance)
    assert ((got - want).norm() / want.norm()) < (1e-5 if kdev == "cpu" else 5e-4)


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("act_quant,simulate_qat", [(False, True), (True, False)])
def test_unquantised_activations_keep_fp8_weights(kdev, act_quant, simulate_qat, block):
    """No activation quantisation (a bf16 layer of the reference, or QAT off): the weights stay FP8 and
    the product equals the portable method's dequantised matmul."""
    ours, ref = make_layer(256, 128, act_quant, 3, block), make_layer(256, 128, act_quant, 3, block)
    method = Fp8LinearMethod(torch.float32, simulate_qat, block)
    method.process_weights(ours)
    PortableLinearMethod(torch.float32, simulate_qat, block).process_weights(ref)
    assert ours.weight.dtype == torch.float8_e4m3fn and method.uses_fp8(ours)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    got = method.apply(ours.to(kdev), x.to(kdev)).cpu()
    want = PortableLinearMethod(torch.float32, simulate_qat, block).apply(ref, x)
    assert ((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_fp8_layers_stay_fp8_and_equal_the_dequantised_product(kdev, dtype):
    """V4's wo_a (2 groups of 128 output rows here): the FP8 weights stay resident and are widened in the
    GEMM; the result is the portable method's einsum over the dequantised weights up to summation order.
    Batch-invariant mode keeps the dequantised form (its dense kernel)."""
    ours, ref = Linear(256, 256, "fp8", act_quant=False, groups=2), Linear(256, 256, "fp8", act_quant=False, groups=2)
    q, s = quantize_fp8_block(torch.randn(256, 256, generator=torch.Generator().manual_seed(7)) * 0.05)
    for layer in (ours, ref):
        layer.weight.copy_(q)
        layer.scale.copy_(s)
    method = Fp8LinearMethod(dtype, True)
    method.process_weights(ours)
    PortableLinearMethod(dtype, True).process_weights(ref)
    assert ours.weight.dtype == torch.float8_e4m3fn and method.uses_fp8(ours)
    x = torch.randn(5, 2, 256, generator=torch.Generator().manual_seed(8)).to(dtype)
    got = method.apply_grouped(ours.to(kdev), x.to(kdev)).cpu()
    want = PortableLinearMethod(dtype, True).apply_grouped(ref, x)
    assert got.shape == want.shape == (5, 2, 128) and got.dtype == dtype
    assert ((got.float() - want.float()).norm() / want.float().norm()) < (1e-6 if dtype == torch.float32 else 1e-2)
    invariant = Linear(256, 256, "fp8", act_quant=False, groups=2)
    method.batch_invariant_variant().process_weights(invariant)
    assert invariant.weight.dtype == dtype and not method.uses_fp8(invariant)


def test_fp4_experts_are_re_encoded_to_fp8_exactly(kdev):
    from deepinfer_core.ops.quant import quantize_fp4
    ours, ref = Linear(256, 128, "fp4"), Linear(256, 128, "fp4")
    packed, scale = quantize_fp4(torch.randn(128, 256, generator=torch.Generator().manual_seed(5)) * 0.02)
    for layer in (ours, ref):
        layer.weight.copy_(packed)
        layer.scale.copy_(scale)
    method = Fp8LinearMethod(torch.float32, True)
    method.process_weights(ours)
    PortableLinearMethod(torch.float32, True).process_weights(ref)
    assert ours.weight.dtype == torch.float8_e4m3fn and method.uses_fp8(ours)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    got = method.apply(ours.to(kdev), x.to(kdev)).cpu()
    want = PortableLinearMethod(torch.float32, True).apply(ref, x)
    assert ((got - want).norm() / want.norm()) < (1e-5 if kdev == "cpu" else 5e-4)
