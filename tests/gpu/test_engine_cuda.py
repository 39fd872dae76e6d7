"""The engine on a CUDA device (the nvidia backend's kernels): the state cache sized
from gpu_memory_utilization with exact accounting, and greedy tokens equal to the CPU run.
Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu`."""
from __future__ import annotations

import gc

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

pytestmark = pytest.mark.gpu      # deselected in CI; on a machine without CUDA these fail, not skip


def prompts(n: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def cuda_llm(tiny_ckpt_dir):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    # The budget is a fraction of the whole device, and what the process already holds (CUDA context,
    # library workspaces, earlier test modules) counts against it: allow that plus 2 GiB (one step's
    # activations, ~0.9 GiB here, and the decode graphs' fp32 logits, ~0.8 GiB for 256 slots).
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, device="cuda",
              gpu_memory_utilization=round((total - free + (2 << 30)) / total, 4), max_num_seqs=256)
    return llm


def test_cache_sized_from_gpu_memory_utilization(cuda_llm):
    cache = cuda_llm.runner.cache
    print(f"[gpu] {cuda_llm.runner.cache_note}")
    total = torch.cuda.get_device_properties(0).total_memory
    assert cache.nbytes() == cache.layout.cache_bytes(cache.num_slots, cache.num_blocks)
    assert all(t.is_cuda for t in cache.tensors())
    # the budget binds (fewer blocks than 256 full-length sequences would use) and is respected
    assert "capped at max_num_seqs" not in cuda_llm.runner.cache_note
    assert cache.num_blocks < 256 * (cuda_llm.config.model.max_model_len // 128)
    assert torch.cuda.memory_allocated() <= cuda_llm.config.cache.gpu_memory_utilization * total
    print(f"[gpu] cache {cache.num_blocks} blocks x {cache.layout.block_bytes} B + 256 slots x "
          f"{cache.layout.slot_bytes} B = {cache.nbytes() / 2**20:.1f} MiB; allocated "
          f"{torch.cuda.memory_allocated() / 2**20:.1f} MiB of {total / 2**30:.1f} GiB")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_on_cuda_equals_cpu(cuda_llm, tiny_ckpt_dir, async_scheduling):
    ps = prompts(16, [3, 17, 40, 140, 9, 64, 200, 25], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM.from_runner(cuda_llm.runner, config=cuda_llm.config.replace(async_scheduling=async_scheduling))
    gpu = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                         use_tqdm=False)]
    assert llm.engine.scheduler.blocks.allocator.reclaim()
    cpu_llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False)
    cpu = [o.outputs[0].token_ids for o in cpu_llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                             use_tqdm=False)]
    assert gpu == cpu
