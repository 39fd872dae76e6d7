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


# ---- fused fake ops: one opaque node each ------------------------------------------------------

def _sfa_args(g, t=3, keys=6, k=4):
    """TND SFA arguments of one query batch over `keys` keys (D 512, rope 64, bf16)."""
    q = torch.randn(t, 2, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(keys, 1, 512, generator=g).to(torch.bfloat16)
    idx = torch.full((t, 1, k), -1, dtype=torch.int32)
    idx[:, 0, :2] = torch.tensor([1, 0], dtype=torch.int32)
    return dict(query=q, key=kv, value=kv, sparse_indices=idx, scale_value=0.04,
                actual_seq_lengths_query=torch.tensor([t], dtype=torch.int32),
                actual_seq_lengths_kv=torch.tensor([keys], dtype=torch.int32),
                query_rope=torch.zeros(t, 2, 64, dtype=torch.bfloat16),
                key_rope=torch.zeros(keys, 1, 64, dtype=torch.bfloat16), sparse_block_size=1,
                layout_query="TND", layout_kv="TND", sparse_mode=0, attention_mode=2,
                sinks=torch.zeros(2))


def test_a_fused_op_is_one_node_replayed_on_its_inputs_current_values(fake_npu):
    """SFA captured once: the tape holds it as one node (none of its reference's aten ops), and a
    replay reads the keys, indices and lengths copied in since, as the device kernel would."""
    import torch_npu
    g = torch.Generator().manual_seed(0)
    args = _sfa_args(g)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out, _, _ = torch_npu.npu_sparse_flash_attention(**args)
        out2 = out * 2
    assert graph.fused_ops == ["npu_sparse_flash_attention"]
    assert graph.num_recorded_ops == 2                    # the fused node and the multiply
    new = _sfa_args(torch.Generator().manual_seed(1))
    new["sparse_indices"][:, 0, :4] = torch.tensor([5, 3, 2, 0], dtype=torch.int32)
    for name in ("query", "key", "sparse_indices"):
        args[name].copy_(new[name])
    graph.replay()
    want, _, _ = torch_npu.npu_sparse_flash_attention(**{**args, "value": args["key"]})
    torch.testing.assert_close(out2, want * 2)
    assert not torch.equal(out2, torch.zeros_like(out2))


def _host_reading_op(name="npu_rms_norm"):
    """A fake op (rms_norm's schema) whose reference reads a value on the host, as a reference
    reading actual_seq_lengths with .tolist() would."""
    from fake_npu.schema import FakeOp

    def reference(a):
        n = int(a.gamma[0].item())                  # a host read inside the fused op
        return a.input * n, a.input[..., :1].float()
    return FakeOp(name, lambda a, soc: None, reference)


def test_a_fused_op_may_read_the_host_while_it_runs_as_its_node(fake_npu):
    op = _host_reading_op()
    x, gamma = torch.ones(2, 4), torch.full((4,), 3.0)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        y, _ = op(x, gamma)
        with pytest.raises(HostSyncError):            # the same read outside the op is refused
            gamma[0].item()
    assert y.tolist() == [[3.0] * 4] * 2
    gamma.fill_(5.0)
    x.fill_(2.0)
    graph.replay()
    assert y.tolist() == [[10.0] * 4] * 2             # the value at replay, not the captured one


def test_a_fused_op_whose_output_shape_follows_values_cannot_replay(fake_npu):
    from fake_npu.schema import FakeOp
    op = FakeOp("npu_rms_norm", lambda a, soc: None,
                lambda a: (a.input[: int(a.gamma[0].item())], a.gamma))
    x, gamma = torch.ones(4, 2), torch.full((2,), 2.0)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        op(x, gamma)
    gamma.fill_(3.0)
    with pytest.raises(RuntimeError, match="data-dependent shape"):
        graph.replay()
