"""benchmarks/throughput.py on the CPU, CI-sized: the steady-state and percentile arithmetic on synthetic
timestamps, the dummy-model config cut, and end-to-end runs of main() on the tiny model (a checkpoint
built in a temporary directory; random weights through LLM(load_format="dummy") where the tree has the
dummy loader) whose JSON must hold every figure with sane values. Nothing here asserts a speed.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import throughput as TP  # noqa: E402
import throughput_metrics as TM  # noqa: E402
import throughput_run as TR  # noqa: E402

REPO = BENCH.parent
SMALL = ["--input-len", "8", "--output-len", "5", "--warmup-output-len", "1", "--forward-warmup", "1",
         "--forward-reps", "2"]


@pytest.fixture(scope="module")
def tiny3_dir(tmp_path_factory) -> Path:
    """A 3-layer tiny checkpoint (window, window, CSA + MTP): every step ~3x cheaper than the 8-layer one."""
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("throughput_tiny3"), {"num_hidden_layers": 3}, seed=0)


# ---- arithmetic ------------------------------------------------------------------------------------

def test_steady_state_is_the_window_where_every_request_decodes():
    """Three requests; steps every 10 ms except 30 ms ones while prefills or finishes share the batch.
    Request r's first token comes at step r, it generates 6 tokens: all three decode from step 2 to
    step 5 (request 0's last), whose gaps are 10 ms; the 30 ms gaps lie outside that window."""
    step_t = [0.0, 0.030, 0.060, 0.070, 0.080, 0.090, 0.120, 0.150]
    times = [step_t[r:r + 6] for r in range(3)]
    s = TM.steady_state(times)
    assert s["basis"] == "all requests decoding" and s["concurrency"] == 3
    assert s["step_ms"] == pytest.approx(10.0)
    assert s["num_gaps"] == 9 and s["window_s"] == pytest.approx(0.030)
    assert s["tok_s"] == pytest.approx(300.0)


def test_steady_state_falls_back_to_the_peak_in_waves():
    """max_num_seqs 2, four requests: two waves, never all four decoding; the peak (2) is used."""
    wave1 = [[0.0, 0.01, 0.02, 0.03]] * 2
    wave2 = [[0.05, 0.07, 0.09, 0.11]] * 2
    s = TM.steady_state(wave1 + wave2)
    assert s["concurrency"] == 2 and s["basis"].startswith("peak")
    assert s["num_gaps"] == 12 and s["step_ms"] == pytest.approx(15.0)
    assert TM.steady_state([[1.0], [2.0]]) is None and TM.steady_state([]) is None


def test_percentiles_and_comparison():
    p = TM.percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5)
    assert TM.percentiles([]) is None
    c = TM.compare(3.0, 64, 2.0)
    assert c["engine_over_forward"] == pytest.approx(1.5) and c["host_overhead_pct"] == pytest.approx(50.0)
    assert c["forward_tok_s"] == pytest.approx(32000.0) and c["engine_vs_forward_tok_s"] == pytest.approx(2 / 3)
    assert TM.compare(None, 4, 2.0)["host_overhead_pct"] is None


def test_dummy_config_is_cut_like_the_sweep(tmp_path):
    base = dict(config=None, tiny=False, layers=3, expert_dtype=None, mtp=False)
    cfg, source, label = TR.dummy_config(SimpleNamespace(**base))
    assert cfg["num_hidden_layers"] == 3 and cfg["compress_ratios"] == [4, 128, 4]
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["expert_dtype"] == "fp8"
    assert cfg["hidden_size"] == 4096 and label == "deepseek-v4-flash_3L" and source.endswith("config.json")
    cfg, _, _ = TR.dummy_config(SimpleNamespace(**{**base, "mtp": True}))
    assert cfg["num_nextn_predict_layers"] == 1 and len(cfg["compress_ratios"]) == 4
    cfg, _, label = TR.dummy_config(SimpleNamespace(**{**base, "tiny": True, "layers": None}))
    assert cfg["num_hidden_layers"] == 8 and len(cfg["compress_ratios"]) == 8 and label == "tiny"
    with pytest.raises(SystemExit):
        TP.main(["--model", str(tmp_path), "--layers", "2"])
    with pytest.raises(SystemExit):
        TP.main(["--tiny", "--config", str(tmp_path), "--json", str(tmp_path / "x.json")])


