"""benchmarks/host_costs.py at its smallest: every operation timed now and before, the JSON
written. Nothing here asserts a speed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import host_costs as HC  # noqa: E402


def test_every_operation_is_timed_both_ways(tmp_path):
    path = tmp_path / "out.json"
    HC.main(["--prompt-len", "300", "--nodes", "500", "--number", "2", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 3 and all(r["now_ms"] > 0 and r["before_ms"] > 0 for r in rows)
