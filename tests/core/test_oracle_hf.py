"""Our DeepSeek-V4 graph against an independent implementation: HF transformers'
DeepseekV4ForCausalLM on the same tiny checkpoint, float32, QAT simulation off.

The tiny model (tools/tiny_config.py) has 8 layers mixing window-only (0, 1, 7), ratio-4 CSA
(2, 4, 6) and ratio-128 HCA (3, 5) layers, hash-routed (0-2) and bias-routed MoE, a 16-token window,
and the real 129,280-token vocabulary. Prompts reach 420 tokens, so every compressor emits several
rows (HCA: 3, CSA: 105) and the window wraps many times. The indexer's top-k is tested binding
(index_topk 8) and not binding (512).
"""
from __future__ import annotations

import pytest
import torch

from oracle_utils import Ours, load_hf, max_rel_err, variant_dir, write_hf_copy


TOL = 1e-4
PROMPT_LENS = (5, 37, 140, 300, 420)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(2, 129280, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=["topk_binding", "topk_not_binding"])
def pair(request, tiny_ckpt_dir, tmp_path_factory):
    """(ours, hf) on the same weights; index_topk 8 (binds past 35 tokens) or 512 (never binds)."""
    if request.param == "topk_binding":
        path = tiny_ckpt_dir
    else:
        path = variant_dir(tiny_ckpt_dir, tmp_path_factory.mktemp("topk512"), index_topk=512)
    hf = load_hf(write_hf_copy(path, tmp_path_factory.mktemp("hf_" + request.param)))
    ours = Ours(path)
    assert ours.cfg.index_topk == (8 if request.param == "topk_binding" else 512)
    return ours, hf


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match_hf_at_every_position(pair):
    ours, hf = pair
    for seed, n in enumerate(PROMPT_LENS):
        ids = prompt(n, seed)
        state = ours.new_state()
        got = ours.logits(ids, state=state)
        err = max_rel_err(got, hf_logits(hf, ids))
        print(f"[oracle] prefill {n} tokens, top-k {ours.cfg.index_topk}: max rel err {err.max():.2e}")
        assert err.max() <= TOL, f"prompt of {n} tokens: max relative error {err.max():.2e} at position {int(err.argmax())}"
    # the longest prompt really exercised every compressor several times
    rows = {L.compressor.ratio: L.compressor.n_rows for L in state.layers if L.compressor is not None}
    assert rows == {4: 105, 128: 3}
    assert all(L.indexer.n_rows == 105 for L in state.layers if L.indexer is not None)


def test_token_by_token_decode_from_state_matches_hf(pair):
    """Prefill 100 tokens, then feed the remaining 320 one at a time from our state cache."""
    ours, hf = pair
    ids = prompt(420, 7)
    got = ours.logits(ids, chunks=[100] + [1] * 320)
    err = max_rel_err(got, hf_logits(hf, ids))
    print(f"[oracle] decode from state, top-k {ours.cfg.index_topk}: max rel err {err.max():.2e}")
    assert err.max() <= TOL, f"max relative error {err.max():.2e} at position {int(err.argmax())}"


def test_greedy_generation_matches_hf(pair):
    """12 greedy steps on 5 prompts up to 330 tokens; HF decodes with its own cache classes."""
    ours, hf = pair
    for seed, n in enumerate((12, 60, 150, 300, 330)):
        ids = prompt(n, 20 + seed)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           attention_mask=torch.ones(1, n, dtype=torch.long))[0, n:].tolist()
        assert ours.greedy(ids, 12) == want, f"prompt of {n} tokens"
