"""GPU data-parallel ranks, the parts a CPU can check: where each rank runs, which backend
its groups use, the refusals before any rank starts, and the settings a GPU rank applies to itself.

The NCCL runs themselves need 2-4 GPUs (`tests/parallel/test_dp_cuda.py`, marked gpu); they were not run
where these CPU tests run.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer_core.device_module import rank_devices
from deepinfer_core.engine_config import EngineConfig
from deepinfer_core.parallel import dp_config
from deepinfer_core.parallel.dp_config import check_device_count
from deepinfer_core.parallel.dp_engine import DataParallelLLM
from deepinfer_core.parallel.dp_worker import WorkerSpec, rank_device
from deepinfer_core.parallel.expert_map import ExpertPlacement


@dataclass(frozen=True)
class FakePlatform:
    name: str
    device_type: str


def _config(**options) -> EngineConfig:
    return EngineConfig.from_options(data_parallel_size=2, enable_expert_parallel=True, **options)


def _spec(config: EngineConfig, rank: int) -> WorkerSpec:
    return WorkerSpec(rank, 2, "tcp://127.0.0.1:1", "/nowhere", config, True, 0, 60.0, 1)


def test_unset_device_follows_the_detected_platform(monkeypatch):
    monkeypatch.setattr(dp_config, "detect_platform", lambda: FakePlatform("nvidia", "cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    resolved = dp_config.rank_config(_config())
    assert resolved.model.device == "cuda"
    assert resolved.speculative.num_speculative_tokens == 0      # unset drafts: none under DP
    # rank r on GPU r; the CPU ranks stay on the CPU
    assert [rank_device(_spec(resolved, r)) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    cpu = dp_config.rank_config(_config(device="cpu"))
    assert cpu.model.device == "cpu" and rank_device(_spec(cpu, 1)) == torch.device("cpu")


def test_too_few_gpus_is_refused_before_any_rank_starts(monkeypatch, tiny_ckpt_dir):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 with device='cuda' needs 2 GPUs .* sees 1 .*"
                                         r"allowed: data_parallel_size <= 1, or device='cpu'"):
        dp_config.rank_config(_config(device="cuda"))
    check_device_count(4, rank_devices("cuda"), available=4)          # enough: no error
    started = []
    monkeypatch.setattr(DataParallelLLM, "_start", lambda self, timeout_s: started.append(1))
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        DataParallelLLM(str(tiny_ckpt_dir), device="cuda", data_parallel_size=2)
    assert not started


def test_a_platform_without_ranks_is_refused(monkeypatch):
    monkeypatch.setattr(dp_config, "detect_platform", lambda: FakePlatform("ascend", "npu"))
    with pytest.raises(ValueError, match=r"detected platform is 'ascend' \(device 'npu'\), which has no "
                                         r"data-parallel ranks yet; allowed: device='cuda' or 'cpu'"):
        dp_config.rank_config(_config())


def test_gpu_ranks_get_the_gpu_timeout(monkeypatch, tiny_ckpt_dir):
    """A GPU rank may compile kernels for minutes while its peers wait in a collective."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    got = []
    monkeypatch.setattr(DataParallelLLM, "_start", lambda self, timeout_s: got.append(timeout_s))
    model = str(tiny_ckpt_dir)
    DataParallelLLM(model, device="cuda", data_parallel_size=2)
    DataParallelLLM(model, device="cpu", data_parallel_size=2)
    DataParallelLLM(model, device="cpu", data_parallel_size=2, timeout_s=7.5)
    assert got == [dp_config.GPU_TIMEOUT_S, dp_config.DEFAULT_TIMEOUT_S, 7.5]
    with pytest.raises(ValueError, match=r"timeout_s=0; allowed: a number of seconds > 0, or None"):
        DataParallelLLM(model, device="cpu", data_parallel_size=2, timeout_s=0)


def test_placement_to_device_is_a_copy():
    p = ExpertPlacement.initial(2, 4, 2, 0)
    q = p.to("cpu")
    assert q.equals(p) and q.phys_to_log.data_ptr() != p.phys_to_log.data_ptr()


@pytest.mark.parametrize("options, match", [
    (dict(device="cpu"), r"enable_ep_cuda_graphs=True with device='cpu': CUDA graphs need GPU ranks"),
    (dict(device="cuda", enforce_eager=True), "enable_ep_cuda_graphs=True with enforce_eager=True"),
    (dict(device="cuda", num_speculative_tokens=2),
     r"enable_ep_cuda_graphs=True with num_speculative_tokens=2: .* allowed: num_speculative_tokens=0"),
])
def test_ep_cuda_graph_refusals(monkeypatch, options, match):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=match):
        dp_config.rank_config(_config(enable_ep_cuda_graphs=True, **options))
    resolved = dp_config.rank_config(_config(enable_ep_cuda_graphs=True, device="cuda"))
    assert resolved.parallel.enable_ep_cuda_graphs


def test_ep_cuda_graphs_need_expert_parallel():
    with pytest.raises(ValueError, match="enable_ep_cuda_graphs=True needs enable_expert_parallel=True"):
        EngineConfig.from_options(data_parallel_size=2, enable_ep_cuda_graphs=True)
