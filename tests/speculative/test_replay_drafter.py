"""The replay drafter (benchmarks only): on the tiny random model, whose own MTP block drafts nothing
acceptable, it proposes an earlier greedy run's continuation with a chosen acceptance per draft
position; outputs stay identical to that run (lossless) and the measured acceptance follows the
chosen one: every draft right -> k + 1 tokens per verify step; none right -> 1; one half -> near half.
"""
from __future__ import annotations

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.ops.sampler import counter_uniform
from deepinfer_core.speculative.engine_step import Speculator
from deepinfer_core.speculative.replay import ReplayDrafter

K, TOKENS = 3, 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_and_run(tiny_ckpt_dir):
    llm = LLM(model=str(tiny_ckpt_dir), dtype="float32", device="cpu", batch_invariant=True,
              num_speculative_tokens=0, max_backtracking_tokens=K + 1)
    prompts = [[0] + [1000 + 97 * i + j for j in range(5 + i)] for i in range(8)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return llm, prompts, [o.outputs[0].token_ids for o in outs]


def replayed(llm, prompts, recorded, acceptance):
    drafter = ReplayDrafter({tuple(p): r for p, r in zip(prompts, recorded)}, acceptance, llm.vocab_size, seed=3)
    llm.engine.use_speculator(Speculator(llm.runner.model, K, replay=drafter), llm.runner.backtrack)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.spec_metrics


@pytest.mark.parametrize("acceptance, tau", [((1.0,) * K, (K + 1, K + 1)), ((0.0,) * K, (1.0, 1.0)),
                                             ((0.5,) * K, (1.4, 2.2))])
def test_outputs_equal_the_recorded_run_at_the_chosen_acceptance(llm_and_run, acceptance, tau):
    llm, prompts, recorded = llm_and_run
    out, metrics = replayed(llm, prompts, recorded, acceptance)
    assert out == recorded
    low, high = tau
    # full acceptance: every verify step but the last of each request (capped by max_tokens) takes K + 1
    assert low - 0.25 * (low == high == K + 1) <= metrics.acceptance_length <= high
    if acceptance[0] == 0.5:
        first = metrics.accepted_per_position[0] / metrics.num_steps
        assert 0.3 < first < 0.7


def test_bad_acceptance_and_too_little_rollback_room_are_errors(llm_and_run):
    llm, prompts, recorded = llm_and_run
    with pytest.raises(ValueError, match="acceptance must be k >= 1 probabilities"):
        ReplayDrafter({}, [1.5], llm.vocab_size)
    drafter = ReplayDrafter({}, [1.0] * (K + 1), llm.vocab_size)
    with pytest.raises(ValueError, match="DEEPINFER_MAX_BACKTRACKING_TOKENS"):
        llm.engine.use_speculator(Speculator(llm.runner.model, K + 1, replay=drafter), llm.runner.backtrack)


def test_each_draft_is_the_recorded_token_exactly_when_its_own_coin_says_so():
    """The batched proposal equals the definition, draft by draft: draft i at position p is the
    recorded token iff U(seed ^ sequence seed, p, "draft") < acceptance[i], else a wrong one."""
    prompts = [[5 + i] * (3 + i) for i in range(6)]
    recorded = {tuple(p): [(7 * i + j) % 50 for j in range(12)] for i, p in enumerate(prompts)}
    drafter = ReplayDrafter(recorded, (0.9, 0.5, 0.2), vocab_size=50, seed=11)
    seeds = [2**63 + 17 * i for i in range(len(prompts))]
    for shift in range(12):
        lasts = [len(p) - 1 + (shift + i) % 12 for i, p in enumerate(prompts)]
        want = []
        for p, sd, last in zip(prompts, seeds, lasts):
            run, drafts = recorded[tuple(p)], []
            for i, a in enumerate(drafter.acceptance):
                j = last + 2 + i - len(p)
                true = run[j] if j < len(run) else 0
                right = counter_uniform(11 ^ sd, last + 2 + i, namespace="draft") < a
                drafts.append(true if right else (true + 1) % 50)
            want.append(drafts)
        assert drafter.propose(prompts, seeds, lasts) == want
