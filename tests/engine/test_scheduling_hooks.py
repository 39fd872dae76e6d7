"""The scheduling policy (deepinfer_scheduler_policy) and the draft verifier (deepinfer_verifier):
what the core offers by default, and that a policy orders admission. The engine's use of the
runner's policy: tests/api/test_llm.py; of its verifier: tests/speculative/test_verifier_hook.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.api.outputs import RequestMetrics
from deepinfer_core.cache.block_allocator import BlockAllocator
from deepinfer_core.contracts import DraftVerifier, SchedulingPolicy, resolve_scheduling
from deepinfer_core.engine.scheduler import FirstComeFirstServed, Scheduler, SchedulerConfig
from deepinfer_core.engine.sequence import Request, Sequence
from deepinfer_core.ops.verify import ExactVerifier
from deepinfer_core.plugin_context import Platform
from deepinfer_core.plugins import PluginError, get_plugin_manager


class ShortestPromptFirst:
    name = "shortest-prompt-first"

    def admission_key(self, request: Request) -> int:
        return len(request.prompt_token_ids)


def sequence(seq_id: int, prompt_len: int) -> Sequence:
    req = Request(f"r{seq_id}", None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4),
                  0, RequestMetrics(arrival_time=0.0))
    return Sequence(seq_id, req, 0, 0, 4)


def admitted(policy, lengths: list[int], max_num_seqs: int = 1) -> list[int]:
    """The seq ids in the order a scheduler admits them, one step at a time."""
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, block_size=128, max_model_len=1024),
                  BlockAllocator(64, 8), policy)
    for i, n in enumerate(lengths):
        s.add(sequence(i, n))
    order = []
    while s.waiting:
        out = s.schedule()
        order += [seq.seq_id for seq in out.admitted]
        for seq in out.admitted:
            s.finish(seq)
    return order


def test_the_core_admits_first_come_first_served():
    assert admitted(None, [9, 3, 5, 3]) == [0, 1, 2, 3]
    assert admitted(FirstComeFirstServed(), [9, 3, 5, 3]) == [0, 1, 2, 3]


def test_a_policy_orders_admission_and_equal_keys_keep_arrival_order():
    assert admitted(ShortestPromptFirst(), [9, 3, 5, 3]) == [1, 3, 2, 0]


def test_a_preempted_sequence_resumes_before_any_key():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, block_size=128, max_model_len=1024),
                  BlockAllocator(64, 8), ShortestPromptFirst())
    long = sequence(0, 50)
    s.add(long)
    assert s.schedule().admitted == [long]
    long.num_pending = 0                          # its step was post-processed
    s._preempt(long, SimpleNamespace(preempted=[]))
    s.add(sequence(1, 2))                         # a lower key arrives after the preemption
    assert s.schedule().admitted == [long]


def test_the_core_plugin_offers_both_and_they_satisfy_their_contracts():
    ctx = SimpleNamespace(platform=Platform("cpu", "cpu"))
    policy, verifier = resolve_scheduling(get_plugin_manager(), ctx)
    assert isinstance(policy, SchedulingPolicy) and isinstance(verifier, DraftVerifier)
    assert isinstance(policy, FirstComeFirstServed) and isinstance(verifier, ExactVerifier)


def test_a_verifier_without_the_contract_is_refused_at_start():
    pm = SimpleNamespace(scheduler_policy=lambda ctx: FirstComeFirstServed(),
                         verifier=lambda ctx: SimpleNamespace(verify=None))
    with pytest.raises(PluginError, match="verifier .* does not implement DraftVerifier: missing "
                                          "exact_greedy"):
        resolve_scheduling(pm, None)
