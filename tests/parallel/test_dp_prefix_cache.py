"""Prefix caching under data parallelism: the front end's prefix-aware placement (dp_router.py) and
the reset of every rank's cache through it.

Without processes: `route` takes the longest match while its rank's load is within the slack of the
least and the least load beyond it; the router's keys are the ranks' caches' own (the salt and
`cache_salt` included); it remembers what it sent where, forgets leaves first when full, and
places a prompt of bad ids by load. With two CPU ranks (tiny V4, prefix caching on): a repeated
prompt on each rank hits, `LLM.reset_prefix_cache()` resets both ranks and the prompts then miss;
two conversations whose second turns come in the other order (placement by load alone would swap
their ranks) both hit.
"""
from __future__ import annotations

import queue

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.api.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_core.cache.block_allocator import BlockAllocator
from deepinfer_core.cache.prefix_cache import PrefixCache
from deepinfer_core.engine.sequence import Request, Sequence
from deepinfer_core.parallel.dp_messages import (
    RESET_PREFIX_CACHE,
    IdleReport,
    PrefixKeying,
    RankRequest,
    RankStats,
    ResetReport,
    StepReport,
)
from deepinfer_core.parallel.dp_online import OnlineFrontEnd
from deepinfer_core.parallel.dp_router import ROUTE_SLACK_TOKENS, PrefixRouter, route

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
KEYING = PrefixKeying(("model", "torch.float32", False, None, True), 128)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 129000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(prompt: list[int], salt: str | None = None) -> RankRequest:
    return RankRequest("r", None, prompt, GREEDY, 0, cache_salt=salt)


def test_route_prefers_the_longest_match_within_the_slack_and_the_least_load_beyond_it():
    s = ROUTE_SLACK_TOKENS
    assert route([0, 3], [100, 100 + s]) == 1         # the match wins within the slack
    assert route([0, 3], [100, 101 + s]) == 0         # the load wins beyond it
    assert route([1, 3, 2], [0, 10 * s, 5]) == 2      # the longest match among those in reach
    assert route([2, 2], [10, 0]) == 1                # then the least load,
    assert route([0, 0], [7, 7]) == 0                 # then the lowest rank
    assert route([0, 0, 0], [30, 20, 20]) == 1        # no match: the least load, as without caching
    assert route([0, 5], [0, 50], slack=0) == 0
    with pytest.raises(ValueError, match="one of each per rank"):
        route([1], [0, 0])


def test_the_routers_keys_are_the_ranks_prefix_cache_keys():
    prompt, router = ids(300, 1), PrefixRouter(KEYING, 2)
    cache = PrefixCache(BlockAllocator(1, 1), KEYING.block_size, 0, salt=KEYING.salt)

    def rank_keys(salt: str | None) -> list[bytes]:          # what a rank looks the prompt up by
        req = Request("r", None, prompt, GREEDY, 0, RequestMetrics(0.0), cache_salt=salt)
        seq = Sequence(0, req, 0, 0, 4)
        return cache.keys(seq, seq.num_tokens - 1)

    want = rank_keys(None)
    assert len(want) == 2 and router.keys(request(prompt)) == want
    assert router.keys(request(prompt, "alice")) == rank_keys("alice") != want
    other = PrefixKeying(("model", "torch.bfloat16", False, None, True), 128)
    assert PrefixRouter(other, 2).keys(request(prompt)) != want
    assert router.keys(request(prompt[:129])) == want[:1]    # the last token's block is left out
    assert router.keys(request(prompt[:128])) == []


def test_the_router_remembers_what_it_sent_where_and_forgets_leaves_first():
    router = PrefixRouter(KEYING, 2, capacity=4)
    a, b = ids(400, 2), ids(300, 3)                            # 3 and 2 blocks
    assert router.place(request(a), [0, 0]) == 0
    assert router.place(request(b), [400, 0]) == 1
    assert len(router) == 4                                    # a's leaf went first
    assert router.matches(router.keys(request(a + ids(10, 4)))) == [2, 0]
    assert router.matches(router.keys(request(b + ids(10, 4)))) == [0, 2]
    assert router.place(request(b + ids(200, 5)), [0, 0]) == 1      # b's next turn: to b's rank
    assert router.place(request(a + ids(200, 6)), [0, 0]) == 0
    busy = [ROUTE_SLACK_TOKENS + 1, 0]
    assert router.place(request(b), busy) == 1                 # b's rank is the least loaded
    assert router.place(request(a), busy) == 1                 # a's rank is too busy
    assert router.place(request([2**70] * 300), [5, 0]) == 1   # not int64 ids: by load
    router.clear()
    assert len(router) == 0 and router.place(request(a), [0, 0]) == 0
    with pytest.raises(ValueError, match="capacity=0"):
        PrefixRouter(KEYING, 2, capacity=0)


