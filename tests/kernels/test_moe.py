"""The nvidia backend's MoE (Fp8LinearMethod + NvidiaMoEMethod: Triton routing, grouped FP8 GEMMs with
the SwiGLU epilogue, fixed-order combine) against the core's portable MoE (PortableLinearMethod +
PortableMoE) on tiny layers: QAT on and off, hash- and score-routed, 1 / a few / more tokens than
experts x tile, empty experts, routing ties, FP4 experts kept FP4 (= re-encoded, bitwise), bitwise independence of the
batch order, the fallbacks, and no host synchronisation in `apply` (on a GPU: a CUDA-graph replay).
"""
from __future__ import annotations

import copy
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.layers import Linear
from deepinfer_core.model.moe import Gate, MoE
from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.portable_moe import PortableMoE
from deepinfer_core.ops.quant import quantize_fp4, quantize_fp8_block
from deepinfer_core.tools.tiny_config import tiny_config_dict
from deepinfer_kernels.moe import fused_moe
from deepinfer_kernels.moe_gemm import moe_w2
from deepinfer_kernels.moe_routing import SCHED_ROWS, expert_schedule, max_tiles, route_topk

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
from deepinfer_nvidia.linear import Fp8LinearMethod  # noqa: E402
from deepinfer_nvidia.moe import NvidiaMoEMethod  # noqa: E402

E, K = 4, 2                          # routed experts, top-k (hidden D and expert width I vary per test)
# 16-row tiles everywhere (so 70 tokens > experts x tile); 128-wide w2 tiles keep the interpreter quick
SMALL = dict(block_m1=16, block_m2=16, block_n2=128, num_warps1=4, num_stages1=2, num_warps2=4, num_stages2=2)


def tolerance(kdev: str) -> float:
    """Interpreter: fp32 sums in another order. H200: the FP8 MMA's short accumulator (test_fp8_kernels)."""
    return 1e-5 if kdev == "cpu" else 5e-4


def config(D: int = 128, I: int = 128, experts: int = E, limit: float = 0.8, expert_dtype: str = "fp8",
           fp8: bool = True) -> ModelConfig:
    """Tiny layers keep Triton's interpreter quick; D or I = 256 where two K steps / N tiles matter."""
    over = dict(hidden_size=D, moe_intermediate_size=I, n_routed_experts=experts, num_experts_per_tok=K,
                swiglu_limit=limit, expert_dtype=expert_dtype)
    if not fp8:
        over["quantization_config"] = None
    return ModelConfig.from_dict(tiny_config_dict(**over))


def make_moe(cfg: ModelConfig, hash_routed: bool, seed: int) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg, 0, hash_routed)
    n, D = cfg.n_routed_experts, cfg.hidden_size
    moe.gate.weight.copy_((torch.randn(n, D, generator=g) * D ** -0.5).to(torch.bfloat16))
    if hash_routed:
        moe.gate.tid2eid.copy_(torch.rand(cfg.vocab_size, n, generator=g).argsort(1)[:, :K])
    else:
        moe.gate.bias.copy_(torch.randn(n, generator=g) * 0.1)
    for lin in (m for m in moe.modules() if isinstance(m, Linear)):
        w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
        if lin.fmt == "fp8":
            q, s = quantize_fp8_block(w)
        elif lin.fmt == "fp4":
            q, s = quantize_fp4(w, 32)
        else:
            lin.weight.copy_(w.to(lin.weight.dtype))
            continue
        lin.weight.copy_(q)
        lin.scale.copy_(s)
    return moe


