"""The Ascend MoE method (npu_moe_init_routing_v2 -> npu_grouped_matmul -> V4's clamped SwiGLU ->
npu_grouped_matmul -> npu_moe_token_unpermute, routing portable) on the simulated device: the
same tiny layer through the core's PortableMoE and PortableLinearMethod must give the same output
(bf16 + QAT: tests/kernels/test_moe.py's CPU agreement between the nvidia method and the portable
one; fp32: to rounding), for FP8 (128x128 and 32x32 blocks) and FP4 experts and a hash-routed
layer; the recorder shows the documented arguments; the op table's choice per SoC; one capture +
replay in the fake NPUGraph; the expert-parallel seam on one rank."""
from __future__ import annotations

import copy

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.layers import Linear
from deepinfer_core.model.moe import MoE
from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.portable_moe import PortableMoE
from deepinfer_core.ops.quant import quantize_fp4, quantize_fp8_block
from deepinfer_core.plugin_context import BuildContext, Platform
from deepinfer_core.tools.tiny_config import tiny_config_dict

BF16, F32 = torch.bfloat16, torch.float32
E, K = 4, 2                 # routed experts, top-k


def make_ctx(dtype=BF16, qat=True, expert="fp8", block=(128, 128), D=128, inter=128):
    qc = dict(tiny_config_dict()["quantization_config"], weight_block_size=list(block))
    cfg = tiny_config_dict(hidden_size=D, moe_intermediate_size=inter, n_routed_experts=E,
                           num_experts_per_tok=K, swiglu_limit=0.8, expert_dtype=expert,
                           quantization_config=qc)
    return BuildContext(model_config=ModelConfig.from_dict(cfg), device="cpu",
                        platform=Platform("ascend", "npu", plugin="ascend"),
                        dtype={BF16: "bfloat16", F32: "float32"}[dtype], simulate_qat=qat)


