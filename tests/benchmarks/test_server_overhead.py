"""benchmarks/server_overhead.py at its smallest: two prompts through `LLM.generate` and through the
server over the stand-in runner; the JSON holds both paths' times. Nothing here asserts a speed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import server_overhead as SO  # noqa: E402


def test_both_paths_are_timed_and_written(tmp_path, capsys):
    path = tmp_path / "out.json"
    SO.main(["--requests", "2", "--prompt-len", "300", "--repeats", "1", "--json", str(path)])
    out = json.loads(path.read_text())
    assert len(out["generate_ttft_ms_p50"]) == len(out["server_ttft_ms_p50"]) == 1
    assert out["generate_ttft_ms"] > 0 and out["server_ttft_ms"] > 0
    assert "server adds" in capsys.readouterr().out
