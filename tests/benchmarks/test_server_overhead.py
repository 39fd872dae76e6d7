"""benchmarks/server_overhead.py at its smallest: two prompts through `LLM.generate` and through the
server over the stand-in runner; the JSON holds both paths' times. Nothing here asserts a speed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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


def test_a_simulated_step_time_is_waited_for(tmp_path):
    """--step-ms 40,0: each step sleeps 40 ms: no first token comes sooner on either path."""
    path = tmp_path / "out.json"
    SO.main(["--requests", "2", "--prompt-len", "50", "--repeats", "1", "--step-ms", "40,0",
             "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["generate_ttft_ms"] >= 40 and out["server_ttft_ms"] >= 40
    assert out["settings"]["step_ms"] == [40.0, 0.0]
    assert out["cached_tokens"] == {"generate": 0, "server": 0}
    with pytest.raises(SystemExit):
        SO.main(["--step-ms", "5"])


def test_a_follow_up_turn_hits_the_prefix_cache(tmp_path):
    """--follow-up 8: prefix caching on; the timed turn resends each 300-id prompt + its output +
    8 ids, and both paths serve two 128-token blocks of each from the cache."""
    path = tmp_path / "out.json"
    SO.main(["--requests", "2", "--prompt-len", "300", "--output-len", "4", "--follow-up", "8",
             "--repeats", "1", "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["cached_tokens"] == {"generate": 2 * 256, "server": 2 * 256}
    assert out["generate_ttft_ms"] > 0 and out["server_ttft_ms"] > 0
