"""Data parallel + expert parallel on 2-4 GPUs of one host: rank r on GPU r, the EP group on
NCCL, the vote on its gloo twin. Run on the nvidia-h200-x2 / -x4 kinds:
`python -m pytest -q -m gpu tests/parallel/test_dp_cuda.py`.

Oracle: the same workload in one process on GPU 0 (`LLM.generate`). The GEMMs, the attention and the
MoE tiles are batch invariant (`batch_invariant=True`), and the EP method sums a token's shared and
routed experts in the single-process order, so the greedy tokens must be identical: with a tight cache
(chunked prefill and preemption on every rank), with replicas, and with EPLB moving expert weights
between the GPUs while requests run. A rank that dies ends `generate` with an error naming it.
"""
from __future__ import annotations

import time

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.parallel.dp_engine import DataParallelLLM

pytestmark = pytest.mark.gpu      # deselected in CI; a machine with too few GPUs fails these, not skips
COMMON = dict(batch_invariant=True, num_speculative_tokens=0, gpu_memory_utilization=0.5)


def _need(gpus: int) -> None:
    assert torch.cuda.device_count() >= gpus, f"needs {gpus} GPUs, this host has {torch.cuda.device_count()}"


def _tokens(llm, w) -> list[list[int]]:
    out = llm.generate(prompt_token_ids=w.prompts(), sampling_params=w.greedy)
    assert all(len(o.outputs[0].token_ids) == w.max_tokens for o in out)
    return [o.outputs[0].token_ids for o in out]


@pytest.fixture(scope="module")
def gpu_oracle(dp_workload, tiny_ckpt_dir) -> list[list[int]]:
    _need(1)
    llm = LLM(model=str(tiny_ckpt_dir), device="cuda", **COMMON)
    out = _tokens(llm, dp_workload)
    del llm
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dp_ep_on_gpus_matches_one_gpu(world, gpu_oracle, dp_workload, tiny_ckpt_dir):
    _need(world)
    w = dp_workload
    with DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=world, device="cuda", num_redundant_experts=2,
                         **COMMON, **w.tight) as llm:
        assert _tokens(llm, w) == gpu_oracle
        stats = llm.last_stats
        assert len({s.iterations for s in stats}) == 1
        assert all(s.forwards + s.idle_forwards == s.iterations for s in stats)
        assert any(s.num_preemptions > 0 for s in stats)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_decode_graphs_match_one_gpu(world, gpu_oracle, dp_workload, tiny_ckpt_dir):
    """enable_ep_cuda_graphs: decode steps replay graphs holding the fixed-size exchange, every rank the
    bucket the vote agreed on; prefill iterations run eagerly on every rank."""
    _need(world)
    w = dp_workload
    with DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=world, device="cuda", enable_ep_cuda_graphs=True,
                         **COMMON) as llm:
        assert _tokens(llm, w) == gpu_oracle
        stats = llm.last_stats
        assert len({s.ep_graph_steps for s in stats}) == 1 and stats[0].ep_graph_steps > w.max_tokens // 2, stats


def test_eplb_moves_weights_between_gpus_without_changing_tokens(gpu_oracle, dp_workload, tiny_ckpt_dir):
    _need(2)
    w = dp_workload
    with DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=2, device="cuda", num_redundant_experts=2,
                         enable_eplb=True, eplb_window_size=4, eplb_step_interval=5, **COMMON) as llm:
        assert _tokens(llm, w) == gpu_oracle
        stats = llm.last_stats
        assert all(s.eplb_rearrangements >= 2 for s in stats), stats
        assert sum(s.eplb_experts_received for s in stats) > 0, stats


def test_a_dead_gpu_rank_fails_fast(dp_workload, tiny_ckpt_dir):
    _need(2)
    w = dp_workload
    with DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=2, device="cuda", **COMMON) as llm:
        llm._exit_at = (1, 5)              # rank 1 exits at lockstep iteration 5
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 of 2 died \(the test hook's exit\)"):
            llm.generate(prompt_token_ids=w.prompts(), sampling_params=w.greedy)
        assert time.monotonic() - t0 < 120
        assert all(p.exitcode is not None for p in llm._procs)
