"""MTP speculative decoding through the reference loop (`deepinfer_core.speculative`) on
the bundled trained model, float32 on the CPU with batch-invariant ops (a row's result does not
depend on how many rows share its chunk, so a verify chunk computes what decode steps compute):

- lossless: greedy outputs with MTP-1 and MTP-3 equal `LLM.generate`'s non-speculative ones token for
  token, alone and batched beside sampled requests;
- the drafter's state is right: every draft equals the one the MTP block proposes when it is run
  from scratch over the committed tokens (a rejected draft left no trace in its window ring);
- the model's MTP block drafts well enough to be accepted (it was trained to), and bad settings
  are errors that name the variable.
"""
from __future__ import annotations

import pytest
import torch
from spec_cases import GREEDY, PROMPTS, TOKENS  # noqa: E402

from deepinfer_core import SamplingParams
from deepinfer_core.cache.budget import CacheRequest
from deepinfer_core.model.forward_batch import ForwardBatch
from deepinfer_core.runner.model_runner import ModelRunner
from deepinfer_core.speculative import mtp
from deepinfer_core.speculative.mtp import MTPDrafter
from deepinfer_core.speculative.reference_loop import speculative_generate


@pytest.fixture(scope="module")
def runner(trained_dir):
    r = ModelRunner(trained_dir, dtype="float32", device="cpu", batch_invariant=True, max_backtracking_tokens=4)
    r.allocate_cache(CacheRequest(num_slots=len(PROMPTS) + 1, num_blocks=2 * (len(PROMPTS) + 1)))
    return r


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_is_lossless(runner, prompts_and_reference, k):
    prompts, reference = prompts_and_reference
    result = speculative_generate(runner, prompts, [GREEDY] * len(prompts), k)
    assert result.token_ids == reference
    assert result.stats.num_steps > 0 and result.stats.num_accepted_tokens > 0
    assert len(result.stats.per_position()) == k


def test_greedy_rows_beside_sampled_ones_are_unchanged(runner, prompts_and_reference):
    prompts, reference = prompts_and_reference
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=TOKENS, ignore_eos=True)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(prompts))]
    result = speculative_generate(runner, prompts, params, 2, seeds=list(range(len(prompts))))
    for i in range(0, len(prompts), 2):
        assert result.token_ids[i] == reference[i], i
    for i in range(1, len(prompts), 2):
        assert len(result.token_ids[i]) == TOKENS


def test_every_draft_is_what_a_fresh_mtp_pass_proposes(runner, prompts_and_reference, monkeypatch):
    """Record the MTP-1 drafts (position, token); rerun target + MTP block over the final committed
    sequence from scratch: the argmax of its MTP logits at each row must be the draft made there."""
    prompts, _ = prompts_and_reference
    made: list[tuple[int, int, int]] = []        # (request, position of the draft, token)
    propose = MTPDrafter.propose

    def recording(self, logits, streams, states, last_positions, params, seeds):
        drafts = propose(self, logits, streams, states, last_positions, params, seeds)
        ids = drafts.ids[:, 0].tolist()
        req = [states_index[id(st)] for st in states]
        made.extend((r, p + 2, t) for r, p, t in zip(req, last_positions, ids))
        return drafts

    states_index: dict[int, int] = {}
    new_sequence = runner.new_sequence

    def numbered():
        st = new_sequence()
        states_index[id(st)] = len(states_index)
        return st

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    monkeypatch.setattr(runner, "new_sequence", numbered)
    result = speculative_generate(runner, prompts[:4], [GREEDY] * 4, 1)
    monkeypatch.undo()
    assert made
    for r in range(4):
        seq = list(prompts[r]) + result.token_ids[r]
        st = runner.new_sequence()
        try:
            st.reserve(len(seq) - 1)
            batch = ForwardBatch.build([seq[:-1]], [st], "cpu", all_logits=True)
            with torch.no_grad():
                out = runner.model(batch)
                mtp_logits = runner.model.forward_mtp(out.streams, torch.tensor(seq[1:]), batch)
        finally:
            runner.release(st)
        fresh = mtp_logits.argmax(-1).tolist()          # row t drafts position t + 2
        mine = [(p, t) for q, p, t in made if q == r and p - 2 < len(fresh)]
        assert mine and all(fresh[p - 2] == t for p, t in mine), r


def test_requests_end_at_their_own_lengths(runner, prompts_and_reference):
    """max_tokens 1 (done after the prefill), 2 and 5 in one batch: each stops where
    non-speculative decoding would, with the same tokens."""
    prompts, reference = prompts_and_reference
    lengths = [1, 2, 5]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    result = speculative_generate(runner, prompts[:3], params, 3)
    assert result.token_ids == [reference[i][:n] for i, n in enumerate(lengths)]


def test_the_trained_mtp_block_drafts_acceptable_tokens(runner, prompts_and_reference):
    prompts, _ = prompts_and_reference
    stats = speculative_generate(runner, prompts, [GREEDY] * len(prompts), 1).stats
    assert stats.acceptance_length > 1.3             # measured 1.76 on 8 of these prompts x 32 tokens


def test_bad_settings_name_the_variable(runner, trained_dir, prompts_and_reference):
    prompts, _ = prompts_and_reference
    with pytest.raises(ValueError, match="DEEPINFER_MAX_BACKTRACKING_TOKENS"):
        speculative_generate(runner, prompts[:1], [GREEDY], 4)
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE=0"):
        MTPDrafter(runner.model, 0)
    no_mtp = ModelRunner(trained_dir, dtype="float32", device="cpu", max_backtracking_tokens=2)
    no_mtp.model.mtp = torch.nn.ModuleList()
    with pytest.raises(ValueError, match="no mtp.* tensors"):
        MTPDrafter(no_mtp.model, 1)
    assert mtp.Drafts is not None
