"""MTP speculative decoding under data parallelism (issue 20).

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


def test_config_accepts_mtp_speculation_and_refuses_varlen_under_dp():
    from deepinfer_core.engine_config import EngineConfig
    cfg = EngineConfig.from_options(data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=2)
    assert cfg.speculative.num_speculative_tokens == 2 and cfg.cache.max_backtracking_tokens >= 3
    with pytest.raises(ValueError, match=r"enable_mtp_varlen=True .*DSpark"):
        EngineConfig.from_options(data_parallel_size=2, num_speculative_tokens=2, enable_mtp_varlen=True)