def make_moe(cfg: ModelConfig, hash_routed: bool, seed: int) -> MoE:
    """tests/kernels/test_moe.py's tiny layer: random gate, bias / hash table, quantised weights."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg, 0, hash_routed)
    n, D = cfg.n_routed_experts, cfg.hidden_size
    moe.gate.weight.copy_((torch.randn(n, D, generator=g) * D ** -0.5).to(BF16))
    if hash_routed:
        moe.gate.tid2eid.copy_(torch.rand(cfg.vocab_size, n, generator=g).argsort(1)[:, :K])
    else:
        moe.gate.bias.copy_(torch.randn(n, generator=g) * 0.1)
    for lin in (m for m in moe.modules() if isinstance(m, Linear)):
        w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
        q, s = (quantize_fp8_block(w, cfg.weight_block_size) if lin.fmt == "fp8"
                else quantize_fp4(w, 32))
        lin.weight.copy_(q)
        lin.scale.copy_(s)
    return moe


def prepare(moe: MoE, moe_method, linear: dict) -> MoE:
    """Bind as the core does, process weights in model order (the MoE before its linears)."""
    moe.method = moe_method
    for m in moe.modules():
        if isinstance(m, Linear):
            m.method = linear[m.fmt]
    for m in moe.modules():
        if isinstance(m, (Linear, MoE)):
            m.method.process_weights(m)
    return moe


def pair(npu, ctx, hash_routed, seed):
    """(ours: the op table's methods, ref: the core's portable ones) on the same layer."""
    cfg, dtype, qat = ctx.model_config, ctx.torch_dtype, ctx.simulate_qat
    base = make_moe(cfg, hash_routed, seed)
    portable = PortableLinearMethod(dtype, qat, cfg.weight_block_size)
    ours = prepare(copy.deepcopy(base), npu.deepinfer_moe_method(ctx),
                   {f: npu.deepinfer_linear_method(ctx, f) or portable for f in ("fp8", "fp4")})
    return ours, prepare(base, PortableMoE(), {"fp8": portable, "fp4": portable})


def inputs(T, seed, dtype, D=128):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, D, generator=g) * 2).to(dtype), torch.randint(0, 129280, (T,),
                                                                          generator=g)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def calls(fake, op):
    return [args for name, args in fake.calls if name == op]


# ---- the op table --------------------------------------------------------------------------------
@pytest.mark.parametrize("fake_npu", [260, 223, 253], indirect=True)
def test_op_table_moe_per_soc(npu, fake_npu):
    from deepinfer_ascend import op_table, runtime
    from deepinfer_ascend.moe import AscendMoE
    forms = {}
    for dtype, qat, expert, block in ((BF16, True, "fp8", (128, 128)), (BF16, True, "fp4", None),
                                      (BF16, True, "fp8", (32, 32)), (BF16, False, "fp8", None),
                                      (F32, True, "fp4", None), (F32, False, "fp8", None)):
        ctx = make_ctx(dtype, qat, expert, block or (128, 128))
        npu.deepinfer_configure(ctx)
        method = npu.deepinfer_moe_method(ctx)
        assert npu.deepinfer_moe_method(ctx) is method                  # built once
        table = op_table.table_for(runtime.started(), ctx)
        assert "moe routing" in table.portable and ("moe" in table.portable) == (method is None)
        forms[dtype, qat, expert, block] = method.form if isinstance(method, AscendMoE) else None
    if fake_npu.soc_version != 260:
        assert set(forms.values()) == {None}          # A2/A3: the core's portable MoE
        return
    assert forms == {(BF16, True, "fp8", (128, 128)): "mx", (BF16, True, "fp4", None): "mx",
                     (BF16, True, "fp8", (32, 32)): "mx", (BF16, False, "fp8", None): "plain",
                     (F32, True, "fp4", None): "plain", (F32, False, "fp8", None): "plain"}


# ---- the layer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("expert,block,hash_routed,dtype,qat,T", [
    ("fp8", (128, 128), False, BF16, True, 5),      # W8A8 MXFP8, V4's blocks
    ("fp8", (32, 32), True, BF16, True, 3),         # W8A8 MXFP8, V4.1's blocks, hash-routed
    ("fp4", (128, 128), True, BF16, True, 4),       # W4A8 MXFP (kept FP4), hash-routed
    ("fp4", (128, 128), False, F32, False, 5),      # plain fp32 grouped matmul
    ("fp8", (128, 128), True, F32, True, 3),        # plain fp32, QAT activations in torch
    ("fp8", (128, 128), False, BF16, False, 6),     # plain bf16
])
def test_moe_equals_the_portable_moe(npu, fake_npu, expert, block, hash_routed, dtype, qat, T):
    ctx = make_ctx(dtype, qat, expert, block, D=128, inter=192 if expert == "fp8" else 128)
    ours, ref = pair(npu, ctx, hash_routed, seed=T)
    spec = ours.npu_moe
    mx = dtype == BF16 and qat
    assert spec.form == ("mx" if mx else "plain")
    inter, D = ctx.model_config.moe_intermediate_size, 128
    want_dtype = {"mx": torch.float8_e4m3fn if expert == "fp8" else torch.uint8}.get(spec.form,
                                                                                       dtype)
    assert ours.npu_w13.dtype == ours.npu_w2.dtype == want_dtype            # FP8 / FP4 kept
    cols = D // 2 if spec.form == "mx" and expert == "fp4" else D
    assert ours.npu_w13.shape == (E, 2 * inter, cols)
    assert all(ex.w1.weight.numel() == 0 for ex in ours.experts)            # not doubled
    x, tok = inputs(T, T + 1, dtype)
    fake_npu.calls.clear()
    with torch.no_grad():
        got, want = ours(x, tok), ref(x, tok)
    assert got.shape == want.shape == (T, D) and got.dtype == want.dtype == dtype
    # bf16: test_moe.py's CPU agreement (fp32 sums in another order, bf16 roundings of g/u/y);
    # fp32: to rounding
    assert rel(got, want) < (1e-3 if dtype == BF16 else 1e-6), rel(got, want)

    _, idx = PortableMoE.route(ref.gate, x, tok)
    (route,) = calls(fake_npu, "npu_moe_init_routing_v2")
    assert torch.equal(route["x"], x) and torch.equal(route["expert_idx"], idx.int())
    assert route["expert_idx"].dtype == torch.int32 and route["expert_num"] == E
    assert (route["active_num"], route["expert_tokens_num_type"], route["row_idx_type"],
            route["expert_tokens_num_flag"], route["quant_mode"]) == (T * K, 1, 0, True, -1)
    gmm1, gmm2 = calls(fake_npu, "npu_grouped_matmul")
    counts = torch.bincount(idx.flatten(), minlength=E)
    for args, k_in, n_out in ((gmm1, D, 2 * inter), (gmm2, inter, D)):
        assert torch.equal(args["group_list"], counts) and args["group_list"].dtype == torch.int64
        assert (args["group_type"], args["group_list_type"], args["split_item"]) == (0, 1, 2)
        (xs,), (w,) = args["x"], args["weight"]
        assert xs.shape == (T * K, k_in) and w.shape[0] == E and w.shape[2] == n_out
        if spec.form == "plain":
            assert xs.dtype == w.dtype == dtype and args["scale"] is None
            continue
        assert xs.dtype == torch.float8_e4m3fn and args["output_dtype"] == 15        # bf16
        (ps,) = args["per_token_scale"]
        assert ps.shape == (T * K, -(-k_in // 64), 2) and args["per_token_scale_dtype"] == 293
        codes = ps.flatten(1)[:, :k_in // 32]    # each per-128 scale over its four 32-groups
        assert torch.equal(codes, codes[:, ::4].repeat_interleave(4, 1)[:, :k_in // 32])
        if expert == "fp8":
            assert args["scale_dtype"] == 293 and args["scale"][0].shape == (E, k_in // 64,
                                                                              n_out, 2)
        else:
            assert args["weight_dtype"] == 296 and args["scale"] is None
            assert args["antiquant_scale"][0].shape == (E, k_in // 64, n_out, 2)
    (unperm,) = calls(fake_npu, "npu_moe_token_unpermute")
    assert unperm["permuted_tokens"].dtype == F32 and unperm["permuted_tokens"].shape == (T * K, D)
    assert torch.equal(unperm["probs"], torch.ones(T, K)) and unperm["padded_mode"] is False
    # sorted_indices: init_routing's row_idx (slot t*K+j -> row of the expert-sorted rows)
    order = torch.argsort(idx.flatten(), stable=True)
    assert torch.equal(unperm["sorted_indices"].long(), torch.argsort(order))
    # the shared expert ran through the op table's linear method
    assert len(calls(fake_npu, "npu_quant_matmul")) == (3 if mx else 0)


def test_capture_and_replay_in_the_npu_graph(npu, fake_npu):
    ctx = make_ctx(BF16, True, "fp8")
    ours, ref = pair(npu, ctx, False, seed=7)
    x, tok = inputs(4, 8, BF16)
    graph = torch.npu.NPUGraph()
    with torch.no_grad(), torch.npu.graph(graph):        # host syncs raise during capture
        out = ours(x, tok)
    new, _ = inputs(4, 9, BF16)
    x.copy_(new)
    graph.replay()
    with torch.no_grad():
        assert torch.equal(out, ours(x, tok))
        assert rel(out, ref(x, tok)) < 1e-3


def test_layers_the_method_cannot_stack_stay_portable(npu, fake_npu):
    """Experts already processed by a linear method: the per-expert layers stay, the core's MoE
    runs them."""
    ctx = make_ctx(BF16, True, "fp8")
    method = npu.deepinfer_moe_method(ctx)
    x, tok = inputs(3, 11, BF16)
    base = make_moe(ctx.model_config, False, 12)
    portable = PortableLinearMethod(BF16, True)
    for lin in base.experts[0].modules():
        if isinstance(lin, Linear):
            portable.process_weights(lin)
    ours = prepare(copy.deepcopy(base), method, {"fp8": portable})
    ref = prepare(base, PortableMoE(), {"fp8": portable})
    assert ours.npu_moe is None and ours.experts[1].w1.weight.numel() > 0
    fake_npu.calls.clear()
    with torch.no_grad():
        assert torch.equal(ours(x, tok), ref(x, tok))
    assert not calls(fake_npu, "npu_grouped_matmul")


# ---- expert parallelism (one rank: the EP seam without a collective) -----------------------------
@pytest.mark.parametrize("expert,hash_routed,dtype,qat", [
    ("fp4", True, BF16, True),       # W4A8 MXFP, hash-routed
    ("fp8", False, BF16, True),      # W8A8 MXFP8
    ("fp8", False, F32, False),      # plain fp32
])
def test_expert_parallel_rank_runs_its_slots_on_the_grouped_matmul(npu, fake_npu, expert,
                                                                   hash_routed, dtype, qat):
    """`EPMoEMethod` around the Ascend method on a world of one with two replicas (E + 2 slots):
    the rank's slots are stacked, the received pairs run on the grouped matmul with the slots as
    groups, and the layer equals the single-process Ascend layer (to rounding: the shared expert is
    added before the routed rows instead of after their sum) and the core's portable MoE. The
    fixed-size exchange (decode graphs) gives the variable exchange's bits, and with padding rows
    routed nowhere the live rows' outputs (a padding row's outputs ride in the last group)."""
    from deepinfer_ascend.ep_experts import AscendEPExperts

    from deepinfer_core.parallel.ep_moe import EPMoEMethod
    from deepinfer_core.parallel.expert_map import ExpertPlacement
    ctx = make_ctx(dtype, qat, expert, D=128, inter=128)
    cfg = ctx.model_config
    method = npu.deepinfer_moe_method(ctx)
    portable = PortableLinearMethod(dtype, qat, cfg.weight_block_size)
    linear = {f: npu.deepinfer_linear_method(ctx, f) or portable for f in ("fp8", "fp4")}
    base = make_moe(cfg, hash_routed, seed=21)
    single = prepare(copy.deepcopy(base), method, linear)
    ep = EPMoEMethod(method, ExpertPlacement.initial(1, E, 1, 2), ep_rank=0, ep_size=1)
    assert isinstance(ep.ops, AscendEPExperts)
    ours = prepare(copy.deepcopy(base), ep, linear)
    assert len(ours.experts) == E + 2 and ours.npu_w13.shape[0] == E + 2       # the slots, stacked
    ref = prepare(base, PortableMoE(), {"fp8": portable, "fp4": portable})
    x, tok = inputs(5, 22, dtype)
    fake_npu.calls.clear()
    with torch.no_grad():
        got = ours(x, tok)
        (gmm1, gmm2) = calls(fake_npu, "npu_grouped_matmul")
        assert not calls(fake_npu, "npu_moe_init_routing_v2")     # the exchange sorted the pairs
        assert not calls(fake_npu, "npu_moe_token_unpermute")     # combine sums them
        assert gmm1["group_list"].shape == (E + 2,) and int(gmm1["group_list"].sum()) == 5 * K
        tol = 1e-3 if dtype == BF16 else 1e-6
        assert rel(got, single(x, tok)) < tol and rel(got, ref(x, tok)) < tol
        with ep.padded_exchange():
            assert torch.equal(ours(x, tok), got)
        assert len(calls(fake_npu, "npu_moe_init_routing_v2")) == 2       # single + padded
        with ep.padded_exchange(torch.tensor(3)):                # rows 3-4: padding
            masked = ours(x, tok)[:3]
        assert rel(masked, ours(x[:3], tok[:3])) < tol
        # EPLB's view of each slot: its stacked weights, in place
        views = ep.slot_modules(ours)
        assert len(views) == E + 2
        assert views[1].w13.data_ptr() == ours.npu_w13[1].data_ptr()
