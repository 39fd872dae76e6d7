"""Data-parallel engine processes (gloo, CPU) with expert parallelism on the tiny DeepSeek-V4 model.

Oracle: plain `LLM.generate` in this process (one engine, a roomy cache, unchunked prefill). The DP
engines run 2 and 4 ranks, each rank its own engine with a tiny state cache (3 blocks of 128
positions: running sequences are preempted and recomputed) and a 64-token step budget (every prompt
is chunked), the routed experts sharded over the ranks with replicas. Greedy tokens must be identical:
float32, QAT off, batch-invariant GEMMs (row-invariant, as the EP oracle test needs for bitwise logits;
the prompts then see the same numbers whatever batch, chunk or rank they land in).

A rank that dies mid-run (the test hook: os._exit inside the lockstep loop) must make `generate`
raise one RuntimeError naming that rank, well within the ranks' collective timeout; so must a rank
killed from outside (SIGKILL). Each engine is reused for its failure check: 6 processes in all.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from deepinfer_core.parallel.dp_engine import DataParallelLLM, assign_ranks

TIMEOUT_S = 60.0


def _dp_tokens(llm: DataParallelLLM, w) -> list[list[int]]:
    out = llm.generate(prompt_token_ids=w.prompts(), sampling_params=w.greedy)
    assert [o.request_id for o in out] == [str(i) for i in range(w.num_prompts)]      # the caller's order
    assert all(len(o.outputs[0].token_ids) == w.max_tokens for o in out)
    return [o.outputs[0].token_ids for o in out]


def _check_stats(llm: DataParallelLLM, w) -> None:
    stats = llm.last_stats
    assert len({s.iterations for s in stats}) == 1, stats              # lockstep: same iteration count
    for s in stats:
        assert s.forwards + s.idle_forwards == s.iterations, s          # one MoE pass per iteration
        assert s.num_requests == sum(1 for r in assign_ranks([len(p) for p in w.prompts()], llm.world)
                                     if r == s.rank)
    assert any(s.num_preemptions > 0 for s in stats), f"no rank preempted: {stats}"


def test_dp2_matches_one_process_then_a_dead_rank_fails_fast(dp_oracle, dp_workload, tiny_ckpt_dir):
    w = dp_workload
    with DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=2, num_redundant_experts=2, timeout_s=TIMEOUT_S,
                         **w.common, **w.tight) as llm:
        assert _dp_tokens(llm, w) == dp_oracle
        _check_stats(llm, w)
        llm._exit_at = (1, 5)              # rank 1 exits at lockstep iteration 5 of the next call
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 of 2 died \(the test hook's exit\)"):
            llm.generate(prompt_token_ids=w.prompts(), sampling_params=w.greedy)
        assert time.monotonic() - t0 < TIMEOUT_S / 2
        assert all(p.exitcode is not None for p in llm._procs)       # the survivor was terminated
        with pytest.raises(RuntimeError, match="has stopped"):
            llm.generate(prompt_token_ids=w.prompts()[:1], sampling_params=w.greedy)


def test_dp4_matches_one_process_then_a_killed_rank_fails_fast(dp_oracle, dp_workload, tiny_ckpt_dir):
    w = dp_workload
    with DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=4, timeout_s=TIMEOUT_S, **w.common, **w.tight) as llm:
        assert _dp_tokens(llm, w) == dp_oracle
        _check_stats(llm, w)
        assert any(s.idle_forwards for s in llm.last_stats)     # a rank ran placeholders for the others
        # SIGKILL from outside, one second into a run that takes several
        killer = threading.Timer(1.0, os.kill, (llm._procs[2].pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 2 of 4 died \(killed by SIGKILL\)"):
            llm.generate(prompt_token_ids=w.prompts(), sampling_params=w.greedy)
        killer.join()
        assert time.monotonic() - t0 < TIMEOUT_S / 2


def test_assignment_is_by_load_and_deterministic():
    assert assign_ranks([100, 10, 10, 10, 50], 2) == [0, 1, 1, 1, 1]
    assert assign_ranks([5, 5, 5], 4) == [0, 1, 2]                   # rank 3 gets nothing: it idles
    assert assign_ranks([], 3) == []


def test_unsupported_options_are_refused(tiny_ckpt_dir):
    with pytest.raises(ValueError, match="num_redundant_experts=2 needs enable_expert_parallel"):
        DataParallelLLM(str(tiny_ckpt_dir), enable_expert_parallel=False, num_redundant_experts=2)
    with pytest.raises(ValueError, match="device"):
        DataParallelLLM(str(tiny_ckpt_dir), device="cuda")
    with pytest.raises(ValueError, match="data_parallel_size"):
        DataParallelLLM(str(tiny_ckpt_dir), data_parallel_size=0)