def prepare(moe: MoE, nvidia: bool, qat: bool, dtype=torch.float32, linears_first: bool = False,
            tiles: dict | None = SMALL, fp4_experts: bool = False, block=(128, 128)) -> MoE:
    """Bind methods as the nvidia plugin / the core would and process weights in model order
    (`deepinfer_core.model.process_weights` visits the MoE before its linears); `block`: the
    config's FP8 `weight_block_size`."""
    fp8_method = (Fp8LinearMethod if nvidia else PortableLinearMethod)(dtype, qat, block)
    methods = {"fp8": fp8_method, "fp4": fp8_method, "bf16": PortableLinearMethod(dtype, qat)}
    moe.method = NvidiaMoEMethod(tiles, fp4_experts=fp4_experts) if nvidia else PortableMoE()
    mods = list(moe.modules())
    for m in mods:
        if isinstance(m, Linear):
            m.method = methods[m.fmt]
    if linears_first:
        mods = [m for m in mods if isinstance(m, Linear)] + [m for m in mods if not isinstance(m, Linear)]
    for m in mods:
        if isinstance(m, (Linear, MoE)):
            m.method.process_weights(m)
    return moe


def pair(cfg: ModelConfig, hash_routed: bool, qat: bool, seed: int, **kw) -> tuple[MoE, MoE]:
    base = make_moe(cfg, hash_routed, seed)
    return prepare(copy.deepcopy(base), True, qat, **kw), prepare(base, False, qat, kw.get("dtype", torch.float32))


def inputs(T: int, seed: int, dtype=torch.float32, D: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, D, generator=g) * 2).to(dtype), torch.randint(0, 129280, (T,), generator=g)


@contextmanager
def no_host_sync(kdev: str):
    """Fail on host synchronisation inside apply: on a GPU torch's sync debug mode; everywhere, any
    .item()/.tolist()/bool()/int()/.cpu()/.numpy() called from DeepInfer code (Triton's interpreter
    may read tensors on the host, DeepInfer may not)."""
    patched = {}

    def guard(name, orig):
        def wrapped(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if "deepinfer" in caller and "/tests/" not in caller:
                raise AssertionError(f"host sync: Tensor.{name} called from {caller}")
            return orig(self, *a, **k)
        return wrapped

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"):
        patched[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, guard(name, patched[name]))
    if kdev == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if kdev == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        for name, orig in patched.items():
            setattr(torch.Tensor, name, orig)


def run(moe: MoE, x: torch.Tensor, ids: torch.Tensor, kdev: str) -> torch.Tensor:
    moe.to(kdev)
    x, ids = x.to(kdev), ids.to(kdev)
    with torch.no_grad(), no_host_sync(kdev):
        out = moe.method.apply(moe, x, ids)
    return out.cpu()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- routing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("hash_routed", [False, True])
def test_routing_matches_portable(kdev, hash_routed):
    cfg = config(experts=8)
    gate = Gate(cfg, hash_routed)
    g = torch.Generator().manual_seed(1)
    gate.register_buffer("weight", torch.randn(8, 128, generator=g) * 128 ** -0.5, persistent=False)
    if hash_routed:
        gate.tid2eid.copy_(torch.rand(cfg.vocab_size, 8, generator=g).argsort(1)[:, :K])
    else:
        gate.bias.copy_(torch.randn(8, generator=g) * 0.1)
    x, tok = inputs(37, 2)
    want_w, want_i = PortableMoE.route(gate, x, tok)
    logits = (x.float() @ gate.weight.t()).to(kdev)
    ids, w = route_topk(logits, K, bias=None if hash_routed else gate.bias.to(kdev),
                        tid2eid=gate.tid2eid.to(kdev) if hash_routed else None, input_ids=tok.to(kdev),
                        renormalize=True, routed_scale=cfg.routed_scaling_factor, shared_expert=True)
    ids, w = ids.cpu(), w.cpu()
    assert ids.dtype == torch.int32 and ids.shape == w.shape == (37, K + 1)
    assert torch.equal(ids[:, :K].long(), want_i) and (ids[:, K] == 8).all() and (w[:, K] == 1.0).all()
    assert torch.allclose(w[:, :K], want_w, rtol=2e-6, atol=0)


def test_routing_ties_go_to_the_lowest_expert(kdev):
    """Experts 2, 5 and 6 have identical gate rows and bias (ties in every token's scores); 2 and 5
    win, as in the reference's stable sort, alone or in a batch."""
    gate = Gate(config(experts=8), hash_routed=False)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 128, generator=g) * 128 ** -0.5
    w[5] = w[6] = w[2]
    gate.register_buffer("weight", w, persistent=False)
    gate.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 5.0, 5.0, 0.0]))
    x, tok = inputs(6, 4)
    logits = x @ gate.weight.t()
    ids, _ = route_topk(logits.to(kdev), K, bias=gate.bias.to(kdev), shared_expert=False)
    alone, _ = route_topk(logits[3:4].to(kdev), K, bias=gate.bias.to(kdev), shared_expert=False)
    _, want = PortableMoE.route(gate, x, tok)
    assert (ids.cpu().long() == torch.tensor([2, 5])).all() and torch.equal(ids.cpu().long(), want)
    assert torch.equal(alone.cpu(), ids.cpu()[3:4])


