"""Expert parallelism over `hccl` with the Ascend backend: the data-parallel engine's two spawned
ranks on the simulated NPU (alias mode), EP = 2 over the tiny V4 model's routed experts (8, plus 2
replicas: 5 slots per rank), float32 without the QAT numerics, so the experts run as the plain
grouped matmul. (Not bf16: this random tiny model has near-ties that bf16 roundings decide, and
the rows a grouped matmul gets differ with the batch, so bf16 greedy tokens already change with
the batch in one process. The W4A8 MX form under EP: test_backend_moe.py, on one rank, bitwise.)

Each rank gets the fake torch_npu the way a rank on an Ascend host gets the real one, through
torch's device-backend autoload (ep_npu_ranks.py), and with it hccl as its device's backend: the
engine's `device_backend` then builds the rank's world and EP groups on hccl (the fake's, over
gloo), the control traffic on a gloo twin. Greedy tokens must equal one process's (the same
backend, every expert in one stacked layer); each rank's record shows its two hccl groups and
the grouped matmul over its 5 slots, with no routing operator (the exchange sorts the pairs).

The NPU ranks' placement, which alias mode cannot run (its ranks are on the CPU, and torch has no
"npu" device without the real torch_npu): checked here in one process, on the fake's torch.npu.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ep_npu_ranks import ENV, read_records, write_site
from fake_npu import SOC_A5

from deepinfer_core import LLM, SamplingParams, plugins
from deepinfer_core.device_module import rank_devices
from deepinfer_core.engine_config import EngineConfig
from deepinfer_core.parallel import dp_config
from deepinfer_core.parallel.dp_engine import DataParallelLLM

BACKEND = Path(__file__).resolve().parents[2] / "backends" / "ascend950"
PROMPTS = ["To be, or not to be", "Now is the winter of our discontent", "Friends, Romans",
           "All the world's a stage, and all the men and women merely players"]
OPTIONS = dict(dtype="float32", simulate_qat=False, device="cpu", max_num_seqs=4)
SLOTS = (8 + 2) // 2          # routed experts + replicas, per rank


@pytest.fixture
def ascend_everywhere(fake_npu, monkeypatch, tmp_path):
    """The ascend platform on the fake in this process (the one-process run) and in every process
    it spawns (their site folder and settings); yields the folder the ranks record into."""
    node, records = tmp_path / "davinci0", tmp_path / "records"
    node.write_text("")
    records.mkdir()
    site, settings = write_site(tmp_path / "site", dict(soc=SOC_A5, devices=2, node=str(node),
                                                         records=str(records)))
    monkeypatch.syspath_prepend(str(BACKEND))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(ENV, settings)
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")      # torch's default, made sure of
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    from deepinfer_ascend import plugin, runtime
    monkeypatch.setattr(plugin, "PROBE_PATHS", (str(node),))
    monkeypatch.setattr(runtime, "DEVICE_TYPE", "cpu")
    runtime.reset()
    plugins.get_plugin_manager(refresh=True)
    yield records
    runtime.reset()
    monkeypatch.undo()
    plugins.get_plugin_manager(refresh=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_ep_over_hccl_on_two_simulated_ranks(tiny_ckpt_dir, ascend_everywhere):
    from deepinfer_ascend.moe import AscendMoE
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = LLM(str(tiny_ckpt_dir), **OPTIONS)
    assert isinstance(one.runner.loaded.ops.moe, AscendMoE)
    want = _tokens(one.generate(PROMPTS, greedy, use_tqdm=False))
    with DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=2, num_redundant_experts=2,
                         timeout_s=60.0, **OPTIONS) as llm:
        assert llm.config.parallel.enable_expert_parallel
        got = _tokens(llm.generate(PROMPTS, greedy))
        requests = [s.num_requests for s in llm.last_stats]
    assert got == want
    assert requests == [2, 2]                 # both ranks served prompts (and each other's experts)
    records = read_records(ascend_everywhere)
    assert len(records) == 2, records
    # world and EP group on hccl, one per rank and group; the gloo twin is not hccl's
    assert sorted(tuple(map(tuple, r["hccl_groups"])) for r in records) == [
        ((0, 2), (0, 2)), ((1, 2), (1, 2))]
    for r in records:
        assert r["ops"]["npu_grouped_matmul"] > 0 and r["gmm_groups"] == [SLOTS], r
        assert "npu_moe_init_routing_v2" not in r["ops"], r


def test_npu_ranks_are_placed_through_torch_npu(make_fake_npu, monkeypatch):
    """The front end counts NPUs with torch.npu.device_count (too few: refused before any rank
    starts, per host and per torchrun node), a rank makes its NPU current with
    torch.npu.set_device, and NPU ranks wait as long as GPU ranks in a collective; a detected
    ascend platform without torch.npu (torch_npu not imported) has no ranks."""
    fake = make_fake_npu(device_count=1)
    ranks = rank_devices("npu:1")
    assert (ranks.type, ranks.module, ranks.count()) == ("npu", torch.npu, 1)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 with device='npu' needs 2 NPUs "
                                         r"\(rank r on NPU r\); this process sees 1 \(ASCEND_RT_"
                                         r"VISIBLE_DEVICES\); allowed: data_parallel_size <= 1, or "
                                         r"device='cpu'"):
        dp_config.check_device_count(2, ranks)
    fake.state.device_count = 2
    dp_config.check_device_count(2, ranks)
    with pytest.raises(ValueError, match=r"needs 4 NPUs on this node \(LOCAL_WORLD_SIZE=4, .* "
                                         r"sees 2"):
        dp_config.check_device_count(8, ranks, node_ranks=4)
    ranks.bind(1)
    assert fake.state.current_device == 1 and fake.state.log[-1][:2] == ("set_device", (1,))
    assert dp_config.collective_timeout("npu") == dp_config.GPU_TIMEOUT_S
    assert dp_config.collective_timeout("cpu") == dp_config.DEFAULT_TIMEOUT_S
    npu_config = EngineConfig.from_options(data_parallel_size=2, enable_expert_parallel=True,
                                           device="npu")
    assert dp_config.rank_config(npu_config).model.device == "npu"
    fake.uninstall()
    monkeypatch.setattr(dp_config, "detect_platform", lambda: SimpleNamespace(name="ascend",
                                                                             device_type="npu"))
    config = EngineConfig.from_options(data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"detected platform is 'ascend' \(device 'npu'\), which "
                                         r"has no data-parallel ranks yet.*this process has no "
                                         r"torch.npu"):
        dp_config.rank_config(config)
