"""benchmarks/official_kernels.py: the CPU stand-ins for DeepSeek's inference kernels agree with the
engine's exact quantisers and with direct formulations (brute-force grid search, dense softmax,
explicit matrices); benchmarks/official_agreement.py's plumbing works without the official code
(which CI never has): a clear error naming --official-dir, the stand-ins installed only while
model.py imports and runs, the config and checkpoint mapping."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import official_agreement as OA
import official_kernels as K

from deepinfer_core.ops import quant

E2M1 = [v for m in K.E2M1_VALUES for v in (m, -m)]


def activations(*shape: int, seed: int = 0) -> torch.Tensor:
    """bf16 values over many binades, with an all-zero block and a tiny one (the amax floors)."""
    g = torch.Generator().manual_seed(seed)
    binade = torch.exp2(torch.randint(-12, 12, shape[:-1], generator=g))
    x = torch.randn(*shape, generator=g) * binade[..., None]
    x[0, :32] = 0
    x[1, :32] *= 1e-9
    return x.bfloat16()


@pytest.mark.parametrize("block", [64, 128])
def test_act_quant_in_place_is_the_engines_fake_quant(block):
    x = activations(6, 256)
    got = K.act_quant(x.clone(), block, "ue8m0", torch.float8_e8m0fnu, inplace=True)
    assert torch.equal(got.view(torch.int16), quant.fake_quant_fp8(x, block).view(torch.int16))
    q, s = K.act_quant(x, block, "ue8m0", torch.float8_e8m0fnu)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (6, 256 // block)
    deq = (q.float().unflatten(-1, (-1, block)) * quant.e8m0_to_float(s)[..., None]).flatten(-2)
    assert torch.equal(deq.bfloat16(), got)


def test_act_quant_writes_through_a_view():
    """model.py quantises kv[..., :-rd] in place: the RoPE dims stay as they were."""
    kv = activations(4, 192)
    out = kv.clone()
    K.act_quant(out[..., :128], 64, "ue8m0", torch.float8_e8m0fnu, inplace=True)
    assert torch.equal(out[..., 128:], kv[..., 128:])
    assert torch.equal(out[..., :128], quant.fake_quant_fp8(kv[..., :128], 64))


def brute_force_fp4(x: torch.Tensor) -> torch.Tensor:
    """Per block of 32: s = 2^ceil(log2(amax / 6)); each x / s to the nearest E2M1 value by search,
    ties to the one with the even code (codes 0..7 in E2M1_VALUES order)."""
    out = torch.empty(x.shape)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 32):
            blk = x[r, b:b + 32].double().tolist()
            amax = max(max(map(abs, blk)), 6 * 2.0 ** -126)
            s = 2.0 ** math.ceil(math.log2(amax / 6))
            for j, v in enumerate(blk):
                v = min(max(v / s, -6.0), 6.0)
                best = min(E2M1, key=lambda g: (abs(g - v), K.E2M1_VALUES.index(abs(g)) % 2))
                out[r, b + j] = best * s
    return out.to(x.dtype)


def test_fp4_act_quant_is_the_nearest_grid_point_ties_to_even():
    x = activations(4, 128, seed=1)
    x[2, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])   # ties; amax 6: s = 1
    x[2, 8:32] = 0
    got = K.fp4_act_quant(x.clone(), 32, inplace=True)
    assert torch.equal(got, brute_force_fp4(x))
    assert torch.equal(got[2, :7].float(), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))
    assert torch.equal(got.view(torch.int16), quant.fake_quant_fp4(x, 32).view(torch.int16))
    packed, s = K.fp4_act_quant(x, 32)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (4, 64) and s.shape == (4, 4)
    unpacked = quant.unpack_fp4(packed.view(torch.uint8))      # the engine's reader: low nibble first
    scaled = unpacked.unflatten(-1, (-1, 32)) * quant.e8m0_to_float(s)[..., None]
    assert torch.equal(scaled.flatten(-2), got.float())


def quantised_operands(n: int, k: int, fp4: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, a_s = K.act_quant(activations(5, k, seed=seed), 128, "ue8m0", torch.float8_e8m0fnu)
    w = torch.randn(n, k, generator=g) * 0.05
    if fp4:
        wq, ws = quant.quantize_fp4(w)
        exact = quant.dequant_fp4(wq, ws, dtype=torch.float64)
        return a, a_s, wq.view(torch.float4_e2m1fn_x2), ws, exact
    wq, ws = quant.quantize_fp8_block(w)
    return a, a_s, wq, ws, quant.dequant_fp8_block(wq, ws, dtype=torch.float64)


@pytest.mark.parametrize("fp4", [False, True])
def test_gemms_are_the_exact_product_rounded_once(fp4):
    a, a_s, w, w_s, w_ref = quantised_operands(256, 384, fp4)
    a_ref = a.double().unflatten(-1, (-1, 128)) * quant.e8m0_to_float(a_s).double()[..., None]
    a_ref = a_ref.flatten(-2)
    ref = a_ref @ w_ref.T
    gemm = K.fp4_gemm if fp4 else K.fp8_gemm
    for dtype in (torch.bfloat16, torch.float32):
        with OA.default_dtype(dtype):
            out = gemm(a, a_s, w, w_s, torch.float8_e8m0fnu)
        assert out.dtype == dtype and out.shape == (5, 256)
        tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5     # one rounding (fp32: the sums)
        assert ((out.double() - ref).abs() <= tol * ref.abs() + 1e-6 * ref.abs().max()).all()


def dense_attention(q, kv, sink, idx, scale):
    """fp64 softmax over the gathered rows and the sink, one query at a time."""
    b, m, h, d = q.shape
    out = torch.zeros(b, m, h, d, dtype=torch.float64)
    for i in range(b):
        for t in range(m):
            keys = kv[i, idx[i, t][idx[i, t] >= 0].long()].double()
            s = q[i, t].double() @ keys.T * scale                           # [h, k]
            w = torch.softmax(torch.cat([s, sink.double()[:, None]], 1), 1)[:, :-1]
            out[i, t] = w @ keys
    return out


def test_sparse_attn_is_the_softmax_with_the_sink():
    g = torch.Generator().manual_seed(3)
    b, m, h, d, n, k = 2, 5, 4, 64, 150, 140        # three blocks of 64 keys, the last partial
    q = torch.randn(b, m, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, m, k), generator=g, dtype=torch.int32)
    idx[:, :, 100:] = -1                                    # the third block has no key at all
    idx[0, 1, 5:64] = -1
    out = K.sparse_attn(q, kv, sink, idx, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = dense_attention(q, kv, sink, idx, d ** -0.5)
    assert torch.allclose(out.double(), ref, atol=2e-3, rtol=2 ** -7)


def test_hc_split_sinkhorn_is_the_sinkhorn_of_the_softmax():
    g = torch.Generator().manual_seed(4)
    hc, iters, eps = 4, 3, 1e-6                  # few iterations: each one still moves comb
    mixes = torch.randn(2, 3, (2 + hc) * hc, generator=g)
    scale, base = torch.rand(3, generator=g), torch.randn(24, generator=g)
    pre, post, comb = K.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
    z, s, bs = mixes.double(), scale.double(), base.double()
    assert torch.allclose(pre.double(), torch.sigmoid(z[..., :hc] * s[0] + bs[:hc]) + eps, atol=1e-6)
    want_post = 2 * torch.sigmoid(z[..., hc:2 * hc] * s[1] + bs[hc:2 * hc])
    assert torch.allclose(post.double(), want_post, atol=1e-6)
    c = torch.softmax((z[..., 2 * hc:] * s[2] + bs[2 * hc:]).view(2, 3, hc, hc), -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    assert torch.allclose(comb.double(), c, atol=1e-6)


def test_hadamard_is_the_sylvester_matrix():
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = activations(3, 128)
    got = K.hadamard_transform(x, 128 ** -0.5)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), x.double() @ h.T * 128 ** -0.5, rtol=2 ** -8, atol=1e-30)
    assert torch.equal(got, quant.hadamard_transform(x))


def test_bf16_rsqrt_rounds_once_from_fp32():
    x = torch.rand(1000, generator=torch.Generator().manual_seed(5)).bfloat16() * 8 + 0.01
    with K.CudaBf16Rsqrt():
        for n in (3, 7, 36, 1000):              # short tensors take torch's scalar CPU loop
            want = (1 / x[:n].double().sqrt()).bfloat16()   # the correctly rounded value
            assert torch.equal(torch.rsqrt(x[:n]), want) and torch.equal(x[:n].rsqrt(), want)
        assert torch.rsqrt(x.float()).dtype == torch.float32


# ---- the harness, without the official code -------------------------------------------------------
def test_a_folder_without_the_official_code_is_refused(tmp_path):
    (tmp_path / "model.py").write_text("")
    with pytest.raises(SystemExit, match=r"--official-dir .*no kernel\.py.*DeepSeek-V4-Flash"):
        OA.load_official_module(tmp_path)


def test_model_py_imports_the_stand_ins_only_while_loading_and_running(tmp_path):
    (tmp_path / "kernel.py").write_text("raise ImportError('the TileLang kernels: never imported')\n")
    (tmp_path / "model.py").write_text(
        "from kernel import act_quant, fp4_act_quant, fp8_gemm, fp4_gemm, sparse_attn\n"
        "from kernel import hc_split_sinkhorn\n"
        "def rotate(x):\n"
        "    from fast_hadamard_transform import hadamard_transform\n"
        "    return hadamard_transform(x, scale=x.size(-1) ** -0.5)\n")
    before = sys.modules.get("kernel")
    module = OA.load_official_module(tmp_path)
    assert module.act_quant is K.act_quant and module.sparse_attn is K.sparse_attn
    assert sys.modules.get("kernel") is before and "fast_hadamard_transform" not in sys.modules
    x = activations(2, 128)
    with OA.stand_ins():
        assert torch.equal(module.rotate(x), K.hadamard_transform(x, 128 ** -0.5))


def test_model_args_come_from_the_hf_config():
    from deepinfer_core.tools.tiny_config import tiny_config_dict
    cfg = tiny_config_dict()

    class Module:
        ModelArgs = dict

    args = OA.official_args(Module, cfg, 300)
    assert args["window_size"] == cfg["sliding_window"] and args["dim"] == cfg["hidden_size"]
    assert args["original_seq_len"] == cfg["rope_scaling"]["original_max_position_embeddings"]
    assert args["compress_ratios"] == tuple(cfg["compress_ratios"]) and args["max_seq_len"] == 300
    assert (args["dtype"], args["scale_fmt"], args["expert_dtype"]) == ("fp8", "ue8m0", "fp4")


def test_checkpoint_tensors_are_what_convert_py_hands_model_py(tiny_ckpt_dir):
    import json

    from safetensors import safe_open
    tensors = OA.checkpoint_tensors(tiny_ckpt_dir, expert_fp4=True)
    assert not any(k.startswith("mtp.") or k.endswith("wo_a.scale") for k in tensors)
    name = "layers.0.attn.wo_a.weight"
    index = json.loads((tiny_ckpt_dir / "model.safetensors.index.json").read_text())
    with safe_open(tiny_ckpt_dir / index["weight_map"][name], "pt") as f:
        w, s = f.get_tensor(name), f.get_tensor(name.replace("weight", "scale"))
    assert torch.equal(tensors[name], quant.dequant_fp8_block(w, s, dtype=torch.bfloat16))
    experts = [t for k, t in tensors.items() if ".experts." in k and k.endswith("weight")]
    assert experts and all(t.dtype == torch.float4_e2m1fn_x2 for t in experts)
