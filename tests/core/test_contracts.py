"""The typed contracts between the core and its plugins (deepinfer_core/contracts.py): every op the
hooks choose is checked once at start-up, and an object that misses part of its contract is refused
there with a message naming the class and the missing members."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.config import ModelConfig
from deepinfer_core.contracts import (
    AttentionBackend,
    EngineRunner,
    GraphAttentionBackend,
    LinearMethod,
    MHCMethod,
    MoEMethod,
    PointwiseMethod,
    TokenSampler,
    members,
    resolve_model_ops,
    resolve_sampler,
)
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import BuildContext
from deepinfer_core.plugins import PluginError, PluginManager
from deepinfer_core.tools.tiny_config import tiny_config_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))


def cpu_ctx(mgr: PluginManager) -> BuildContext:
    ctx = BuildContext(model_config=ModelConfig.from_dict(tiny_config_dict()), platform=mgr.detect_platform("cpu"),
                       device="cpu", dtype="float32", simulate_qat=True)
    return mgr.configure(ctx)


def test_the_portable_ops_meet_their_contracts():
    mgr = PluginManager({"DEEPINFER_ACCELERATOR": "cpu"})
    ctx = cpu_ctx(mgr)
    ops = resolve_model_ops(mgr, ctx)
    assert all(isinstance(m, LinearMethod) for m in ops.linear.values()) and set(ops.linear) == {"bf16", "fp8", "fp4"}
    assert isinstance(ops.attention, AttentionBackend) and isinstance(ops.moe, MoEMethod)
    assert isinstance(ops.mhc, MHCMethod) and isinstance(ops.pointwise, PointwiseMethod)
    assert isinstance(resolve_sampler(mgr, ctx), TokenSampler)
    # the portable attention cannot describe a batch with fixed-shape metadata: no CUDA graphs
    assert not isinstance(ops.attention, GraphAttentionBackend)


def test_the_nvidia_attention_backend_is_graph_capable():
    from deepinfer_nvidia.attention import NvidiaAttentionBackend
    backend = NvidiaAttentionBackend((0, 4, 128))
    assert isinstance(backend, GraphAttentionBackend)
    assert backend.graph_num_extra(3, 5) == 3 * 2 + 3 * 1     # ceil(5/r) per sequence; ratio 0 closes none


class _MoEWithoutWeights:
    batch_invariant = False

    def apply(self, moe, x, input_ids):
        return x


class _BrokenMoEPlugin:
    @hookimpl(tryfirst=True)
    def deepinfer_moe_method(self, ctx):
        return _MoEWithoutWeights()


def test_an_op_missing_part_of_its_contract_is_refused_at_start_up():
    mgr = PluginManager({"DEEPINFER_ACCELERATOR": "cpu"})
    mgr.pm.register(_BrokenMoEPlugin(), name="broken_moe")
    with pytest.raises(PluginError, match=r"MoE method .*_MoEWithoutWeights does not implement MoEMethod: "
                                          r"missing process_weights"):
        resolve_model_ops(mgr, cpu_ctx(mgr))


def test_from_runner_refuses_an_object_that_is_not_a_runner():
    class HalfRunner:
        device, model_config = "cpu", None

        def execute(self, batch):
            return torch.empty(0)

    with pytest.raises(TypeError, match=r"HalfRunner is not a runner: missing last_token, sampler, "
                                        r"logits_processors, scheduler_policy, profile_tokens, checkpoint_slots, "
                                        r"allocate_cache, make_speculator"):
        LLM.from_runner(HalfRunner())


def test_members_include_what_a_protocol_inherits():
    assert members(GraphAttentionBackend) == ["batch_invariant", "forward", "graph_num_extra", "graph_meta"]
    assert members(EngineRunner)[:4] == ["model_config", "device", "last_token", "execute"]
