"""Continuous batching against the oracle: greedy tokens of 32 prompts of mixed lengths, batched
with chunked prefill, equal HF transformers' greedy generation of each prompt alone (tiny model,
float32, QAT off). Some prompts span several compressor blocks (CSA ratio 4, HCA ratio 128) and all
but the shortest are longer than the 16-token window."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from oracle_utils import load_hf, write_hf_copy  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


LENGTHS = [3, 17, 40, 9, 140, 25, 64, 1, 200, 33, 130, 70, 5, 257, 12, 90]
NEW_TOKENS = 6


def test_batched_greedy_equals_transformers(tiny_ckpt_dir, tmp_path):
    g = torch.Generator().manual_seed(77)
    ps = [torch.randint(2, 129280, (LENGTHS[i % len(LENGTHS)],), generator=g).tolist() for i in range(32)]
    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, max_num_seqs=32,
              max_num_batched_tokens=384)       # forces chunked prefill beside decodes
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                          use_tqdm=False)]
    assert llm.engine.scheduler.blocks.allocator.reclaim()
    hf = load_hf(write_hf_copy(tiny_ckpt_dir, tmp_path / "hf"))
    for i, ids in enumerate(ps):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert ours[i] == want[0, len(ids):].tolist(), f"prompt {i} ({len(ids)} tokens)"
