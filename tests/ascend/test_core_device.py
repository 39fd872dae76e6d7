"""The core's device-generic paths on the simulated NPU: the cache budget's memory query, the
process-group backend chosen from the device type."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepinfer_core.cache.budget import CacheRequest, resolve_num_blocks
from deepinfer_core.cache.state_cache import CacheLayout
from deepinfer_core.config import ModelConfig
from deepinfer_core.device_module import peak_memory_bytes
from deepinfer_core.parallel.groups import ParallelLayout, device_backend, init_process_groups
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


def test_npu_process_groups_are_hccl(fake_npu, monkeypatch, tmp_path):
    from fake_npu import hccl
    # torch_npu's import registers hccl with devices=["npu"]; the fake registers it for "cpu" (alias
    # mode), where gloo stays torch's default, so the npu entry is what the real import would add
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "npu", "hccl")
    assert (device_backend("npu:0"), device_backend("cpu")) == ("hccl", "gloo")
    with pytest.raises(ValueError, match="device='tpu:0': .* no backend .*: cpu -> gloo, cuda"):
        device_backend("tpu:0")
    with pytest.raises(ValueError, match="backend='mpi': allowed values: gloo, hccl, nccl, xccl "):
        init_process_groups(ParallelLayout(1, 0, 1, True), backend="mpi")
    made = len(hccl.created)
    dist.init_process_group("hccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        groups = init_process_groups(ParallelLayout(1, 0, 1, True), backend=device_backend("npu"),
                                     device=torch.device("cpu"), env={})
        x = torch.ones(2)
        dist.all_reduce(x, group=groups.ep)
        assert dist.get_backend(groups.ep) == "hccl" and dist.get_backend(groups.cpu) == "gloo"
        assert x.tolist() == [1.0, 1.0] and len(hccl.created) == made + 2     # world and ep
    finally:
        dist.destroy_process_group()
