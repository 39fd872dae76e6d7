"""benchmarks/aot_sm90.py on the CPU: the fused MoE's w2 kernel compiles for sm_90 without a GPU, FP8 and
FP4 (byte-permute decode, inline PTX) alike, and the report reads registers, MMAs, layouts and SASS."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import aot_sm90 as aot  # noqa: E402


@pytest.mark.parametrize("variant", ["fp8", "fp4 prmt"])
def test_w2_compiles_for_sm90_and_is_described(variant):
    w4, prmt = aot.VARIANTS[variant]
    kernel = aot.w2(w4, prmt, 4, 4, 16)
    d = aot.describe(kernel)
    assert d["registers"] and d["registers"] <= 255 and d["local_bytes"] is not None
    assert d["mma"] and all(m.startswith("mma.sync") for m in d["mma"])      # 16-row tiles: mma.sync, not wgmma
    assert d["dot_kwidths"] and d["sass_instructions"] > 100
    # the byte-permute decode's inline PTX is in the kernel exactly when asked for
    assert ("prmt.b32 w," in kernel.asm["ptx"]) == prmt