class _Reports(queue.Queue):
    """The ranks' reports, already sent."""

    def get_nowait(self):
        return self.get(timeout=0)


class _OneRank(OnlineFrontEnd):
    """The front end's online side over one rank that is never heard of but through `_Reports`."""

    def __init__(self, reports: list[tuple]):
        self.world, self._failed = 1, None
        self._commands, self._results = [queue.Queue()], _Reports()
        self._procs = [type("Alive", (), {"exitcode": None})()]
        self._init_online()
        for msg in reports:
            self._results.put(msg)

    def dead_ranks(self) -> list[int]:
        return []


def test_a_reset_keeps_the_outputs_that_came_before_its_answer():
    """The last output and the idle report come while the front end waits for the answer: the
    request is still unfinished for the caller until `step` has returned that output."""
    done = RequestOutput("r", None, [], None, [CompletionOutput(0, "", [5], None, None, "length")],
                         True)
    front = _OneRank([("step", StepReport(0, [done], {}, {}, 0, {}, 1)),
                      ("idle", IdleReport(0, 1, 1, 0, {}, RankStats(0))),
                      ("reset", ResetReport(0, True, {"g": 1.0}))])
    front._dispatch({0: [request([1, 2, 3])]})
    assert front.reset_prefix_cache() is True
    assert front._commands[0].get_nowait() == ("add", [request([1, 2, 3])])
    assert front._commands[0].get_nowait() == (RESET_PREFIX_CACHE,)
    assert front.gauges() == {"g": 1.0}
    assert front.has_unfinished_requests()
    assert front.step() == [done] and not front.has_unfinished_requests()


@pytest.fixture(scope="module")
def dp_llm(tiny_ckpt_dir):
    with LLM(str(tiny_ckpt_dir), data_parallel_size=2, enable_prefix_caching=True, dtype="float32",
             simulate_qat=False, batch_invariant=True, num_speculative_tokens=0,
             max_model_len=1024) as llm:
        yield llm


def cached(llm: LLM, prompts: list[list[int]]) -> list[int]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    return [o.num_cached_tokens for o in outs]


def test_reset_prefix_cache_resets_every_rank(dp_llm):
    prompts = [ids(300, 7), ids(300, 8)]                      # one on each rank
    assert cached(dp_llm, prompts) == [0, 0]
    assert [s.num_requests for s in dp_llm._dp.last_stats] == [1, 1]
    assert cached(dp_llm, prompts) == [256, 256]
    assert dp_llm.reset_prefix_cache() is True
    assert cached(dp_llm, prompts) == [0, 0]


def test_conversations_stay_on_the_rank_holding_their_history(dp_llm):
    """Turn 1 of A and B in one call: A on rank 0, B on rank 1. Their second turns come B first: by
    load alone B would go to rank 0 and A to rank 1, where neither's history is cached."""
    a1, b1 = ids(300, 9), ids(300, 10)
    out = dp_llm.generate(prompt_token_ids=[a1, b1], sampling_params=GREEDY)
    assert [o.num_cached_tokens for o in out] == [0, 0]
    assert [s.num_requests for s in dp_llm._dp.last_stats] == [1, 1]
    a2, b2 = (p + o.outputs[0].token_ids + ids(40, 11 + i)
              for i, (p, o) in enumerate(zip((a1, b1), out)))
    assert all(n >= 256 for n in cached(dp_llm, [b2, a2]))
    assert [s.num_requests for s in dp_llm._dp.last_stats] == [1, 1]


def test_a_reset_while_a_request_runs_is_false_and_loses_none_of_its_outputs(dp_llm):
    """Online (the server's calls): the running request holds its cached blocks, so its rank
    cannot empty its cache; the outputs that arrive while the front end waits for the answers
    still come."""
    dp, params = dp_llm._dp, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    dp.add_request("online", ids(300, 20), params)
    tokens: list[int] = []
    while not tokens:
        tokens += [t for out in dp.step() for t in out.outputs[0].token_ids]
    assert dp.reset_prefix_cache() is False
    while dp.has_unfinished_requests():
        tokens += [t for out in dp.step() for t in out.outputs[0].token_ids]
    assert len(tokens) == params.max_tokens
    assert dp.reset_prefix_cache() is True
