"""Where Engram tables live: pinned host memory on a GPU whose pointwise method gathers from it
(unless DEEPINFER_ENGRAM_FORCE_GPU_STORAGE / engram_force_gpu_storage), else with the model; a
host-resident table stays put when the model moves. (Pinning itself needs CUDA: tests/gpu.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.engine_config import EngineConfig
from deepinfer_core.model.engram import EngramTable, engram_storage
from deepinfer_core.ops.portable_pointwise import gather_rows

HOST = SimpleNamespace(reads_host_memory=True)
DEVICE_ONLY = SimpleNamespace(reads_host_memory=False)


@pytest.mark.parametrize("device,force,pointwise,want", [
    ("cuda", False, HOST, "host"),
    ("cuda:1", False, HOST, "host"),
    ("cuda", True, HOST, "device"),
    ("cuda", False, DEVICE_ONLY, "device"),
    ("cpu", False, HOST, "device"),
])
def test_storage_choice(device, force, pointwise, want):
    assert engram_storage(device, force, pointwise) == want


def test_a_host_resident_table_stays_when_the_model_moves():
    holder = torch.nn.Module()
    holder.table = EngramTable(6, 64)
    holder.other = torch.nn.Linear(2, 2)
    holder.table.host_resident = True          # what keep_on_host sets (after pinning)
    holder.to("meta")
    assert holder.table.weight.device.type == "cpu" and holder.other.weight.device.type == "meta"


def test_lookup_goes_through_the_bound_gather():
    table = EngramTable(5, 32)
    table.weight.copy_(torch.randn(5, 32).to(torch.float8_e4m3fn))
    table.scale.copy_(torch.full((5, 1), 2.0).to(torch.float8_e8m0fnu))
    rows = torch.tensor([[4, 0], [2, 2]])
    want = gather_rows(table.weight, table.scale, rows)
    assert torch.equal(want[1, :32], table.weight[2].float() * 2)
    calls = []
    table.gather = lambda w, s, r: calls.append(r) or gather_rows(w, s, r)
    assert torch.equal(table.lookup(rows), want) and len(calls) == 1


def test_the_option_and_its_variable(monkeypatch):
    assert EngineConfig.from_options().model.engram_force_gpu_storage is False
    assert EngineConfig.from_options(engram_force_gpu_storage=True).model.engram_force_gpu_storage
    monkeypatch.setenv("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE", "1")
    assert EngineConfig.from_options().model.engram_force_gpu_storage is True
    with pytest.raises(ValueError, match="engram_force_gpu_storage"):
        EngineConfig.from_options(engram_force_gpu_storage="sometimes")
