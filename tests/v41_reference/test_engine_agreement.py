"""The engine on the tiny DeepSeek-V4.1 against an independent float32 reference.

`tests/v41_reference` is a whole-sequence V4.1 forward written from the spec alone (no engine
import, no cache, paging or chunking). The engine runs as a user runs it (`LLM.generate`, float32,
QAT simulation off) on 8 prompts of up to 600 tokens plus 64 greedy tokens: the prompts cross C2
and C1 block boundaries, the 16-token window, a binding top-k (index_topk 8) and a binding
candidate selection (8 blocks of 4 C1 entries), and Engram reads n-grams across chunks. The
reference is run teacher-forced on the engine's tokens: equal greedy tokens at every step and
log-probabilities within 1e-5 relative error. The same holds with SWA bounded replay in 'mask'
mode against the reference run with the same rectangle.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.api.llm import LLM
from deepinfer_core.api.sampling_params import SamplingParams

from .reference import ReferenceV41

LENGTHS = (5, 37, 90, 151, 258, 333, 480, 600)
KEEP = 40  # bounded replay: the consumer windows see the prompt's last 40 tokens
NEW_TOKENS = 64
MAX_REL_ERR = 1e-5


@pytest.fixture(scope="module", params=["off", "mask"])
def runs(tiny_v41_dir, request):
    gen = torch.Generator().manual_seed(41)
    prompts = [torch.randint(3, 128000, (n,), generator=gen).tolist() for n in LENGTHS]
    llm = LLM(
        str(tiny_v41_dir),
        dtype="float32",
        simulate_qat=False,
        max_num_batched_tokens=256,
        yoco_prefill_truncation_mode=request.param,
        yoco_prefill_keep_tokens=KEEP,
    )
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, logprobs=0, prompt_logprobs=0, ignore_eos=True
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, outs, ReferenceV41.from_dir(tiny_v41_dir), request.param


def _logprob(entry) -> float:
    (lp,) = entry.values() if len(entry) == 1 else [next(iter(entry.values()))]
    return float(getattr(lp, "logprob", lp))


def test_selection_levels_bind_on_the_longest_prompt(tiny_v41_dir):
    """The prompts are long enough that both top-k levels choose (otherwise agreement would not
    exercise selection): visible C2 entries and C1 candidate blocks exceed what is kept."""
    from deepinfer_core.config import ModelConfig

    cfg = ModelConfig.from_file(tiny_v41_dir)
    topo = cfg.topology
    assert max(LENGTHS) // 2 > cfg.index_topk  # C2 top-k
    assert max(LENGTHS) // topo.candidate_block_size > topo.candidate_topk_blocks
    assert max(LENGTHS) > topo.candidate_topk_blocks * topo.candidate_block_size > cfg.index_topk


@pytest.mark.parametrize("i", range(len(LENGTHS)))
def test_greedy_tokens_and_logprobs_match_the_reference(runs, i):
    prompts, outs, ref, mode = runs
    prompt, out = prompts[i], outs[i]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == NEW_TOKENS
    rect_lo = max(0, len(prompt) - KEEP) if mode == "mask" else None
    logp = torch.log_softmax(ref.forward(prompt + tokens[:-1], rect_lo=rect_lo).double(), dim=-1)
    gen_rows = logp[len(prompt) - 1 :]
    assert gen_rows.argmax(-1).tolist() == tokens
    ours = [_logprob(e) for e in out.outputs[0].logprobs]
    theirs = [gen_rows[j, t].item() for j, t in enumerate(tokens)]
    # prompt tokens 1.. are scored by the rows before them (the first has no logprob)
    ours += [_logprob(e) for e in out.prompt_logprobs[1:]]
    theirs += [logp[j, t].item() for j, t in enumerate(prompt[1:])]
    err = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(ours, theirs, strict=True))
    assert err <= MAX_REL_ERR, f"max relative logprob error {err:.2e}"
