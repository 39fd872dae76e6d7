"""benchmarks/weight_memory.py's meta-device accounting is exact: on the tiny config (FP4 experts) the
resident bytes it computes without any weights equal the bytes of the same model filled with random
checkpoint-format weights and processed by the nvidia backend's methods on the CPU, for both expert
forms; the checkpoint bytes are the loader's tensor set; FP4 experts take about half the bytes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import weight_memory as WM  # noqa: E402

from deepinfer_core.config import ModelConfig  # noqa: E402
from deepinfer_core.model.deepseek_v4 import build_model  # noqa: E402
from deepinfer_core.model.dummy_weights import fill_dummy_weights  # noqa: E402
from deepinfer_core.tools.tiny_config import tiny_config_dict  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_dict(tiny_config_dict())
    assert cfg.expert_dtype == "fp4"
    return cfg, WM.account(cfg)


@pytest.mark.parametrize("fp4_experts", [False, True])
def test_meta_accounting_equals_a_real_build(tiny, fp4_experts):
    cfg, accounted = tiny
    model = build_model(cfg, device="cpu")
    fill_dummy_weights(model, cfg, seed=1)
    WM.process_nvidia(model, torch.bfloat16, True, fp4_experts)
    form = accounted["fp4_experts" if fp4_experts else "fp8_experts"]
    assert form["fused_moe_layers"] == sum(1 for m in model.modules() if getattr(m, "nv_fused", None) is not None) > 0
    assert WM.tensor_bytes(model) == form["by_category"]


def test_checkpoint_bytes_and_the_fp4_saving(tiny):
    cfg, accounted = tiny
    assert accounted["checkpoint_bytes"] == accounted["fp8_experts"]["graph_bytes"]
    fp8, fp4 = (accounted[form]["by_category"] for form in ("fp8_experts", "fp4_experts"))
    for moe_part in ("experts", "mtp block"):       # the MTP block has its own MoE
        assert fp4[moe_part] < 0.8 * fp8[moe_part]
    assert {c: v for c, v in fp8.items() if c not in ("experts", "mtp block")} == \
        {c: v for c, v in fp4.items() if c not in ("experts", "mtp block")}
