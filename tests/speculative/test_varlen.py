"""Confidence-scheduled verification (VARLEN): the length rule, its causality (lossless),
the step-time table, the scheduler's rows fed past max_tokens, and greedy outputs through the engine
equal to non-speculative ones while the verified length follows the confidences."""
from __future__ import annotations

import random

import pytest
from spec_cases import GREEDY, OPTIONS, TOKENS  # noqa: E402

from deepinfer_core import LLM  # noqa: E402
from deepinfer_core.speculative.varlen import (  # noqa: E402
    StepTimes,
    VarlenPolicy,
    choose_length,
    cumulative,
)


def table(fixed: float, per_row: float, buckets=(1, 2, 4, 8), rows: int = 6) -> StepTimes:
    """A step costs `fixed` ms plus `per_row` ms per row of the padded batch."""
    return StepTimes(tuple(buckets), rows, tuple(tuple(fixed + per_row * b * q for q in range(1, rows + 1))
                                                 for b in buckets))


def test_length_follows_confidence_and_cost():
    sure, unsure = [cumulative([0.95] * 5)] * 3, [cumulative([0.1] * 5)] * 3
    assert choose_length(sure, table(1.0, 0.0), 5) == 5         # rows are free: verify everything
    assert choose_length(unsure, table(1.0, 0.2), 5) == 0       # rows cost more than they bring
    cheap = choose_length(sure, table(1.0, 0.02), 5)
    dear = choose_length(sure, table(1.0, 0.3), 5)
    assert 5 >= cheap > dear >= 0
    assert choose_length([], table(1.0, 0.0), 5) == 0
    assert choose_length(sure, table(1.0, 0.0), 2) == 2         # never past max_drafts


def test_whether_draft_j_is_verified_never_depends_on_draft_j():
    """x_j's value shapes a_{j+1}, a_{j+2}, ... (the confidences after it). Changing those must not
    change whether L >= j, or x_j could decide its own verification (not lossless)."""
    rng = random.Random(0)
    for _ in range(500):
        n, k = rng.randint(1, 6), rng.randint(1, 6)
        times = table(rng.uniform(0.2, 2.0), rng.uniform(0.0, 0.3))
        conf = [[rng.random() ** 0.3 for _ in range(k)] for _ in range(n)]
        for j in range(1, k + 1):
            changed = [c[:j] + [rng.random() for _ in range(k - j)] for c in conf]
            before = choose_length([cumulative(c) for c in conf], times, k) >= j
            after = choose_length([cumulative(c) for c in changed], times, k) >= j
            assert before == after


def test_step_times_pick_the_bucket_and_refuse_bad_tables():
    t = table(1.0, 0.1)
    assert t.time(3, 2) == pytest.approx(1.0 + 0.1 * 4 * 2)     # bucket 4
    assert t.time(16, 1) == pytest.approx((1.0 + 0.1 * 8) * 2)  # past the last bucket: linear
    assert t.time(1, 9) == t.time(1, 6)                         # rows past the profile: its last
    with pytest.raises(ValueError, match="ascending"):
        StepTimes((4, 2), 1, ((1.0,), (1.0,)))
    with pytest.raises(ValueError, match="> 0 ms"):
        StepTimes((1,), 1, ((0.0,),))
    assert {r["rows_per_seq"] for r in t.table()} == set(range(1, 7))


def test_policy_reports_the_measured_scale_and_chooses_on_the_table():
    policy = VarlenPolicy(table(1.0, 0.1), max_drafts=5)
    sure = [cumulative([0.8] * 5)] * 4
    before = policy(sure)
    for _ in range(10):        # steps take 1.4x what was profiled (drafting, host work)
        policy.observe(4, before + 1, policy.times.time(4, before + 1) * 1.4)
    assert policy.scale == pytest.approx(1.4)
    assert policy(sure) == before == choose_length(sure, policy.times, 5)   # a common factor keeps the order
    assert policy.chosen[before] == 2


@pytest.fixture(scope="module")
def varlen_llm(trained_dir):
    """Batch-invariant ops (the config refuses VARLEN with invariance; here the policy is installed
    directly so a verify chunk computes exactly what decode steps do, and any divergence is the
    scheduling's)."""
    llm = LLM(model=trained_dir, num_speculative_tokens=4, max_num_seqs=4, **OPTIONS)
    # rows cost: the MTP confidences then pick different lengths at different steps
    llm.engine.use_varlen(VarlenPolicy(table(1.0, 0.06, buckets=(1, 2, 4), rows=5), max_drafts=4))
    return llm


def test_greedy_outputs_equal_non_speculative_ones(varlen_llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    outs = varlen_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    chosen = varlen_llm.engine.varlen.chosen
    assert sum(1 for c in chosen if c) >= 2, chosen         # the length followed the confidences
    m = varlen_llm.engine.spec_metrics
    assert m.num_verified_tokens < m.num_drafted_tokens      # fewer verified than drafted
    assert m.acceptance_length > 1.2


def test_rows_past_max_tokens_are_fed_but_never_accepted(varlen_llm, prompts_and_reference):
    """Near max_tokens a chunk feeds its drafts (one step shape) but may accept none past the end."""
    prompts, reference = prompts_and_reference
    seen = []
    sched = varlen_llm.engine.scheduler
    schedule = sched.schedule

    def spy():
        out = schedule()
        seen.extend((c.num_drafts, c.max_accept, len(c.seq.token_ids), c.seq.max_tokens)
                    for c in out.chunks if c.num_drafts)
        return out
    sched.schedule = spy
    try:
        varlen_llm.engine.use_varlen(None)
        outs = varlen_llm.generate(prompt_token_ids=prompts[:3], sampling_params=GREEDY, use_tqdm=False)
    finally:
        del sched.schedule
        varlen_llm.engine.use_varlen(VarlenPolicy(table(1.0, 0.06, buckets=(1, 2, 4), rows=5), max_drafts=4))
    assert [o.outputs[0].token_ids for o in outs] == reference[:3]
    assert all(accept <= min(fed, most - have - 1) for fed, accept, have, most in seen)
    assert any(accept < fed for fed, accept, _, _ in seen)
    assert all(len(o.outputs[0].token_ids) == TOKENS for o in outs)


def test_llm_option_profiles_the_step_times(trained_dir, prompts_and_reference):
    llm = LLM(model=trained_dir, num_speculative_tokens=2, enable_mtp_varlen=True, max_num_seqs=2,
              **{**OPTIONS, "batch_invariant": False})
    times = llm.engine.varlen.times
    assert times.buckets == (1, 2) and times.max_rows == 3
    prompts, _ = prompts_and_reference
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == TOKENS for o in outs)
    assert sum(llm.engine.varlen.chosen) > 0
