"""The Ascend backend's op table and its torch_npu mappings on the simulated device (alias mode:
the fake torch_npu computes each op's documented result on CPU tensors). Each mapping must give
the core's portable op's values, and call the torch_npu op with documented arguments."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.layers import Linear
from deepinfer_core.model.rope import RotaryTable
from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.portable_pointwise import PortablePointwise
from deepinfer_core.ops.quant import dequant_fp8_block, e8m0_to_float, quantize_fp8_block
from deepinfer_core.plugin_context import BuildContext, Platform
from deepinfer_core.tools.tiny_config import tiny_config_dict

BF16 = torch.bfloat16


def make_ctx(dtype="bfloat16", simulate_qat=True, device="cpu", **cfg) -> BuildContext:
    return BuildContext(model_config=ModelConfig.from_dict(tiny_config_dict(**cfg)),
                        platform=Platform("ascend", "npu", plugin="ascend"), device=device,
                        dtype=dtype, simulate_qat=simulate_qat)


def calls(fake, op):
    return [args for name, args in fake.calls if name == op]


# ---- the op table --------------------------------------------------------------------------------
@pytest.mark.parametrize("fake_npu,family", [(260, "A5"), (223, "A2"), (253, "A3")],
                         indirect=["fake_npu"])
def test_op_table_per_soc(npu, fake_npu, family):
    from deepinfer_ascend.linear import MxFp8LinearMethod
    from deepinfer_ascend.pointwise import AscendPointwise
    ctx = make_ctx()
    npu.deepinfer_configure(ctx)
    pointwise = npu.deepinfer_pointwise_method(ctx)
    assert isinstance(pointwise, AscendPointwise)
    assert npu.deepinfer_pointwise_method(ctx) is pointwise          # built once, then reused
    fp8 = npu.deepinfer_linear_method(ctx, "fp8")
    assert isinstance(fp8, MxFp8LinearMethod) == (family == "A5"), fp8
    assert npu.deepinfer_linear_method(ctx, "bf16") is None           # the core's method
    assert npu.deepinfer_linear_method(ctx, "fp4") is None
    from deepinfer_ascend import op_table, runtime
    table = op_table.table_for(runtime.started(), ctx)
    assert table.soc_family == family and "attention" in table.portable
    assert ("no MX formats" in table.portable["linear"]) == (family != "A5")


@pytest.mark.parametrize("dtype,qat", [("float32", True), ("bfloat16", False)])
def test_mx_linear_needs_bf16_and_the_qat_numerics(npu, fake_npu, dtype, qat):
    ctx = make_ctx(dtype=dtype, simulate_qat=qat)
    assert npu.deepinfer_linear_method(ctx, "fp8") is None
    assert npu.deepinfer_pointwise_method(ctx) is not None


def test_hooks_decline_other_platforms_and_the_host_cpu(npu, fake_npu, monkeypatch):
    ctx = make_ctx()
    ctx.platform = Platform("cpu", "cpu")
    assert npu.deepinfer_pointwise_method(ctx) is None
    from deepinfer_ascend import runtime
    runtime.reset()
    monkeypatch.setattr(runtime, "DEVICE_TYPE", "npu")      # a real NPU, but the model on the host
    assert npu.deepinfer_pointwise_method(make_ctx(device="cpu")) is None


# ---- pointwise: RMSNorm and RoPE -----------------------------------------------------------------
def _pointwise(npu, official):
    ctx = make_ctx(simulate_qat=official)
    return npu.deepinfer_pointwise_method(ctx), PortablePointwise(official=official)


def _close(got, want, dtype):
    """tests/kernels/test_pointwise.py's agreement: |diff| <= rtol * (|even| + |odd|) of the
    output pair (a rotated channel may cancel to ~0), rtol 4 eps(bf16) or 2^-18 (float32)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol = 4 * torch.finfo(BF16).eps if dtype == BF16 else 2 ** -18
    pairs = want.float().unflatten(-1, (-1, 2)).abs().sum(-1, keepdim=True)
    mag = pairs.expand(*pairs.shape[:-1], 2).flatten(-2)
    bad = (got.float() - want.float()).abs() > rtol * mag + 1e-30
    assert not bad.any(), f"{int(bad.sum())} elements off, max {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("shape", [(5, 256), (3, 4, 128)])
