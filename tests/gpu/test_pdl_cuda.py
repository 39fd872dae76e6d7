"""Programmatic dependent launch changes when kernels start, never what they compute: greedy decode
through CUDA graphs (bf16 + QAT, the FP8 GEMMs' weight prefetch included) gives the same tokens and
the same logprobs, bit for bit, with DEEPINFER_PDL=1 and without. A kernel that read its predecessor's
output before `pdl_gate` would race and show here as different bits.
Run on a GPU machine: `python -m pytest -q -s -m gpu tests/gpu/test_pdl_cuda.py`."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _generate(tiny_ckpt_dir, monkeypatch, flag: str):
    # imported here, not at collection: tests/kernels/conftest.py must set TRITON_INTERPRET first
    from deepinfer_kernels import pdl

    monkeypatch.setenv("DEEPINFER_PDL", flag)
    pdl._enabled.cache_clear()
    llm = LLM(model=str(tiny_ckpt_dir), max_num_seqs=16, kv_cache_memory_bytes=1 << 30)
    assert pdl.launch_args(torch.zeros(1, device="cuda"))["launch_pdl"] is (flag == "1")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (5, 31, 130, 7, 64, 200, 12, 90)]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    out = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert llm.runner.graphs is not None and llm.runner.graphs.graphs, "no decode graph was captured"
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in out]


def test_pdl_gives_the_same_bits(tiny_ckpt_dir, monkeypatch):
    from deepinfer_kernels import pdl
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("PDL needs SM90 or later")
    try:
        plain = _generate(tiny_ckpt_dir, monkeypatch, "0")
        with_pdl = _generate(tiny_ckpt_dir, monkeypatch, "1")
    finally:
        monkeypatch.delenv("DEEPINFER_PDL")
        pdl._enabled.cache_clear()
    assert with_pdl == plain
