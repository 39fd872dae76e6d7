"""MTP speculative decoding under data parallelism.

A speculating rank's lockstep iteration makes as many expert-parallel MoE calls as a plain one: one
verify forward through the main layers; the MTP block drafts with its own experts, locally
(dp_worker.py). Oracle: the workload's greedy tokens from one process with the same speculation, and
from the non-speculative one (`dp_oracle`); float32, QAT off, batch-invariant GEMMs. The tiny checkpoint
(tools/make_tiny_checkpoint.py) has one MTP block (mtp.0.*).
"""
from __future__ import annotations

import pytest

from deepinfer_core import LLM

DRAFTS = 3


@pytest.fixture(scope="module")
def spec_options(dp_workload) -> dict:
    return {**dp_workload.common, "num_speculative_tokens": DRAFTS}


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_dp2_ep_mtp_speculation_equals_one_process(spec_options, dp_workload, dp_oracle, tiny_ckpt_dir):
    prompts = dp_workload.prompts()
    one = LLM(model=str(tiny_ckpt_dir), **spec_options)
    single = _tokens(one.generate(prompt_token_ids=prompts, sampling_params=dp_workload.greedy, use_tqdm=False))
    assert one.engine.spec_metrics.num_steps > 0
    with LLM(str(tiny_ckpt_dir), data_parallel_size=2, enable_expert_parallel=True, **spec_options) as llm:
        assert llm.config.speculative.num_speculative_tokens == DRAFTS
        out = llm.generate(prompt_token_ids=prompts, sampling_params=dp_workload.greedy, use_tqdm=False)
        stats = llm._dp.last_stats
    tokens = _tokens(out)
    assert tokens == single
    assert tokens == dp_oracle
    assert all(len(t) == dp_workload.max_tokens for t in tokens)
    assert len(stats) == 2 and all(s.num_requests > 0 for s in stats)
    assert len({s.iterations for s in stats}) == 1
    for s in stats:     # every rank verified drafts, and drafted as many as it verified or more
        assert s.spec_verify_steps > 0 and s.spec_verified_tokens > 0
        assert s.spec_drafted_tokens >= s.spec_verified_tokens >= s.spec_accepted_tokens
        assert s.forwards + s.idle_forwards == s.iterations   # one EP pass per iteration


def test_config_accepts_mtp_speculation_and_varlen_under_dp():
    from deepinfer_core.engine_config import EngineConfig
    cfg = EngineConfig.from_options(data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=2)
    assert cfg.speculative.num_speculative_tokens == 2 and cfg.cache.max_backtracking_tokens >= 3
    cfg = EngineConfig.from_options(data_parallel_size=2, num_speculative_tokens=2, enable_mtp_varlen=True)
    assert cfg.speculative.enable_mtp_varlen


VARLEN_PROMPTS = ["HAMLET.\nTo be, or not to be,", "KING.\nMy lord, the", "ROMEO.\nBut soft, what light",
                  "QUEEN.\nAlas, my lord,"]
VARLEN_TOKENS = 24


def test_dp2_ep_mtp_varlen_is_lossless_and_shares_one_step_time_table(tmp_path_factory):
    """VARLEN under DP + EP 2 on the bundled trained model (its MTP block drafts acceptable tokens):
    every rank profiles the same forwards at start-up and schedules with the ranks' elementwise-maximum
    table. VARLEN refuses batch-invariant ops, so the oracle is float32 without the QAT simulation: the
    greedy margins along the reference paths (checked first, from their top-2 logprobs) are far wider
    than float32's rounding of different batch shapes, so any token that differs is the scheduling's."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint
    model = str(make_trained_checkpoint(tmp_path_factory.mktemp("trained") / "ckpt", ARTIFACT))
    options = dict(dtype="float32", simulate_qat=False, max_model_len=256, max_num_seqs=4)
    ref = LLM(model=model, device="cpu", num_speculative_tokens=0, batch_invariant=True, **options)
    scored = SamplingParams(temperature=0.0, max_tokens=VARLEN_TOKENS, ignore_eos=True, logprobs=2)
    outs = ref.generate(VARLEN_PROMPTS, scored, use_tqdm=False)
    gaps = [sorted((lp.logprob for lp in step.values()), reverse=True) for o in outs for step in o.outputs[0].logprobs]
    assert min(top[0] - top[1] for top in gaps) > 1e-3, "the reference paths have near-ties: choose other prompts"
    reference = _tokens(outs)
    greedy = SamplingParams(temperature=0.0, max_tokens=VARLEN_TOKENS, ignore_eos=True)
    with LLM(model, data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=2,
             enable_mtp_varlen=True, **options) as llm:
        out = llm.generate(VARLEN_PROMPTS, greedy, use_tqdm=False)
        stats = llm._dp.last_stats
    assert _tokens(out) == reference
    assert len(stats) == 2 and all(s.num_requests > 0 for s in stats)
    assert stats[0].varlen_ms == stats[1].varlen_ms and len(stats[0].varlen_ms) > 0   # one table
    # VARLEN drafts where the profiled table says drafting pays: on a loaded CPU a rank's profile may
    # say it never does for its batches, so speculation is required of some rank, not of each
    assert any(s.spec_verify_steps > 0 for s in stats), stats
    for s in stats:
        assert sum(s.varlen_chosen) > 0, s                 # VARLEN chose a length (histogram of L)
        assert (s.spec_verify_steps > 0) == (sum(s.varlen_chosen[1:]) > 0), s      # L > 0: verified
        assert s.spec_drafted_tokens >= s.spec_verified_tokens >= s.spec_accepted_tokens
        assert s.forwards + s.idle_forwards == s.iterations   # still one EP pass per iteration


def test_dp2_ep_dspark_drafting_is_lossless(tmp_path_factory):
    """The DSpark drafter under DP + EP 2 (the bundled DSpark variant: the trained target with its trained
    drafter): its stages are the checkpoint's mtp.* blocks, whose MoE keeps all experts on every rank, and
    it drafts from the features of the step's one verify forward, so a rank still makes one
    expert-parallel pass per iteration. Greedy tokens = the non-speculative ones (float32, QAT off,
    batch-invariant ops)."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.tools.trained_model import ARTIFACT, DSPARK_ARTIFACT, make_trained_checkpoint
    model = str(make_trained_checkpoint(tmp_path_factory.mktemp("trained") / "dspark", ARTIFACT,
                                        drafter=DSPARK_ARTIFACT))
    options = dict(dtype="float32", simulate_qat=False, batch_invariant=True, max_model_len=256, max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=VARLEN_TOKENS, ignore_eos=True)
    reference = _tokens(LLM(model=model, device="cpu", num_speculative_tokens=0, **options)
                        .generate(VARLEN_PROMPTS, greedy, use_tqdm=False))
    with LLM(model, data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=3, **options) as llm:
        out = llm.generate(VARLEN_PROMPTS, greedy, use_tqdm=False)
        stats = llm._dp.last_stats
    assert _tokens(out) == reference
    assert len(stats) == 2 and all(s.num_requests > 0 for s in stats)
    for s in stats:
        assert s.spec_proposer == "DSparkDrafter"
        assert s.spec_verify_steps > 0 and s.spec_accepted_tokens > 0
        assert s.forwards + s.idle_forwards == s.iterations
