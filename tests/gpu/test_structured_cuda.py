"""Structured outputs on a CUDA device: the pinned bitmask copy and xgrammar's Triton apply kernel,
with no host sync in the mask; every constrained output valid beside unconstrained requests (tiny
model, nvidia backend). Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "structured"))
from so_corpus import EBNF_GRAMMARS, JSON_SCHEMAS, REGEXES, check_ebnf, check_json, check_regex  # noqa: E402

pytestmark = pytest.mark.gpu      # deselected in CI; on a machine without CUDA these fail, not skip


@pytest.fixture(scope="module")
def cuda_llm(tiny_ckpt_dir):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_SO_JSON_MAX_WHITESPACE", "2")    # see tests/structured/test_structured_engine.py
        yield LLM(model=str(tiny_ckpt_dir), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=1 << 30)


def test_constrained_outputs_are_valid_on_cuda(cuda_llm):
    cases = ([({"schema_type": "json", "schema": s}, lambda t, s=s: check_json(t, s), 200) for _, s in JSON_SCHEMAS]
             + [({"schema_type": "regex", "schema": r}, lambda t, r=r: check_regex(t, r), 64) for _, r in REGEXES]
             + [({"schema_type": "ebnf", "schema": g}, lambda t, lg=lg: check_ebnf(t, lg), 64)
                for _, g, lg in EBNF_GRAMMARS])
    params = [SamplingParams(temperature=t, top_k=50 if t else 0, seed=i, max_tokens=limit, so_args=so)
              for i, (so, _, limit) in enumerate(cases) for t in (0.0, 1.0)]
    params += [SamplingParams(temperature=1.0, seed=99, max_tokens=32, ignore_eos=True)] * 8
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(1000, 100000, (8,), generator=g).tolist() for _ in params]
    outs = cuda_llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    bad = []
    for (so, check, _), pair in zip(cases, zip(outs[0::2], outs[1::2])):
        for o in pair:
            try:
                assert o.outputs[0].finish_reason == "stop"
                check(o.outputs[0].text)
            except AssertionError as e:
                bad.append(f"{so['schema_type']}: {e}")
    assert not bad, "\n".join(bad)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs[2 * len(cases):])


def test_mask_is_sync_free_on_cuda(cuda_llm, tiny_ckpt_dir):
    proc = cuda_llm.logits_processors[0]
    p = SamplingParams(so_args={"schema_type": "json", "schema": JSON_SCHEMAS[0][1]})
    cons = proc.prepare(p, tokenizer=cuda_llm.tokenizer, vocab_size=cuda_llm.vocab_size, eos_token_id=1)
    cons.wait(30)
    states = [cons.new_state(p, 1) for _ in range(64)]
    logits = torch.randn(64, cuda_llm.vocab_size, device="cuda")
    proc.mask(logits, list(range(64)), states)         # warm-up: buffers, Triton compile
    ref = logits.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        proc.mask(logits, list(range(64)), states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(logits, ref)                    # the same mask again: already -inf there
    cpu = torch.randn(64, cuda_llm.vocab_size)
    gpu = cpu.cuda()
    proc.mask(gpu, list(range(64)), states)
    proc.mask(cpu, list(range(64)), states)
    assert torch.equal(gpu.cpu(), cpu)
