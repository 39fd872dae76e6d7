"""benchmarks/fp4_moe_replay.py at a small width: the bench's seeded data replayed under the interpreter,
each chosen token's FP4 and FP8 MoE outputs compared (equal: the decode gives the re-encoding's values)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_replay_compares_each_token_bit_for_bit():
    r = subprocess.run([sys.executable, "fp4_moe_replay.py", "--experts", "8", "--hidden", "256", "--inter", "128",
                        "--batches", "1,8", "--batch", "8", "--tokens", "0,3"], cwd=BENCH, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("b8 token")]
    assert [line.split(":")[0].split()[2] for line in lines] == ["0", "3"]
    assert all("FP4 == FP8 True" in line for line in lines), lines
