"""Batch invariance on the nvidia backend (bf16, CUDA graphs on): bitwise-equal logprobs alone, in
batches of 2..256 at shuffled positions and under chunked-prefill sizes 1..512; the same check with
the feature off finds differences (so it can fail); 1000 runs of one seeded sampled request among
random traffic give one output. Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu`."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from deepinfer_batch_invariant.check import random_prompts, repeat_check, run_check
from deepinfer_core import LLM

pytestmark = pytest.mark.gpu      # deselected in CI; on a machine without CUDA these fail, not skip


def _llm(ckpt, invariant: bool) -> LLM:
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    gc.collect()
    torch.cuda.empty_cache()
    return LLM(model=str(ckpt), dtype="bfloat16", device="cuda", batch_invariant=invariant, max_num_seqs=256,
               kv_cache_memory_bytes=2 << 30)


@pytest.fixture(scope="module")
def invariant_llm(tiny_ckpt_dir):
    return _llm(tiny_ckpt_dir, True)


def _targets(llm, n=8):
    return random_prompts(n, random.Random(7), 20, 200, llm.vocab_size)


def test_bitwise_equal_on_cuda(invariant_llm):
    assert invariant_llm.runner.graphs is not None           # decode steps replay CUDA graphs
    report = run_check(invariant_llm, _targets(invariant_llm), batch_sizes=(2, 3, 8, 64, 256),
                       chunk_sizes=(1, 5, 64, 512))
    print(report.table())
    assert report.all_equal, report.table()


def test_feature_off_differs_on_cuda(tiny_ckpt_dir):
    llm = _llm(tiny_ckpt_dir, False)
    report = run_check(llm, _targets(llm), batch_sizes=(2, 8, 64, 256), chunk_sizes=(5, 64))
    print(report.table())
    del llm
    assert not report.all_equal


def test_1000_seeded_runs_one_output(invariant_llm):
    got = repeat_check(invariant_llm, 1000, batch_range=(1, 32), max_tokens=6)
    print(f"[gpu] {got}")
    assert got["distinct_outputs"] == 1, got
