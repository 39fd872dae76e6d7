"""benchmarks/serve_gap.py on the CPU, tiny config: every mode serves the same requests to the end and
the engine thread's profile is the engine's. Nothing here asserts a speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_serve_gap_runs_every_mode_on_the_tiny_config(tmp_path):
    out = tmp_path / "gap.json"
    r = subprocess.run([sys.executable, str(BENCH / "serve_gap.py"), "--tiny", "--input-len", "16", "--output-len",
                        "4", "--concurrency", "1,2", "--max-model-len", "128", "--rounds", "2", "--engine-process",
                        "--out", str(out)],
                       cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["args"]["dtype"] == "float32" and [row["concurrency"] for row in d["rows"]] == [1, 2]
    for row in d["rows"]:
        for mode in ("offline", "stream", "thread", "thread+p", "process"):
            assert row[mode]["seconds"] > 0 and row[mode]["output_tok_s"] > 0, (mode, row[mode])
        for mode in ("thread", "process"):            # closed-loop consumers: a first-output time per request
            assert 0 < row[mode]["ttft_p50_ms"] <= row[mode]["ttft_p99_ms"], (mode, row[mode])
        assert "engine.py" in row["engine_thread_profile"] and "step" in row["engine_thread_profile"]