# ---- end to end ------------------------------------------------------------------------------------

def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_row(row: dict, output_len: int = 5, input_len: int = 8) -> None:
    assert row["status"] == "ok", row["status"]
    n = row["num_prompts"]
    assert row["num_requests"] == n and row["output_tokens"] == n * output_len
    assert row["prompt_tokens"] == n * input_len
    for k in ("elapsed_s", "requests_per_s", "output_tok_s", "total_tok_s", "warmup_s"):
        assert _pos(row[k]), k
    assert row["total_tok_s"] > row["output_tok_s"]
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        d = row[k]
        assert all(_pos(d[p]) for p in ("mean", "p50", "p90", "p99")), (k, d)
        assert d["p50"] <= d["p90"] <= d["p99"], (k, d)
    assert row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"] and row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"]
    assert row["queue_ms"]["p50"] >= 0 and row["queue_ms"]["p99"] <= row["ttft_ms"]["p99"]
    assert row["e2e_ms"]["p99"] <= row["elapsed_s"] * 1e3
    s = row["steady"]
    assert s["step_ms"] >= 0 and s["concurrency"] == row["concurrency"] and s["num_gaps"] >= 1
    assert s["basis"] == "all requests decoding" and _pos(s["tok_s"])
    f = row["forward"]
    assert f["status"] == "ok" and _pos(f["step_ms"]) and f["batch"] == row["concurrency"]
    assert f["context"] == input_len + output_len // 2 and len(f["eager"]["samples_ms"]) >= 1
    c = row["vs_forward"]
    assert _pos(c["engine_over_forward"]) and _pos(c["forward_tok_s"]) and _pos(c["engine_vs_forward_tok_s"])
    assert c["host_overhead_pct"] == pytest.approx((c["engine_over_forward"] - 1) * 100)


def check_result(r: dict, path: Path) -> dict:
    on_disk = json.loads(path.read_text())
    assert on_disk["rows"] == json.loads(json.dumps(r["rows"], default=str))
    for k in ("schema", "created", "device", "device_name", "versions", "command", "settings", "model",
              "engine", "startup_s", "first_request", "rows", "definitions", "async_switch", "elapsed_s",
              "commit", "complete"):
        assert k in on_disk, k
    assert on_disk["device"] == "cpu" and on_disk["versions"]["torch"] and on_disk["complete"] is True
    assert on_disk["settings"]["dtype"] == "float32"
    assert _pos(on_disk["startup_s"])
    fr = on_disk["first_request"]
    assert _pos(fr["ttft_cold_ms"]) and _pos(fr["ttft_warm_ms"]) and _pos(fr["cold_over_warm"])
    return on_disk


def _has_dummy_loader() -> bool:
    """The dummy loader is wired into the runner once its source names the format."""
    src = "".join(p.read_text() for p in (REPO / "deepinfer_core").rglob("*.py")
                  if p.parent.name in ("runner", "model") and p.name != "dummy_weights.py")
    return '"dummy"' in src or "'dummy'" in src


def test_main_on_a_tiny_checkpoint(tiny3_dir, tmp_path, capsys):
    path, prof = tmp_path / "tp.json", tmp_path / "host.prof"
    r = TP.main(["--model", str(tiny3_dir), "--num-prompts", "3", "--profile", str(prof), "--json", str(path),
                 *SMALL])
    out = check_result(r, path)
    assert len(out["rows"]) == 1 and out["rows"][0]["concurrency"] == 3
    check_row(out["rows"][0])
    assert out["model"]["load_format"] == "auto" and out["engine"]["max_num_seqs"] == 3
    assert out["async_switch"].startswith("not needed") and out["engine"]["tokenizer"]
    assert prof.is_file() and out["rows"][0]["profile"]["path"] == str(prof)
    printed = capsys.readouterr().out
    assert "tottime" in printed and "step/fwd" in printed