def test_rms_norm_equals_the_portable_op(npu, fake_npu, dtype, shape):
    ours, ref = _pointwise(npu, False)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    _close(ours.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    (args,) = calls(fake_npu, "npu_rms_norm")
    assert args["input"] is x and args["gamma"] is w and args["epsilon"] == 1e-6


@pytest.mark.parametrize("official", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("norm,quant,shape", [
    ("head", "none", (6, 4, 128)),            # attention queries [T, H, Dh]
    ("weighted", "fp8_nope", (6, 128)),       # the shared K=V row
    ("weighted", "hadamard_fp4", (6, 64)),    # a compressed indexer key
    ("none", "hadamard_fp4", (6, 2, 64)),     # indexer queries
    ("weighted", "none", (6, 128)),
])
def test_norm_rope_quant_equals_the_portable_op(npu, fake_npu, official, dtype, norm, quant,
                                                shape):
    ours, ref = _pointwise(npu, official)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    positions = torch.randint(0, 5000, (shape[0],), generator=g)
    cfg = ModelConfig.from_dict(tiny_config_dict())
    rope = RotaryTable(64, 160000.0, cfg.rope_scaling, official=official)
    kw = dict(norm=norm, weight=w, eps=1e-6)
    _close(ours.norm_rope_quant(x, positions, rope, **kw),       # before the fake-quant
           ref.norm_rope_quant(x, positions, rope, **kw), dtype)
    if quant != "none":
        # the same fake-quant (the core's) on inputs equal to rounding: only a value that sits on
        # a rounding boundary may land in the neighbouring FP8/FP4 bucket
        got = ours.norm_rope_quant(x, positions, rope, quant=quant, **kw)
        want = ref.norm_rope_quant(x, positions, rope, quant=quant, **kw)
        q = shape[-1] - 64 if quant == "fp8_nope" else shape[-1]     # the quantised channels
        assert got.dtype == want.dtype and (got[..., :q] != want[..., :q]).float().mean() < 0.02
        if q < shape[-1]:
            _close(got[..., q:], want[..., q:], dtype)                  # RoPE dims: unquantised
    rot = calls(fake_npu, "npu_rotary_mul")[0]
    assert rot["rotary_mode"] == "interleave" and rot["rotate"] is None
    assert tuple(rot["input"].shape) == (shape[0], shape[1] if len(shape) == 3 else 1, 1, 64)
    assert tuple(rot["r1"].shape) == tuple(rot["r2"].shape) == (shape[0], 1, 1, 64)
    norms = calls(fake_npu, "npu_rms_norm")
    runs = 1 if quant == "none" else 2
    assert len(norms) == runs * (norm == "weighted" or (norm == "head" and not official))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_inverse_rope_equals_the_portable_op(npu, fake_npu, dtype):
    ours, ref = _pointwise(npu, False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 4, 128, generator=g).to(dtype)
    positions = torch.arange(7) * 97
    rope = RotaryTable(64, 10000.0, None)
    got = ours.inverse_rope(x, positions, rope)
    _close(got, ref.inverse_rope(x, positions, rope), dtype)
    back = ours.rope(got.float(), positions, rope)            # the forward undoes it
    torch.testing.assert_close(back[..., -64:], x.float()[..., -64:], atol=3e-2, rtol=0)
    (first, _) = calls(fake_npu, "npu_rotary_mul")
    cos, sin = rope.cos_sin(positions)
    assert torch.equal(first["r2"].view(7, 64)[:, ::2], -sin)   # -sin: the inverse rotation
    assert torch.equal(first["r1"].view(7, 64)[:, 1::2], cos)


# ---- linear: MXFP8 -------------------------------------------------------------------------------
def make_layer(in_f, out_f, block, seed, act_quant=True, groups=1):
    layer = Linear(in_f, out_f, "fp8", act_quant=act_quant, block=block, groups=groups)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    # blocks of different magnitudes, so the scale grid matters
    mags = torch.logspace(-4, 0, 5)[torch.randint(0, 5, layer.scale.shape, generator=g)]
    w = w * mags.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out_f, :in_f]
    q, s = quantize_fp8_block(w, block)
    layer.weight.copy_(q)
    layer.scale.copy_(s)
    return layer


def test_weight_scales_repeat_exactly_into_the_mx_layout(npu, fake_npu):
    from deepinfer_ascend.mx import weight_mx_scale
    cases = (((128, 128), (256, 384)), ((32, 32), (96, 160)), ((128, 128), (200, 200)))
    for block, (N, K) in cases:
        layer = make_layer(K, N, block, 3)
        mx = weight_mx_scale(layer.scale, N, K, block)
        assert mx.dtype == torch.uint8 and tuple(mx.shape) == (-(-K // 64), N, 2)
        per32 = e8m0_to_float(mx.permute(1, 0, 2).flatten(1)).repeat_interleave(32, 1)[:, :K]
        assert torch.equal(layer.weight.float() * per32,
                           dequant_fp8_block(layer.weight, layer.scale, block, torch.float32))


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("tokens,in_f,out_f", [(1, 256, 128), (6, 384, 256), (35, 256, 192)])
def test_mx_linear_equals_the_portable_qat_method(npu, fake_npu, block, tokens, in_f, out_f):
    method = npu.deepinfer_linear_method(make_ctx(), "fp8")
    method.block = block       # the table's block is the model's; here V4's and V4.1's
    ours, ref = make_layer(in_f, out_f, block, 1), make_layer(in_f, out_f, block, 1)
    method.process_weights(ours)
    PortableLinearMethod(BF16, True, block).process_weights(ref)
    assert ours.weight.dtype == torch.float8_e4m3fn                  # stays FP8
    x = (torch.randn(2, tokens, in_f, generator=torch.Generator().manual_seed(2)) * 2).to(BF16)
    got = method.apply(ours, x)
    want = PortableLinearMethod(BF16, True, block).apply(ref, x)
    assert got.shape == want.shape == (2, tokens, out_f) and got.dtype == BF16
    # same products, fp32 sums in another order, one bf16 rounding each: at most 1 ulp apart
    ulp = torch.finfo(BF16).eps * want.float().abs()
    assert ((got.float() - want.float()).abs() <= ulp).all()
    (args,) = calls(fake_npu, "npu_quant_matmul")
    assert args["group_sizes"] == [1, 1, 32] and args["output_dtype"] == 15       # bfloat16
    assert args["scale_dtype"] == args["pertoken_scale_dtype"] == 293            # float8_e8m0fnu
    assert args["x1"].dtype == args["x2"].dtype == torch.float8_e4m3fn
    assert tuple(args["pertoken_scale"].shape) == (2 * tokens, -(-in_f // 64), 2)
    # each per-128 activation scale broadcast to its four 32-groups
    codes = args["pertoken_scale"].flatten(1)
    assert torch.equal(codes[:, 0::4], codes[:, 3::4])


@pytest.mark.parametrize("act_quant,groups", [(False, 1), (True, 2)])
def test_other_fp8_layers_run_the_portable_method(npu, fake_npu, act_quant, groups):
    method = npu.deepinfer_linear_method(make_ctx(), "fp8")
    ours, ref = make_layer(256, 256, (128, 128), 4, act_quant, groups), \
        make_layer(256, 256, (128, 128), 4, act_quant, groups)
    method.process_weights(ours)
    portable = PortableLinearMethod(BF16, True, (128, 128))
    portable.process_weights(ref)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(BF16)
    if groups > 1:
        xg = x.view(3, groups, -1)
        assert torch.equal(method.apply_grouped(ours, xg), portable.apply_grouped(ref, xg))
    else:
        assert torch.equal(method.apply(ours, x), portable.apply(ref, x))
    assert not calls(fake_npu, "npu_quant_matmul")


# ---- mHC -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fake_npu,qat,served", [(260, False, True), (260, True, False),
                                                  (223, False, False)], indirect=["fake_npu"])
def test_mhc_on_the_npu_ops_equals_the_portable_op(npu, fake_npu, qat, served):
    from deepinfer_core.ops.portable_mhc import PortableMHC
    ctx = make_ctx(simulate_qat=qat)
    ours = npu.deepinfer_mhc_method(ctx)
    assert (ours is not None) == served
    if not served:
        return
    c = ctx.model_config
    ref = PortableMHC(c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, False)
    g = torch.Generator().manual_seed(6)
    n, D, T = c.hc_mult, c.hidden_size, 5
    x = torch.randn(T, n, D, generator=g).to(BF16)
    fn = torch.randn(n * n + 2 * n, n * D, generator=g) * 0.02
    scale, base = torch.tensor([1.0, 0.5, 0.8]), torch.randn(n * n + 2 * n, generator=g) * 0.1
    got, want = ours.pre(x, fn, scale, base), ref.pre(x, fn, scale, base)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2 ** -18, atol=0)      # the same fp32 formulas
    f = torch.randn(T, D, generator=g).to(BF16)
    torch.testing.assert_close(ours.post(f, x, want[1], want[2]),
                               ref.post(f, x, want[1], want[2]), rtol=0, atol=0)
    (pre,) = calls(fake_npu, "npu_mhc_pre")
    assert pre["gamma"] is None and pre["phi"] is fn and pre["hc_eps"] == c.hc_eps
    (sk,) = calls(fake_npu, "npu_mhc_sinkhorn")
    assert sk["num_iters"] == c.hc_sinkhorn_iters and sk["eps"] == c.hc_eps
    (post,) = calls(fake_npu, "npu_mhc_post")
    assert torch.equal(post["h_res"], want[2].transpose(-1, -2))    # comb transposed
