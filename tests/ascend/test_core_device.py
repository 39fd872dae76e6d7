"""The core's device-generic paths on the simulated NPU: the cache budget's memory query."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.cache.budget import CacheRequest, resolve_num_blocks
from deepinfer_core.cache.state_cache import CacheLayout
from deepinfer_core.config import ModelConfig
from deepinfer_core.device_module import peak_memory_bytes
from deepinfer_core.tools.tiny_config import tiny_config_dict

GiB = 1 << 30


def test_budget_uses_the_npu_memory_figures(make_fake_npu):
    fake = make_fake_npu(mem_info=(6 * GiB, 8 * GiB))          # 2 GiB in use
    layout = CacheLayout.from_config(ModelConfig.from_dict(tiny_config_dict()), torch.float32,
                                     backtrack=6)
    req = CacheRequest(num_slots=2, gpu_memory_utilization=0.5)
    n, _, note = resolve_num_blocks(layout, req, "npu:0", lambda: GiB // 2)
    budget = 4 * GiB - 2 * GiB - GiB // 2
    assert n == (budget - 2 * layout.slot_bytes) // layout.block_bytes
    assert note.startswith("gpu_memory_utilization (2.00 GiB in use, 0.50 GiB activations): "
                           f"{budget} bytes")
    fake.state.mem_info = (GiB, 8 * GiB)                        # 7 GiB in use: nothing left
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5: 4.00 GiB allowed but 7.00"):
        resolve_num_blocks(layout, req, "npu", lambda: 0)


def test_peak_memory_is_measured_through_torch_npu(fake_npu):
    calls = []
    assert peak_memory_bytes("npu:0", calls.append, 1) == 0 and calls == [1]
    assert [e[0] for e in fake_npu.state.log].count("synchronize") == 2
    with pytest.raises(ValueError, match="device='cpu'.*torch has none for 'cpu'"):
        peak_memory_bytes("cpu", calls.append, 2)
