"""The NPUGraph stand-in: replay on static buffers, host syncs refused during capture."""
from __future__ import annotations

import pytest
import torch
from fake_npu import HostSyncError


def test_replay_reads_static_inputs_and_writes_static_outputs(fake_npu):
    import torch_npu
    static_x = torch.zeros(2, 4)
    gamma = torch.ones(4)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), capture_error_mode="thread_local"):
        y, _ = torch_npu.npu_rms_norm(static_x + 1.0, gamma, epsilon=0.0)
        out = y * 2.0
    torch.testing.assert_close(out, torch.full((2, 4), 2.0))
    new_x = torch.tensor([[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 4.0]])
    static_x.copy_(new_x)
    g.replay()
    y_ref, _ = torch_npu.npu_rms_norm(new_x + 1.0, gamma, epsilon=0.0)
    torch.testing.assert_close(out, y_ref * 2.0)
    assert not torch.npu.is_current_stream_capturing()


def test_replay_repeats_in_place_writes(fake_npu):
    cache = torch.zeros(4)
    slot = torch.tensor([1])
    val = torch.tensor([5.0])
    g = torch.npu.NPUGraph()
    g.capture_begin()
    cache.index_copy_(0, slot, val)
    g.capture_end()
    slot.fill_(3)
    val.fill_(7.0)
    g.replay()
    assert cache.tolist() == [0.0, 5.0, 0.0, 7.0]


@pytest.mark.parametrize("sync", [
    lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: t.cpu(), lambda t: bool(t[0] > 0),
    lambda t: torch.npu.synchronize(), lambda t: t.nonzero(), lambda t: t.to("cpu")])
def test_host_sync_during_capture_raises(fake_npu, sync):
    t = torch.ones(3)
    g = torch.npu.NPUGraph()
    with pytest.raises(HostSyncError):
        with torch.npu.graph(g):
            sync(t)
    assert not torch.npu.is_current_stream_capturing()
    sync(t)                                          # fine again outside capture


def test_graph_api_shape(fake_npu):
    g = torch.npu.NPUGraph()
    assert not hasattr(g, "instantiate")
    with pytest.raises(TypeError):
        torch.npu.NPUGraph(keep_graph=True)
    with pytest.raises(RuntimeError, match="nothing captured"):
        g.replay()
    with pytest.raises(ValueError, match="capture_error_mode"):
        g.capture_begin(capture_error_mode="strict")
    pool = torch.npu.graph_pool_handle()
    with torch.npu.graph(g, pool=pool, stream=torch.npu.Stream()):
        pass
    assert g.pool() == pool