def test_schedule_of_sorted_experts(kdev):
    """Rows and 4-/16-row tiles per expert, experts without rows included, and the host-side bound."""
    counts = [3, 0, 17, 0, 1]
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor(counts)).to(torch.int32)
    sched = expert_schedule(ids.to(kdev), 5, (4, 16)).cpu()
    assert sched.shape == (SCHED_ROWS, 8)
    begin = torch.tensor([0, 3, 3, 20, 20])
    assert torch.equal(sched[0, :5], begin) and torch.equal(sched[1, :5], begin + torch.tensor(counts))
    t4 = torch.tensor([(c + 3) // 4 for c in counts]).cumsum(0)
    t16 = torch.tensor([(c + 15) // 16 for c in counts]).cumsum(0)
    assert torch.equal(sched[3, :5], t4) and torch.equal(sched[2, :5], t4 - torch.tensor([1, 0, 5, 0, 1]))
    assert torch.equal(sched[5, :5], t16) and int(t16[-1]) == 4
    for bm in (4, 16):
        assert max_tiles(21, 5, bm) >= int((sched[3] if bm == 4 else sched[5])[4])
    assert max_tiles(7, 257, 16) == 7 and max_tiles(0, 257, 16) == 0


# ---- the whole layer ------------------------------------------------------------------------------

@pytest.mark.parametrize("hash_routed,qat,T,D,I,linears_first", [
    (False, True, 1, 256, 256, False), (True, True, 4, 256, 128, True),
    (False, False, 5, 128, 256, False), (True, False, 3, 256, 128, False)])
def test_fused_moe_matches_portable(kdev, hash_routed, qat, T, D, I, linears_first):
    ours, ref = pair(config(D, I), hash_routed, qat, seed=10 + T, linears_first=linears_first)
    assert NvidiaMoEMethod.fused(ours)
    assert ours.nv_w13.dtype == torch.float8_e4m3fn and ours.nv_w13.shape == (E + 1, 2, I, D)
    assert ours.nv_w2.shape == (E + 1, D, I) and ours.nv_s13.dtype == torch.float32
    # the per-expert copies are gone (memory is not doubled) and cannot be used by mistake
    assert all(lin.weight.numel() == 0 for lin in ours.modules() if isinstance(lin, Linear))
    x, tok = inputs(T, T, D=D)
    got = run(ours, x, tok, kdev)
    want = ref(x, tok)
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert rel(got, want) < tolerance(kdev)


def test_more_tokens_than_experts_times_tile_and_empty_experts(kdev):
    """70 tokens (> 4 experts x 16-row tile): every used expert spans several tiles, expert 3 gets no
    token at all (its bias is hopeless), and the shared expert takes all 70 rows. (Unquantised
    activations: the interpreter would spend its time in act_quant.)"""
    ours, ref = pair(config(), False, False, seed=20)
    for m in (ours, ref):
        m.gate.bias[3] = -1e4
    x, tok = inputs(70, 21)
    _, idx = PortableMoE.route(ref.gate, x, tok)
    counts = torch.bincount(idx.flatten(), minlength=E)
    assert counts[3] == 0 and (counts[:3] > 16).all()
    assert rel(run(ours, x, tok, kdev), ref(x, tok)) < tolerance(kdev)


@pytest.mark.parametrize("experts", ["fp8", "fp4 kept fp4"])
def test_batch_order_does_not_change_any_bit(kdev, experts):
    """Permuting the token rows permutes the output rows exactly; equal rows give equal outputs."""
    fp4 = experts != "fp8"
    ours, _ = pair(config(expert_dtype="fp4" if fp4 else "fp8"), False, True, seed=30, fp4_experts=fp4)
    assert ours.nv_fused.n_fp4 == (E if fp4 else 0)
    x, tok = inputs(6, 31)
    x[5], tok[5] = x[1], tok[1]
    perm = torch.tensor([4, 2, 5, 0, 3, 1])
    out = run(ours, x, tok, kdev)
    out_perm = run(ours, x[perm], tok[perm], kdev)
    assert torch.equal(out[perm], out_perm) and torch.equal(out[5], out[1])


@pytest.mark.parametrize("qat", [True, False])
def test_fp4_experts_stay_fp4_and_give_the_re_encoded_bits(kdev, qat):
    """With `fp4_experts`, routed FP4 experts are kept as the checkpoint's codes and scale bytes (the shared expert FP8);
    the result equals the FP8 re-encoding's (the default) bit for bit and the portable MoE's."""
    base = make_moe(config(expert_dtype="fp4"), False, seed=40)
    ours, ref = prepare(copy.deepcopy(base), True, qat, fp4_experts=True), prepare(copy.deepcopy(base), False, qat)
    fp8 = prepare(copy.deepcopy(base), True, qat)
    assert ours.nv_fused.n_fp4 == E and ours.nv_w13.shape[0] == 1 and ours.nv_w13_codes.dtype == torch.uint8
    assert fp8.nv_fused.n_fp4 == 0 and fp8.nv_w13.shape[0] == E + 1
    x, tok = inputs(5, 41)
    got = run(ours, x, tok, kdev)
    assert torch.equal(got, run(fp8, x, tok, kdev))
    assert rel(got, ref(x, tok)) < tolerance(kdev)


def test_fp4_experts_that_do_not_tile_are_re_encoded_with_a_warning(kdev, caplog):
    """I = 160 is no multiple of 128: the resident FP4 tiles cannot hold it, so `fp4_experts` says so and
    the layer serves the FP8 re-encoding (the same bits as without the option)."""
    base = make_moe(config(I=160, expert_dtype="fp4"), False, seed=42)
    with caplog.at_level(logging.WARNING, logger="deepinfer_nvidia.moe"):
        ours = prepare(copy.deepcopy(base), True, True, fp4_experts=True)
    assert "[I, D] = [160, 128] cannot stay FP4" in caplog.text
    assert ours.nv_fused.n_fp4 == 0 and not hasattr(ours, "nv_w13_codes")
    x, tok = inputs(3, 43)
    assert torch.equal(run(ours, x, tok, kdev), run(prepare(copy.deepcopy(base), True, True), x, tok, kdev))


def test_bf16_compute(kdev):
    """bf16 model dtype: g/u/y rounded to bf16 and a to x's dtype, as the reference's layers do."""
    ours, ref = pair(config(), False, True, seed=50, dtype=torch.bfloat16)
    x, tok = inputs(4, 51, torch.bfloat16)
    got = run(ours, x, tok, kdev)
    # the interpreter's fp32 sums round to the same bf16 values; on a GPU the FP8 MMA's own rounding
    # flips some bf16 roundings (the model's bf16 noise is ~1e-2 here: bf16 vs fp32 portable)
    assert got.dtype == torch.bfloat16 and rel(got, ref(x, tok)) < (1e-3 if kdev == "cpu" else 2e-2)


def test_unservable_experts_keep_the_portable_method(kdev):
    """A bf16 model, and FP4 experts whose group scales span too many binades for one FP8 block
    scale: no fused tensors, the portable MoE (through each expert's own linear method) runs."""
    bf16_ours, bf16_ref = pair(config(fp8=False), False, True, seed=60)
    assert not NvidiaMoEMethod.fused(bf16_ours)
    x, tok = inputs(2, 61)
    with torch.no_grad():
        assert torch.equal(bf16_ours(x, tok), bf16_ref(x, tok))

    base = make_moe(config(expert_dtype="fp4"), False, 62)
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(63)) * 1e-6
    w[:, :32] *= 1e9                                    # 2^30 between neighbouring 32-groups
    q, s = quantize_fp4(w, 32)
    base.experts[1].w2.weight.copy_(q)
    base.experts[1].w2.scale.copy_(s)
    ours, ref = prepare(copy.deepcopy(base), True, True), prepare(base, False, True)
    assert not NvidiaMoEMethod.fused(ours) and ours.experts[0].w1.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        assert rel(ours.to(kdev)(x.to(kdev), tok.to(kdev)).cpu(), ref(x, tok)) < tolerance(kdev)


def test_apply_has_no_host_sync_and_replays_in_a_cuda_graph(kdev):
    ours, ref = pair(config(), True, True, seed=70, tiles=None)      # the default tile heuristic
    x, tok = inputs(3, 71)
    got = run(ours, x, tok, kdev)                      # `run` fails on any host sync
    assert rel(got, ref(x, tok)) < tolerance(kdev)
    if kdev == "cuda":                                 # the real test: capture, then replay on new data
        xs, ts = x.cuda(), tok.cuda()
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                ours.method.apply(ours, xs, ts)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ours.method.apply(ours, xs, ts)
            x2, tok2 = inputs(3, 72)
            xs.copy_(x2.cuda())
            ts.copy_(tok2.cuda())
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), ours.method.apply(ours, xs, ts).cpu())


def test_kernel_wrappers_reject_bad_arguments(kdev):
    D, I = 256, 128
    logits = torch.zeros(3, 8, device=kdev)
    with pytest.raises(ValueError, match="logits"):
        route_topk(logits.double(), 2, bias=torch.zeros(8, device=kdev))
    with pytest.raises(ValueError, match="input_ids"):
        route_topk(logits, 2, tid2eid=torch.zeros(10, 2, dtype=torch.int64, device=kdev))
    with pytest.raises(ValueError, match="bias"):
        route_topk(logits, 2)
    with pytest.raises(ValueError, match="sorted_ids"):
        expert_schedule(torch.zeros(4, dtype=torch.int64, device=kdev), 3, (16, 16))
    w13 = torch.zeros(3, 2, I, D, device=kdev).to(torch.float8_e4m3fn)
    w2 = torch.zeros(3, D, I, device=kdev).to(torch.float8_e4m3fn)
    s13, s2 = torch.ones(3, 2, 1, 2, device=kdev), torch.ones(3, 2, 1, device=kdev)
    x = torch.zeros(2, D, device=kdev)
    args = dict(n_clamped=2, swiglu_limit=1.0, quant_in=True, quant_mid=True, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="ids"):
        fused_moe(x, torch.zeros(2, 3, dtype=torch.int64, device=kdev), torch.ones(2, 3, device=kdev),
                  w13, s13, w2, s2, **args)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, torch.zeros(2, 3, dtype=torch.int32, device=kdev), torch.ones(2, 3, device=kdev),
                  w13[:, :, :, :128], s13, w2, s2, **args)
    a = torch.zeros(6, I, device=kdev)
    order = torch.arange(6, device=kdev)
    sched = torch.zeros(SCHED_ROWS, 4, dtype=torch.int32, device=kdev)
    with pytest.raises(ValueError, match="block_n"):
        moe_w2(a, None, w2, s2, order, sched, 1, out_dtype=torch.float32, block_m=16, block_n=96)
    with pytest.raises(ValueError, match="scales"):
        moe_w2(a, None, w2, s2[:, :1], order, sched, 1, out_dtype=torch.float32, block_m=16, block_n=64)
