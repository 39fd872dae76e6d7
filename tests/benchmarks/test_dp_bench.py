"""examples/multi_gpu/run_dp_bench.sh (data-parallel serving) on the CPU, CI-sized: its
dry run prints the 2- and 4-GPU commands, which the benchmark's and the server's own parsers accept;
the same script path end to end on two CPU ranks with expert parallelism (a 2-layer tiny model with
FP4 experts, concurrency 1 and 2): every request succeeds and the JSON has each rank's weight and
state-cache bytes and the output throughput per GPU; the server's per-rank gauges read back through
serve_bench's parser; the report's comparison with a reference. Nothing here asserts a speed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "multi_gpu" / "run_dp_bench.sh"
sys.path.insert(0, str(REPO / "benchmarks"))

import dp_report as DR  # noqa: E402
import serve_bench as SB  # noqa: E402
import serve_bench_metrics as SM  # noqa: E402

from deepinfer_core.serve.__main__ import build_parser as serve_parser  # noqa: E402
from deepinfer_core.serve.metrics import gauge_lines, resident_bytes  # noqa: E402


def run_script(dp: int, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(dp)],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


@pytest.mark.parametrize("dp", [2, 4])
def test_dry_run_prints_the_full_size_commands(dp):
    """The serve_bench command parses (serve_bench's resolve, the server's parser for --launch) and is the
    full size: 43 layers, FP4 experts kept FP4, DP ranks with EP, 8k/1k at concurrency 1..512; the
    report compares with SGLang's 4xH200 figures only at DP=4."""
    p = run_script(dp, {"DRY_RUN": "1"}, timeout=60)
    assert p.returncode == 0, p.stderr
    bench, report = [shlex.split(line) for line in p.stdout.strip().splitlines()]
    assert bench[:2] == [sys.executable, "benchmarks/serve_bench.py"]
    a = SB.resolve(bench[2:])
    assert (a.dummy_layers, a.expert_dtype, a.input_len, a.output_len) == (43, "fp4", 8192, 1024)
    assert a.concurrency == [1, 64, 256, 512] and a.prompts_per_concurrency == 1 and a.label == f"dp{dp}_h200"
    assert a.out == f"benchmarks/results/serve_bench_dp{dp}_h200.json"
    s = serve_parser().parse_args(shlex.split(a.launch))
    assert s.data_parallel_size == dp and s.enable_expert_parallel and s.fp4_experts and s.enable_ep_cuda_graphs
    assert s.device == "cuda" and s.dtype == "bfloat16" and s.max_model_len == 9216 + 128
    assert s.max_num_seqs == 512 // dp
    assert report[1] == "benchmarks/dp_report.py" and report[2] == a.out
    compare = report[report.index("--compare") + 1] if "--compare" in report else None
    assert compare == ("sglang-4xh200" if dp == 4 else None)


