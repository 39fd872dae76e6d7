"""`LLM(kv_cache_dtype=...)`: FP8 KV rows through the whole engine on the tiny model, and the option's
validation. With the QAT simulation the model fake-quantises exactly the rows FP8 storage keeps, so
the stored cache changes format (smaller pools) but the generated tokens and logprobs do not."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.runner.options import resolve_kv_fp8

OPTS = dict(dtype="bfloat16", simulate_qat=True, max_num_batched_tokens=64, num_cache_blocks=8,
            max_num_seqs=4, async_scheduling=False)


def test_fp8_kv_rows_generate_exactly_what_bf16_rows_generate(tiny_ckpt_dir):
    g = torch.Generator().manual_seed(5)
    # 140 tokens: chunked at 64, past the 128-token window and the first ratio-128 block
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (140, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for kv in ("bfloat16", "fp8"):
        llm = LLM(model=str(tiny_ckpt_dir), kv_cache_dtype=kv, **OPTS)
        cache = llm.runner.cache
        assert cache.layout.kv_fp8 == (kv == "fp8")
        assert (cache.rings[0].dtype == torch.uint8) == (kv == "fp8")
        outs[kv] = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        del llm
    for a, b in zip(outs["bfloat16"], outs["fp8"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}


def test_kv_cache_dtype_choices_and_errors():
    assert resolve_kv_fp8("auto", torch.bfloat16, True) is False          # auto = the model dtype
    assert resolve_kv_fp8("bfloat16", torch.bfloat16, True) is False
    assert resolve_kv_fp8("fp8", torch.bfloat16, False) is True           # allowed, lossy without QAT
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp16'.*allowed: 'auto', 'bfloat16', 'fp8'"):
        resolve_kv_fp8("fp16", torch.bfloat16, True)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs dtype='bfloat16'"):
        resolve_kv_fp8("fp8", torch.float32, True)


def test_llm_refuses_a_bad_kv_cache_dtype_naming_the_field(tiny_ckpt_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(tiny_ckpt_dir), dtype="float32", kv_cache_dtype="fp8", num_cache_blocks=4, max_num_seqs=2)
