"""The sweep's tools on the CPU: roofline arithmetic (closed-form sums, hand-computed bytes and FLOPs of
a small case, the weight inventory against the model's own buffers), random-weight construction, the
plot's graceful degradation, and one end-to-end run of benchmarks/sweep.py on the tiny config with
transformers on the same weights (float32, QAT off: the logits must agree, which checks the in-memory
weight mapping) and one without. DeepSeek-V4.1: the shared cut (v41_cut) of the width config, the
V4.1 roofline (roofline_v41) against the model's buffers and by hand, the sweep on a tiny V4.1.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import roofline as RL  # noqa: E402
import roofline_v41 as RL41  # noqa: E402
import sweep_model as SM  # noqa: E402
import v41_cut  # noqa: E402
from deepinfer_core.config import ModelConfig  # noqa: E402
from deepinfer_core.model import build_model  # noqa: E402
from deepinfer_core.tools.tiny_config import tiny_config_dict  # noqa: E402
from deepinfer_core.tools.tiny_config_v41 import tiny_v41_config_dict  # noqa: E402

V41_WIDTH = BENCH.parent / "tests" / "data" / "deepseek-v4.1-flash" / "config.json"


def tiny_cfg(ratios: list[int], **kw) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict(num_hidden_layers=len(ratios), compress_ratios=ratios + [0],
                                                  expert_dtype="fp8", **kw))


# ---- arithmetic --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 127, 128, 129, 700])
def test_closed_form_sums_match_brute_force(n):
    assert RL.sum_min(n, 16) == sum(min(u, 16) for u in range(1, n + 1))
    for r in (1, 4, 128):
        assert RL.sum_floordiv(n, r) == sum(u // r for u in range(1, n + 1))
        for cap in (0, 3, 8, 512):
            assert RL.sum_min_floordiv(n, r, cap) == sum(min(cap, u // r) for u in range(1, n + 1))


def test_distinct_experts_and_peak_arithmetic():
    assert RL.expected_distinct_experts(4, 2, 1) == pytest.approx(2.0)
    assert RL.expected_distinct_experts(4, 2, 2) == pytest.approx(3.0)       # 4 * (1 - (1/2)^2)
    assert RL.expected_distinct_experts(256, 6, 10 ** 6) == pytest.approx(256.0)
    assert RL.linear_bytes(256, 384, "fp8", (128, 128)) == 256 * 384 + 2 * 3
    assert RL.linear_bytes(256, 384, "bf16", None) == 2 * 256 * 384
    c = RL.Cost({"w": 4.8e9}, {"fp8": 1.58e12, "bf16": 0.79e12})
    p = RL.Peaks()
    assert c.t_memory(p) == pytest.approx(1e-3) and c.t_compute(p) == pytest.approx(2e-3)
    assert c.to_dict(p)["bound"] == "compute" and c.t_floor(p) == pytest.approx(2e-3)
    # the floors follow the GPU the sweep ran on (torch's device names)
    assert RL.Peaks.for_device("NVIDIA H200") == p and RL.Peaks.for_device("cpu") == p
    assert RL.Peaks.for_device("NVIDIA H100 80GB HBM3") == RL.Peaks(3.35e12, p.bf16, p.fp8)
    assert RL.Peaks.for_device("NVIDIA H100 NVL").bw == 3.9e12
    pcie = RL.Peaks.for_device("NVIDIA H100 PCIe")
    assert pcie.bw == 2.0e12 and pcie.bf16 == pytest.approx(p.bf16 * 756 / 989)


def test_decode_roofline_of_a_small_hca_layer_by_hand():
    """Tiny dims (D 256, 4 heads x 128, window 16, 8 experts top-2, I 128), one HCA layer, batch 2 at
    context 300, bf16 cache."""
    cfg = tiny_cfg([128])
    layer = RL.decode_roofline(cfg, [128], 2, 300).layers[0]
    # FP8 e4m3 bytes + one scale byte per 128x128 block: wq_a 128x256, wq_b 512x128, wkv 128x256,
    # wo_a 256x256, wo_b 256x256
    assert layer.bytes["attn_fp8"] == (32768 + 2) + (65536 + 4) + (32768 + 2) + (65536 + 4) + (65536 + 4)
    assert layer.bytes["compressor_bf16"] == 2 * (128 * 256 * 2)              # wkv + wgate, bf16
    # 2 tokens hit 8 * (1 - (6/8)^2) = 3.5 experts of 3 x (32768 + 2) bytes
    assert layer.bytes["routed_experts"] == pytest.approx(3.5 * 3 * 32770)
    # per sequence: 15 older window rows + 300+1 // 128 = 2 HCA rows of 128 x 2 B, + the tail pooled
    # when a block closes (128 fp32 kv + z per token, amortised)
    assert layer.bytes["state_read"] == 2 * (15 * 256 + 2 * 256 + 128 * 8)
    assert layer.bytes["state_write"] == pytest.approx(2 * (256 + 128 * 8 + 256 / 128))
    # attention: 4 x heads x head_dim per (query, key), 16 window keys + 2 HCA rows per query
    attn = 4 * 4 * 128 * 2 * (16 + 2)
    dense_bf16 = 2 * 2 * (256 * 256 + 2 * 128 * 256 + 8 * 256)               # wo_a, compressor, gate
    mhc = 2 * 2 * 2 * 24 * 1024
    assert layer.flops["bf16"] == attn + dense_bf16 + mhc


def test_weight_inventory_matches_the_models_buffers():
    cfg = tiny_cfg([4, 128])
    model = build_model(cfg, device="meta")
    sd = model.state_dict()

    def nbytes(names):
        return sum(sd[n].numel() * sd[n].element_size() for n in names)
    for i, ratio in enumerate((4, 128)):
        pre = f"layers.{i}."
        dense = [n for n in sd if n.startswith(pre) and ".ffn.experts." not in n and not n.endswith("tid2eid")]
        want = sum(RL.linear_bytes(s.out_f, s.in_f, s.fmt, cfg.weight_block_size) for s in RL.dense_linears(cfg, ratio))
        want += sum(RL.block_small_bytes(cfg, ratio, cfg.is_hash_layer(i)).values())
        assert nbytes(dense) == want, f"layer {i} (ratio {ratio})"
        assert nbytes([n for n in sd if n.startswith(pre + "ffn.experts.0.")]) == RL.expert_bytes(cfg)
    assert nbytes(["head.weight"]) == RL.head_cost(cfg, 1, 1).bytes["lm_head"]


def test_prefill_chunks_change_bytes_not_flops():
    cfg = tiny_cfg([4, 128])
    one, two = RL.prefill_roofline(cfg, [4, 128], 512), RL.prefill_roofline(cfg, [4, 128], 512, chunk=256)
    assert two.total.flops["fp8"] == pytest.approx(one.total.flops["fp8"])
    head_row = 2 * 4 * 4 * 256 + 2 * cfg.vocab_size * 256                    # hc_head mix + LM head
    assert two.total.flops["bf16"] == pytest.approx(one.total.flops["bf16"] + head_row)   # one more logits row
    assert two.total.total_bytes > one.total.total_bytes                    # weights read per chunk


# ---- model and plot ----------------------------------------------------------------------------

def test_v4_flash_config_and_sweep_configs(v4_flash_config):
    real, source = SM.load_base_config()
    assert real == v4_flash_config and source == str(SM.FLASH_CONFIG)     # the repository's copy
    bench = SM.bench_config(real, 4)
    assert bench["compress_ratios"] == [4, 128, 4, 128, 0] and bench["num_hash_layers"] == 3
    assert ModelConfig.from_dict(bench).expert_dtype == "fp8"
    full = ModelConfig.from_dict(SM.full_config(real, bench, 43))
    assert [full.layer_ratio(i) for i in range(43)] == real["compress_ratios"][:43]
    # ~27 GB of FP8 weights for the 4 measured layers (+ embedding, head), as the brief expects
    cfg = ModelConfig.from_dict(bench)
    layers = sum(RL.decode_roofline(cfg, [4, 128, 4, 128], 10 ** 6, 0).total.bytes[k]
                 for k in ("attn_fp8", "routed_experts", "shared_expert"))
    assert 25e9 < layers < 28e9


def test_random_model_has_finite_weights_of_the_right_scale():
    d = SM.bench_config(dict(tiny_config_dict(), vocab_size=512), 2)
    assert d["compress_ratios"] == [4, 128, 0] and d["expert_dtype"] == "fp8"
    built = SM.build_random_model(d, "cpu", "float32", seed=1)
    sd = built.model.state_dict()
    assert not any(n.startswith("mtp.") for n in sd)
    w = sd["layers.0.ffn.experts.3.w2.weight"]
    assert w.dtype == torch.float8_e4m3fn
    from deepinfer_core.ops.quant import dequant_fp8_block
    deq = dequant_fp8_block(w, sd["layers.0.ffn.experts.3.w2.scale"], (128, 128), torch.float32)
    assert 0.5 < deq.std().item() * w.shape[1] ** 0.5 < 2.0                 # unit-variance outputs
    tid = sd["layers.0.ffn.gate.tid2eid"]
    assert all(len(set(row)) == len(row) for row in tid[:50].tolist())   # k distinct experts
    assert all(torch.isfinite(t.float()).all() for t in sd.values() if t.is_floating_point())


def test_plot_degrades_to_a_message_without_matplotlib(tmp_path, monkeypatch):
    import plot_sweep
    monkeypatch.setitem(sys.modules, "matplotlib", None)                    # import now raises
    msg = plot_sweep.plot({"decode": [], "prefill": []}, tmp_path / "x.png")
    assert msg.startswith("not drawn: matplotlib is not installed") and not (tmp_path / "x.png").exists()


def test_verdicts_judge_the_performance_targets_on_the_measured_model():
    """b1 <= 2x, b8 <= 1.6x, b64 and b256 <= 1.5x of the measured model's roofline (the full-depth
    ratio only as info), prefill 16k >= 40% of the FP8 peak, prefill 4k and decode >= 10x transformers."""
    from sweep_report import verdicts

    def dec(b, x, full, hf=None):
        return {"status": "ok", "batch": b, "context": 4096, "label": f"decode b{b}", "x_roofline": x,
                "full_x_roofline": full, **({"speedup_vs_hf": hf} if hf else {})}

    def pre(n, frac, hf=None):
        return {"status": "ok", "tokens": n, "label": f"prefill {n}", "fp8_peak_frac": frac,
                "full_fp8_peak_frac": frac * 1.1, **({"speedup_vs_hf": hf} if hf else {})}
    vs = verdicts([dec(1, 1.9, 3.0, hf=25.0), dec(8, 1.7, 1.2, hf=9.0), dec(64, 1.4, 1.0), dec(256, 1.6, 1.0)],
                  [pre(4096, 0.2, hf=12.0), pre(16384, 0.41, hf=3.0)])
    got = {v["target"]: (v["pass"], v.get("worst_at")) for v in vs}
    assert got == {
        "decode batch 1 within 2.0x of the roofline": (True, "b1 c4096"),
        "decode batch 8 within 1.6x of the roofline": (False, "b8 c4096"),
        "decode batch 64 and 256 within 1.5x of the roofline": (False, "b256 c4096"),
        "prefill 16k tokens >= 40% of FP8 peak": (True, "16384 tokens"),
        "prefill 4k >= 10x faster than transformers": (True, "prefill 4096"),
        "decode >= 10x faster than transformers where it fits": (False, "decode b8"),
    }
    assert vs[0]["info"] == {"b1 c4096 full depth": 3.0}
    assert vs[5]["not_compared"] == ["decode b64", "decode b256"]


# ---- end to end --------------------------------------------------------------------------------

SMOKE = ["--device", "cpu", "--tiny", "--layers", "1", "--vocab", "1024", "--dtype", "float32",
         "--batches", "1,2", "--contexts", "40", "--prefill", "64", "--warmup", "0", "--reps", "1"]


def _check(result: dict, path: Path) -> dict:
    data = json.loads(path.read_text())
    for key in ("gpu", "commit", "versions", "config", "ops", "peaks", "assumptions", "prefill", "decode",
                "verdicts", "plot", "full_ratios"):
        assert key in data, key
    assert data["gpu"] == "cpu" and data["config"]["num_hidden_layers"] == 1 and len(data["full_ratios"]) == 43
    assert data["versions"]["torch"] == torch.__version__
    rows = data["decode"] + data["prefill"]
    assert [(r["batch"], r["context"]) for r in data["decode"]] == [(1, 40), (2, 40)]
    for r in rows:
        assert r["status"] == "ok", r["status"]
        assert r["step_ms"] > 0 and r["roofline"]["bench"]["t_floor_ms"] > 0
        ex = r["extrapolated"]
        assert ex["full_ms"] > r["step_ms"] - ex["embed_head_ms"] and len(r["split"]["layers_ms"]) == 1
    assert data["decode"][0]["output_tok_s"] == pytest.approx(1e3 / data["decode"][0]["tpot_ms"])
    assert [v["target"].split()[:2] for v in data["verdicts"]] == [
        ["decode", "batch"], ["decode", "batch"], ["decode", "batch"], ["prefill", "16k"], ["prefill", "4k"],
        ["decode", ">="]]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert data["plot"].startswith("wrote") == has_mpl, data["plot"]
    assert path.with_suffix(".png").exists() == has_mpl
    return data


def test_sweep_end_to_end_with_transformers_on_the_same_weights(tmp_path):
    import sweep
    out = tmp_path / "with_hf"
    result = sweep.main(SMOKE + ["--no-qat", "--out-dir", str(out), "--hf-reps", "1"])
    data = _check(result, Path(result["json_path"]))
    assert data["hf"]["status"] == "ok", data["hf"]
    agree = data["hf"]["agreement"]
    assert agree["argmax_equal"] and agree["max_rel_err"] < 1e-4, agree     # same weights, same math
    for r in data["decode"] + data["prefill"]:
        assert r["hf"]["status"] == "ok" and r["speedup_vs_hf"] > 0


def test_sweep_end_to_end_without_transformers(tmp_path):
    import sweep
    result = sweep.main(SMOKE + ["--no-hf", "--out-dir", str(tmp_path)])
    data = _check(result, Path(result["json_path"]))
    assert data["hf"]["status"] == "not run: --no-hf"
    assert all("speedup_vs_hf" not in r for r in data["decode"])
    assert data["verdicts"][4]["pass"] is None and data["verdicts"][5]["pass"] is None


def test_sweep_with_fp4_experts_counts_the_checkpoints_expert_bytes(tmp_path):
    """`--expert-dtype fp4` (examples/sweep/run_sweep.sh's default): the checkpoint's FP4 routed experts,
    re-encoded by the backend; the roofline reads 0.5 B per weight + one scale byte per 32 of them."""
    import sweep
    routed = {}
    for fmt in ("fp8", "fp4"):
        result = sweep.main(SMOKE + ["--no-hf", "--expert-dtype", fmt, "--out-dir", str(tmp_path / fmt)])
        data = _check(result, Path(result["json_path"]))
        assert data["config"]["expert_dtype"] == fmt
        routed[fmt] = data["decode"][0]["roofline"]["bench"]["bytes"]["routed_experts"]
    assert routed["fp4"] / routed["fp8"] == pytest.approx((0.5 + 1 / 32), rel=1e-3), routed


def test_cuda_core_moe_flag_switches_the_tile_heuristic(monkeypatch):
    """--cuda-core-moe ROWS overrides the fused MoE's choice of its CUDA-core kernels for either weight form
    (unset: the engine's per-form table; 0: tensor cores only)."""
    from deepinfer_kernels import moe
    monkeypatch.setattr(moe, "GEMV_MAX_ROWS", moe.GEMV_MAX_ROWS)        # restored after the test
    assert "gemv_rows" not in moe.moe_tile_config(1, 7, 257)
    SM.use_cuda_core_moe(2)
    assert moe.moe_tile_config(1, 7, 257)["gemv_rows"] == 1 and "gemv_rows" not in moe.moe_tile_config(256, 7, 257)
    SM.use_cuda_core_moe(0)
    assert "gemv_rows" not in moe.moe_tile_config(1, 7, 257, fp4=True)
    with pytest.raises(ValueError, match="allowed: 0"):
        SM.use_cuda_core_moe(-1)


# ---- DeepSeek-V4.1 -----------------------------------------------------------------------------

def test_v41_cut_of_the_width_config():
    """Every depth from the minimum to the full one is a valid V4.1 config with both YOCO halves;
    the layout at 8 and 12 layers (bounded_replay's --per-half 5 uses the same cut); the full depth
    keeps the base's topology; Engram tables capped; too few layers refused naming --layers."""
    base = json.loads(V41_WIDTH.read_text())
    assert v41_cut.family(base) == "v41" and v41_cut.min_layers(base) == 4
    for n in range(4, 41):
        cfg = ModelConfig.from_dict(v41_cut.cut_v41(base, n))
        assert cfg.num_hidden_layers == n and 2 < cfg.n_prefill_layer < n
    t = v41_cut.cut_v41(base, 8)["text_config"]
    assert t["compress_ratios"] == [0, 0, 2, 2, 2, 1, 1, 1] and t["kv_source_layer_ids"] == [2, 5]
    assert t["index_source_layer_ids"] == [2, 5] and t["candidate_source_layer_id"] == 5
    assert t["engram_layer_ids"] == [1, 4] and t["engram_vocab_size"] == [100003] * 3
    import bounded_replay
    t = bounded_replay.cut_width_config(5, 32, 7)["text_config"]
    assert t["compress_ratios"] == [0, 0] + [2] * 5 + [1] * 5
    assert t["kv_source_layer_ids"] == [2, 7] and t["index_source_layer_ids"] == [2, 7, 11]
    assert t["candidate_source_layer_id"] == 7 and t["engram_layer_ids"] == [1, 6]
    assert t["n_routed_experts"] == 32 and t["engram_vocab_size"] == [7] * 3
    full = v41_cut.cut_v41(base, 40, engram_rows=None)["text_config"]
    assert full == base["text_config"]
    for bad in (3, 41):
        with pytest.raises(ValueError, match=rf"--layers: {bad} layers; allowed .*: 4\.\.40"):
            v41_cut.cut_v41(base, bad)
    with pytest.raises(ValueError, match="--expert-dtype fp8.*allowed: fp4"):
        SM.bench_config(base, 4, "fp8")
    # 8 layers at full width (all 384 FP4 experts) with the capped Engram tables: 55-70 GB in
    # checkpoint format (what a backend keeps of it: test_v41_width_cut_on_the_nvidia_backend)
    model = build_model(ModelConfig.from_dict(SM.bench_config(base, 8, "fp4")), device="meta")
    assert 55e9 < sum(t.numel() * t.element_size() for t in model.state_dict().values()) < 70e9
    # --experts: the bench model and the model the figures extrapolate to have as many
    bench = SM.bench_config(base, 4, "fp4", experts=128)
    assert bench["text_config"]["n_routed_experts"] == 128
    assert SM.full_config(base, bench, 40)["text_config"]["n_routed_experts"] == 128
    assert SM.full_config(base, SM.bench_config(base, 4, "fp4"), 40)["text_config"] == base["text_config"] | {
        "engram_vocab_size": [100003] * 3}
    with pytest.raises(ValueError, match="--experts 5: allowed: >= num_experts_per_tok"):
        SM.bench_config(base, 4, "fp4", experts=5)


@pytest.fixture(scope="module")
def v41_width_plan():
    """weight_plan of the 4-layer V4.1-width cut (384 FP4 experts) on the nvidia backend's methods,
    made as its plugin makes them (32x32 FP8 blocks), fp4_experts=True: meta device, no GPU."""
    import weight_memory as WM
    cfg = ModelConfig.from_dict(SM.bench_config(json.loads(V41_WIDTH.read_text()), 4, "fp4"))
    return SM.weight_plan(cfg, WM.nvidia_ops(cfg, torch.bfloat16, True, fp4_experts=True))


@pytest.mark.slow
def test_v41_width_cut_on_the_nvidia_backend(v41_width_plan):
    """The 4-layer cut is 4 layers and ~34 GB of checkpoint (routed experts 4 x 384 x 3 x 2304 x 5120 x
    (1/2 + 1/32) bytes, Engram tables capped); the nvidia backend fuses every MoE layer (the routed
    FP4 experts stacked and kept FP4, the 32x32-block shared expert outside the stack), so the
    experts stay FP4-sized; check_weights_fit refuses a GPU they do not fit before any weight is made."""
    p = v41_width_plan
    assert p["status"] == "ok" and p["layers"] == 4 and p["moe_layers"] == 4
    ck, rt = p["checkpoint_by_part"], p["runtime_by_part"]
    assert ck["routed experts"] == 4 * 384 * 3 * 2304 * 5120 * 17 // 32
    assert 30e9 < p["checkpoint_bytes"] < 36e9 and ck["engram"] < 2e9 and ck["embed and head"] < 3e9
    assert p["moe_layers_fused"] == 4 and rt["routed experts"] < 1.01 * ck["routed experts"]
    with pytest.raises(ValueError, match=r"do not fit a 30 GB GPU"):
        SM.check_weights_fit(p, int(30e9), "a 30 GB GPU")


@pytest.mark.slow
def test_v41_width_cut_fits_60_gb_with_fp4_experts(v41_width_plan):
    p = v41_width_plan
    assert p["moe_layers_fused"] == 4
    assert p["peak_bytes"] + p["transient_bytes"] < 60e9


def test_v41_weight_inventory_matches_the_models_buffers():
    """roofline_v41's weights of every kind of layer (sources, sharers, Engram) = the model's
    buffers."""
    cfg = ModelConfig.from_dict(tiny_v41_config_dict())
    sd = build_model(cfg, device="meta").state_dict()

    def nbytes(names):
        return sum(sd[n].numel() * sd[n].element_size() for n in names)
    kinds = [RL41.layer_kind(cfg, i) for i in range(8)]
    assert kinds == ["SWA", "SWA+Engram", "C2 source", "C2 shared+Engram", "C2 source",
                     "C1 source", "C1 shared", "C1 index"]
    for i in range(8):
        pre = f"layers.{i}."
        dense = [n for n in sd if n.startswith(pre) and ".ffn.experts." not in n
                 and ".engram.embed." not in n]
        want = sum(RL.linear_bytes(s.out_f, s.in_f, s.fmt, cfg.weight_block_size)
                   for s, _ in RL41.dense_linears(cfg, i))
        assert nbytes(dense) == want + sum(RL41.block_small_bytes(cfg, i).values()), kinds[i]
        expert0 = [n for n in sd if n.startswith(pre + "ffn.experts.0.")]
        assert nbytes(expert0) == RL.expert_bytes(cfg)
    head = RL.head_cost(cfg, 1, 1)
    assert "mhc" not in head.bytes and not any(n.startswith("hc_head") for n in sd)   # shifted mHC


def test_v41_decode_roofline_by_hand():
    """Tiny V4.1 (window 16, top-8, C2 then C1, candidate blocks 8 x 4, Engram 2 orders x 2 heads
    x 32), batch 2 at context 300 (u = 301 positions visible), bf16 cache: the state each kind of
    layer reads and writes, and the indexer's work."""
    cfg = ModelConfig.from_dict(tiny_v41_config_dict())
    roof = RL.decode_roofline(cfg, list(cfg.compress_ratios), 2, 300)
    L, row = roof.layers, 128 * 2
    # C2 source: 15 older window rows, top-8 of 150 C2 rows, 150 index keys scored, the fp32 tails
    # (128 kv + 128 gate per token) pooled when a block closes; writes ring row, C2 row + index key
    # (1 per 2 tokens) and the tails
    assert L[2].bytes["state_read"] == 2 * (15 + 8 + 150) * row + 2 * 128 * 8
    assert L[2].bytes["state_write"] == 2 * row + 2 / 2 * (row + row) + 2 * 128 * 8
    assert L[2].flops["fp8"] - L[4].flops["fp8"] == 0                       # both C2 sources
    # C1 source (the candidate source): all 301 rows scored, no tails, a row + key per token
    assert L[5].bytes["state_read"] == 2 * (15 + 8 + 301) * row
    assert L[5].bytes["state_write"] == 2 * row + 2 * (row + row)
    # C1 shared: window + its source's top-8 rows only; C1 index (candidate consumer): 32 candidates
    assert L[6].bytes["state_read"] == 2 * (15 + 8) * row and L[6].bytes["state_write"] == 2 * row
    assert L[7].bytes["state_read"] == 2 * (15 + 8 + 32) * row
    assert L[7].flops["fp8"] - L[6].flops["fp8"] == (
        2 * 8 * 128 * 2 * 32                                                # index scores
        + 2 * (8 * 128 * 128) * 2)                                          # indexer.wq_b (FP8)
    assert L[3].bytes["engram_gather"] == 2 * 2 * 2 * (32 + 1) and "engram_gather" not in L[2].bytes
    kinds = {RL41.layer_kind(cfg, i) for i in range(8)}
    assert roof.to_dict(RL.Peaks())["per_kind"].keys() == kinds
    with pytest.raises(ValueError, match="not the V4.1 config's layers"):
        RL.decode_roofline(cfg, [4, 128], 2, 300)


V41_SMOKE = ["--device", "cpu", "--layers", "4", "--vocab", "1024", "--dtype", "float32",
             "--batches", "1,2", "--contexts", "40", "--prefill", "64", "--warmup", "0",
             "--reps", "1", "--no-plot"]


def test_sweep_end_to_end_on_a_tiny_v41(tmp_path):
    """The tiny V4.1 cut to 4 layers (SWA, SWA+Engram, C2 source+Engram, C1 source): every shape
    runs, the per-layer split sees every block (shifted mHC calls no module), transformers is
    skipped with the reason, the roofline is V4.1's and the figures extrapolate to the config's
    own 8 layers."""
    import sweep
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_v41_config_dict(drafter=True)))
    result = sweep.main(V41_SMOKE + ["--config", str(path), "--out-dir", str(tmp_path / "out")])
    data = json.loads(Path(result["json_path"]).read_text())
    assert data["family"] == "v41" and Path(result["json_path"]).name == "sweep_cpu_v41.json"
    assert data["ratios"] == [0, 0, 2, 1] and data["full_layers"] == 8
    assert len(data["full_ratios"]) == 8
    assert data["layer_kinds"] == ["SWA", "SWA+Engram", "C2 source+Engram", "C1 source"]
    assert data["v41_cut"]["drafter"].startswith("dropped")
    assert data["v41_cut"]["engram_layer_ids"] == [1, 2]
    plan = data["weights"]["plan"]                  # accounted on the meta device before the build
    assert plan["status"] == "ok" and plan["layers"] == 4 and plan["runtime_bytes"] == data["weights"]["runtime_bytes"]
    assert plan["checkpoint_bytes"] == data["weights"]["checkpoint_format_bytes"]
    assert data["routed_experts"]["bench"] == data["routed_experts"]["config"]
    assert data["hf"]["status"].startswith("not run: transformers has no DeepSeek-V4.1 model")
    assert any("DeepSeek-V4.1 layers" in x for x in data["assumptions"])
    assert [(r["batch"], r["context"]) for r in data["decode"]] == [(1, 40), (2, 40)]
    for r in data["decode"] + data["prefill"]:
        assert r["status"] == "ok", r["status"]
        assert r["hf"]["status"] == data["hf"]["status"] and "speedup_vs_hf" not in r
        assert all(ms > 0 for ms in r["split"]["layers_ms"]) and len(r["split"]["layers_ms"]) == 4
        assert set(r["roofline"]["bench"]["per_kind"]) == set(data["layer_kinds"])
        assert r["roofline"]["bench"]["bytes"]["engram_gather"] > 0
        ex = r["extrapolated"]
        assert ex["full_layers"] == 8
        assert set(ex["estimated_kinds"]) == {"C2 source", "C2 shared+Engram", "C1 shared",
                                              "C1 index"}
    with pytest.raises(SystemExit, match="--layers: 3 layers; allowed .*4..8"):
        sweep.main(V41_SMOKE[:2] + ["--layers", "3", "--config", str(path)])


def test_sweep_on_a_tiny_v41_in_bfloat16_with_the_qat_simulation(tmp_path):
    import sweep
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_v41_config_dict()))
    argv = [a if a != "float32" else "bfloat16" for a in V41_SMOKE]
    result = sweep.main(argv + ["--config", str(path), "--batches", "1",
                                "--out-dir", str(tmp_path)])
    rows = result["decode"] + result["prefill"]
    assert [r["status"] for r in rows] == ["ok"] * len(rows)
