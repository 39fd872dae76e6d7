"""The core's device-generic paths on the simulated NPU: the cache budget's memory query, the
process-group backend chosen from the device type, decode graphs on `torch.npu.NPUGraph`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from deepinfer_core.cache.budget import CacheRequest, resolve_num_blocks
from deepinfer_core.cache.state_cache import CacheLayout, StateCache
from deepinfer_core.config import ModelConfig
from deepinfer_core.device_module import peak_memory_bytes
from deepinfer_core.parallel.groups import ParallelLayout, device_backend, init_process_groups
from deepinfer_core.runner.cuda_graphs import DecodeGraphs, GraphApi
from deepinfer_core.tools.tiny_config import tiny_config_dict

GiB = 1 << 30


def tiny_layout() -> CacheLayout:
    return CacheLayout.from_config(ModelConfig.from_dict(tiny_config_dict()), torch.float32,
                                   backtrack=6)


def test_budget_uses_the_npu_memory_figures(make_fake_npu):
    fake = make_fake_npu(mem_info=(6 * GiB, 8 * GiB))          # 2 GiB in use
    layout = tiny_layout()
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
    # (other tests of the session may have registered backends of their own: not listed here)
    with pytest.raises(ValueError, match=r"backend='mpi': allowed values: .*\bhccl\b.*npu -> hccl"):
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


class _Meta:
    """Fixed-shape metadata: each sequence's first block, refilled on the device."""

    def __init__(self, batch):
        self.first_block = batch.backend_meta["first_block"] = torch.zeros(batch.num_seqs,
                                                                           dtype=torch.int64)

    def extra_inputs(self, starts):
        return []

    def derive(self, slots, block_table, extra):
        self.first_block.copy_(block_table[slots, 0])


class _GraphBackend:
    batch_invariant = False

    def forward(self, attn, inp, batch, states):
        raise NotImplementedError

    def graph_num_extra(self, num_seqs, query_len):
        return 0

    def graph_meta(self, batch, max_blocks):
        return _Meta(batch)


def _tiny_model(sync: bool):
    table = torch.arange(40.0).view(10, 4)

    def model(batch):
        if sync:
            batch.positions.max().item()                           # a host sync
        logits = table[batch.input_ids] * (batch.positions[:, None] + 1)
        return SimpleNamespace(logits=logits + batch.backend_meta["first_block"][:, None],
                               streams=logits)
    return model, table


@pytest.mark.parametrize("sync", [False, True])
def test_decode_graph_captures_and_replays_on_npu_graph(fake_npu, sync):
    cache = StateCache(tiny_layout(), 2, 4, "cpu", spare=True)   # alias mode: tensors on the CPU
    model, table = _tiny_model(sync)
    graphs = DecodeGraphs(model, cache, _GraphBackend(), max_seqs=2, max_blocks=2,
                          graph_api=GraphApi.of("npu"))
    seqs = [cache.bind(0, [1]), cache.bind(1, [2])]
    log = fake_npu.state.log
    if sync:                           # the fake NPUGraph refuses host syncs: eager from then on
        assert graphs.run([[3], [5]], seqs) is None and "HostSyncError" in graphs.failed
        return
    for step, ids in enumerate(([3, 5], [4, 6])):
        logits = graphs.run([[i] for i in ids], seqs)
        expect = table[ids] * (step + 1) + torch.tensor([[1.0], [2.0]])
        assert torch.equal(logits, expect)
        for st in seqs:
            st.num_tokens += 1
    names = [e[0] for e in log]
    assert names.count("NPUGraph.capture_begin") == 1 and names.count("NPUGraph.replay") == 2
    assert graphs.failed is None and isinstance(graphs.graphs[(2, 1)].graph, torch.npu.NPUGraph)