def test_sweep_batches_and_compare_async(tmp_path, request):
    """On random weights (--tiny --load-format dummy) where the tree has the dummy loader, else on the
    3-layer checkpoint."""
    dummy = _has_dummy_loader()
    model = ["--tiny", "--layers", "3"] if dummy else ["--model", str(request.getfixturevalue("tiny3_dir"))]
    path = tmp_path / "tp.json"
    r = TP.main([*model, "--sweep-batches", "1,2", "--compare-async", "--no-detokenize", "--json", str(path),
                 *SMALL])
    out = check_result(r, path)
    rows = out["rows"]
    got = [(x["concurrency"], x["async_scheduling"]) for x in rows]
    assert got == [(1, True), (1, False), (2, True), (2, False)]
    for row in rows:
        check_row(row)
        assert row["async_effective"] in (None, row["async_scheduling"])    # None: the engine does not say
    assert rows[0]["forward"] == rows[1]["forward"] and rows[2]["forward"] == rows[3]["forward"]
    assert out["engine"]["max_num_seqs"] == 2 and set(out["async_on_over_off"]) == {"1", "2"}
    if dummy:
        cfg = out["model"]["config"]
        assert out["model"]["load_format"] == "dummy" and out["model"]["path"] is None
        assert cfg["num_hidden_layers"] == 3 and cfg["num_nextn_predict_layers"] == 0


# ---- DeepSeek-V4.1 -------------------------------------------------------------------------

def test_dummy_config_cuts_a_v41_config_with_the_shared_cut():
    """The V4.1-width config cut by v41_cut (no weights built): a valid V4.1 config, FP4 experts,
    Engram tables capped, the drafter gone; --mtp and too few layers refused, naming the option."""
    from deepinfer_core.config import ModelConfig
    width = str(REPO / "tests" / "data" / "deepseek-v4.1-flash" / "config.json")
    base = dict(config=width, tiny=False, layers=4, expert_dtype=None, mtp=False, engram_rows=1009)
    cfg, source, label = TR.dummy_config(SimpleNamespace(**base))
    m = ModelConfig.from_dict(cfg)
    assert m.family == "v41" and m.num_hidden_layers == 4 and m.n_prefill_layer == 3
    assert m.expert_dtype == "fp4" and m.engram.vocab_sizes == (1009,) * 3
    assert m.num_nextn_predict_layers == 0
    assert label == "deepseek-v4.1-flash_4L" and source == width
    with pytest.raises(SystemExit, match="--mtp"):
        TR.dummy_config(SimpleNamespace(**{**base, "mtp": True}))
    with pytest.raises(SystemExit, match="--layers: 3 layers; allowed .*4..40"):
        TR.dummy_config(SimpleNamespace(**{**base, "layers": 3}))


def test_main_on_a_tiny_v41_cut(tmp_path):
    """The tiny V4.1 (C2 and C1 halves, candidate blocks, Engram) cut to 4 layers, random weights
    through LLM(load_format="dummy"): every figure, the family and the cut in the JSON."""
    from deepinfer_core.tools.tiny_config_v41 import tiny_v41_config_dict
    cfg_path, path = tmp_path / "config.json", tmp_path / "tp.json"
    cfg_path.write_text(json.dumps(tiny_v41_config_dict()))
    r = TP.main(["--config", str(cfg_path), "--layers", "4", "--num-prompts", "2",
                 "--json", str(path), *SMALL])
    out = check_result(r, path)
    assert len(out["rows"]) == 1
    check_row(out["rows"][0])
    model = out["model"]
    assert model["family"] == "v41" and model["load_format"] == "dummy"
    assert model["config"]["text_config"]["compress_ratios"] == [0, 0, 2, 1]
    assert model["v41_cut"]["layers"] == 4 and model["v41_cut"]["engram_layer_ids"] == [1, 2]