def test_dp_bench_end_to_end_on_two_cpu_ranks(tmp_path):
    """The script's path at tiny scale: two CPU ranks with EP serve a 2-layer tiny model (FP4 experts);
    every request completes, each rank reports its weights, cache and device, per-GPU = total / 2."""
    from deepinfer_core.tools.tiny_config import tiny_config_dict

    cfg = tmp_path / "tiny_config.json"
    cfg.write_text(json.dumps(tiny_config_dict()))
    env = {
        "DEVICE": "cpu",
        "LAYERS": "2",
        "DUMMY_CONFIG": str(cfg),
        "INPUT_LEN": "16",
        "OUTPUT_LEN": "4",
        "CONCURRENCY": "1,2",
        "WARMUP_INPUT_LEN": "8",
        "LABEL": "dp2_cpu_tiny",
        "OUT_DIR": str(tmp_path),
        "SERVER_LOG": str(tmp_path / "server.log"),
    }
    p = run_script(2, env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "no --fp4-experts" in p.stdout  # said aloud, not silently dropped
    d = json.loads((tmp_path / "serve_bench_dp2_cpu_tiny.json").read_text())
    assert d["complete"] and d["server"]["exit_code"] == 0 and d["settings"]["expert_dtype"] == "fp4"
    assert d["server"]["dummy_model"]["config"]["expert_dtype"] == "fp4"
    launched = d["server"]["launched"]
    assert "--data-parallel-size" in launched and "--enable-expert-parallel" in launched
    assert [r["concurrency"] for r in d["rows"]] == [1, 2]
    for r in d["rows"]:
        assert r["status"] == "ok" and r["completed"] == r["num_prompts"] == r["concurrency"] and r["failed"] == 0
        assert r["total_output_tokens"] == 4 * r["num_prompts"] and r["warmup"]["failed"] == 0
        assert r["output_throughput_per_gpu"] == pytest.approx(r["output_throughput"] / 2)
    mem = d["server"]["memory"]
    assert d["server"]["data_parallel_size"] == 2 and [r["rank"] for r in mem["ranks"]] == [0, 1]
    for r in mem["ranks"]:
        assert r["weight_bytes"] > 0 and r["cache_bytes"] > 0 and r["device"] == "cpu" and r["device_name"]
    assert mem["weight_bytes"] == sum(r["weight_bytes"] for r in mem["ranks"])
    assert any("fewer prompts than the default" in n for n in d["workload_notes"])
    rep = json.loads((tmp_path / "dp_bench_dp2_cpu_tiny.json").read_text())
    assert rep["data_parallel_size"] == 2 and rep["memory"] == mem and rep["reference"] is None
    assert [r["output_tok_s_per_gpu"] for r in rep["rows"]] == [r["output_throughput_per_gpu"] for r in d["rows"]]


def test_per_rank_gauges_read_back_by_the_bench():
    """The server's rendering (totals unlabelled, each rank's series with rank="r"; an info series only
    per rank) parsed by serve_bench: each rank's own weights, cache and device; the totals summed."""
    ranks = [
        {
            "deepinfer_weight_bytes": 10,
            "deepinfer_cache_bytes": 4,
            'deepinfer_device_info{device="cuda:0",name="NVIDIA H200"}': 1,
            "deepinfer_requests_running": 2,
        },
        {
            "deepinfer_weight_bytes": 11,
            "deepinfer_cache_bytes": 5,
            'deepinfer_device_info{device="cuda:1",name="NVIDIA \\"H\\" 200"}': 1,
            "deepinfer_requests_running": 1,
        },
    ]
    total = {
        "deepinfer_weight_bytes": 21,
        "deepinfer_cache_bytes": 9,
        "deepinfer_requests_running": 3,
        'deepinfer_device_info{device="cuda:0",name="NVIDIA H200"}': 1,
    }
    text = "\n".join(gauge_lines(total, ranks)) + "\n"
    assert "deepinfer_requests_running 3\n" in text and 'deepinfer_requests_running{rank="1"} 1' in text
    assert text.count("# TYPE deepinfer_device_info gauge") == 1 and "deepinfer_device_info{device" not in text
    mem = SM.server_memory(text)
    assert mem == {
        "ranks": [
            {"rank": 0, "weight_bytes": 10, "cache_bytes": 4, "device": "cuda:0", "device_name": "NVIDIA H200"},
            {"rank": 1, "weight_bytes": 11, "cache_bytes": 5, "device": "cuda:1", "device_name": 'NVIDIA "H" 200'},
        ],
        "weight_bytes": 21,
        "cache_bytes": 9,
    }
    one = SM.server_memory("\n".join(gauge_lines({**ranks[0], "deepinfer_weight_bytes": 7}, [])))
    assert one["ranks"] == [
        {"rank": None, "weight_bytes": 7, "cache_bytes": 4, "device": "cuda:0", "device_name": "NVIDIA H200"}
    ]
    assert SM.server_memory("deepinfer_requests_running 0\n") == {
        "ranks": [],
        "weight_bytes": None,
        "cache_bytes": None,
    }


def test_resident_bytes_counts_each_storage_once():
    """Two views of one packed stack and a buffer shared by two modules count once; a parameter of its own
    counts in full."""
    m = nn.Module()
    stack = torch.zeros(4, 8)
    m.register_buffer("a", stack[:2], persistent=False)
    m.register_buffer("b", stack[2:], persistent=False)
    m.sub = nn.Module()
    m.sub.register_buffer("again", stack, persistent=False)
    m.w = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    assert resident_bytes(m) == 4 * 8 * 4 + 3 * 8


def test_report_compares_per_gpu_throughput_at_high_concurrency(tmp_path):
    """The best per-GPU row at concurrency >= 256 against the reference's range; the goal is 2x its upper
    end; TPOT at concurrency 1 beside theirs. Two parts of one run join by concurrency."""

    def run(rows: list[tuple[int, float]]) -> dict:
        return {
            "label": "dp4_h200",
            "complete": True,
            "commit": "abc",
            "settings": {"input_len": 8192, "output_len": 1024, "dummy_layers": 43, "expert_dtype": "fp4"},
            "server": {"data_parallel_size": 4, "memory": {"ranks": []}, "dummy_model": None, "launched": None},
            "rows": [
                {
                    "concurrency": c,
                    "num_prompts": c,
                    "completed": c,
                    "failed": 0,
                    "status": "ok",
                    "output_throughput": 4 * g,
                    "output_throughput_per_gpu": g,
                    "tpot_ms": {"p50": 9.0, "mean": 9.5},
                }
                for c, g in rows
            ],
            "workload_notes": [],
        }

    parts = [tmp_path / "a.json", tmp_path / "b.json"]
    parts[0].write_text(json.dumps(run([(1, 50.0), (64, 600.0), (256, 1100.0)])))
    parts[1].write_text(json.dumps(run([(512, 1050.0)])))
    rep = DR.main([*map(str, parts), "--compare", "sglang-4xh200", "--out", str(tmp_path / "r.json")])
    assert [r["concurrency"] for r in rep["rows"]] == [1, 64, 256, 512]
    c = rep["comparison"]
    assert c["ours_at_concurrency"] == 256 and c["ours_output_tok_s_per_gpu"] == 1100.0
    assert c["x_their_high"] == pytest.approx(1100 / 506) and c["goal_output_tok_s_per_gpu"] == 1012.0
    assert c["goal_met"] and c["ours_tpot_ms_concurrency_1"] == 9.0 and c["their_tpot_ms_concurrency_1"] == 3.37
    assert "SGLang" in rep["reference"]["source"] and json.loads((tmp_path / "r.json").read_text())["comparison"] == c
    other = tmp_path / "c.json"
    other.write_text(json.dumps({**run([]), "settings": {"input_len": 1024, "output_len": 1024}}))
    with pytest.raises(SystemExit, match="different runs"):
        DR.main([str(parts[0]), str(other), "--out", str(tmp_path / "x.json")])
