"""Prefix caching through `LLM.generate` (tiny V4, batch-invariant ops; float32 on the CPU, bf16 on
a GPU): with caching
on, every output is bitwise the output with caching off, and every case asserts a hit
(`num_cached_tokens > 0`), so none can pass without one. Cases: a repeated prompt, a shared system
prompt (the junction kept on the second request, hit by the third), a multi-turn conversation
(the previous turn's output end), prompts ending on, just before and just after a block boundary,
a preempted request resumed as a hit, the completions of an n > 1 request; the cache reset frees
every block and checkpoint."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cache.prefix_cache import NO_CHECKPOINT

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 129000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# float32 on the CPU; on a GPU (marked gpu: `python -m pytest -m gpu` on the file) bf16 with the
# nvidia backend's batch-invariant kernels and CUDA graphs, in a 1 GiB cache
DEVICES = {"cpu": dict(dtype="float32"),
           "cuda": dict(dtype="bfloat16", device="cuda", kv_cache_memory_bytes=1 << 30)}


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def base(request, tiny_ckpt_dir):
    return LLM(model=str(tiny_ckpt_dir), batch_invariant=True, max_model_len=1024, max_num_seqs=4,
               max_num_batched_tokens=512, **DEVICES[request.param])


def over(base: LLM, caching: bool, **opts) -> LLM:
    sized = {} if "num_cache_blocks" in opts else DEVICES[str(base.runner.device).split(":")[0]]
    opts = {"max_model_len": 1024, "max_num_seqs": 4, "max_num_batched_tokens": 512,
            "kv_cache_memory_bytes": sized.get("kv_cache_memory_bytes"), **opts}
    return LLM.from_runner(base.runner, tokenizer=base.tokenizer, enable_prefix_caching=caching,
                           **opts)


def one_by_one(llm: LLM, prompts, params=GREEDY):
    """Each prompt in its own generate call (so the earlier ones are cached): (tokens, cached)."""
    outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def assert_empty_after_reset(llm: LLM) -> None:
    assert llm.reset_prefix_cache()
    assert llm.engine.scheduler.blocks.allocator.empty, "blocks or checkpoints left after a reset"


def compare(base: LLM, prompts, params=GREEDY, **opts):
    """Outputs with caching on equal those with it off; returns the hits and the cache's stats (the
    cache is reset: the next LLM over the runner may re-size it)."""
    cold, none = one_by_one(over(base, False, **opts), prompts, params)
    assert none == [0] * len(prompts)
    warm = over(base, True, **opts)
    got, cached = one_by_one(warm, prompts, params)
    assert got == cold
    stats = warm.engine.scheduler.prefix.stats
    assert_empty_after_reset(warm)
    return cached, stats


def test_a_repeated_prompt_hits_at_its_last_block_boundary(base):
    p = ids(300, 1)
    cached, st = compare(base, [p, p, p])
    assert cached == [0, 256, 256]
    assert (st.queries, st.hits, st.hit_tokens) == (3, 2, 512)


def test_a_shared_system_prompt_is_kept_at_the_junction_and_hit_there(base):
    system = ids(300, 2)
    prompts = [system + ids(150, 10 + i) for i in range(4)]
    cached, st = compare(base, prompts)
    # the first keeps 384 (its own tail); the second shares blocks 0-1 without a checkpoint there,
    # so it keeps the junction at 256, which the later ones hit
    assert cached == [0, 0, 256, 256]
    assert st.cut_short[NO_CHECKPOINT] == 1


def test_a_multi_turn_conversation_hits_the_previous_output_end(base):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cold_llm, turns, cold = over(base, False), [ids(250, 3)], []
    for k, question in enumerate((110, 10, 1)):   # each turn: the history, its output, a question
        cold += one_by_one(cold_llm, turns[-1:], params)[0]
        turns.append(turns[-1] + cold[-1] + ids(question, 20 + k))
    warm_llm = over(base, True)
    warm, hits = one_by_one(warm_llm, turns[:3], params)
    assert warm == cold
    # turn 1 (250 + 20) decoded past 256, turn 2 (380 + 20) past 384: the next turn hits there
    assert hits == [0, 256, 384]
    assert_empty_after_reset(warm_llm)


def test_prompts_ending_on_and_around_a_boundary(base):
    """(prompt length, hit on its repeat): a hit leaves the last prompt token to compute."""
    cases = [(128, 0), (129, 128), (255, 128), (256, 128), (257, 256)]
    prompts = [p for i, (n, _) in enumerate(cases) for p in [ids(n, 40 + i)] * 2]
    assert compare(base, prompts)[0] == [x for _, hit in cases for x in (0, hit)]


def test_a_prompt_ending_on_a_boundary_is_hit_whole_by_its_continuation(base):
    p = ids(256, 5)
    # the first decodes from 256: a checkpoint there
    assert compare(base, [p, p + ids(40, 6)])[0] == [0, 256]


@pytest.mark.slow
def test_a_preempted_request_resumes_as_a_hit(base):
    """Two requests that cannot both finish in 7 blocks: the newer is preempted when both need their
    fourth block; its blocks before 384 stay cached, and it resumes from them."""
    prompts = [ids(260, 7), ids(260, 8)]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        llm = over(base, caching, num_cache_blocks=7, max_num_seqs=2, prefix_checkpoint_slots=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[caching] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.scheduler.num_preemptions > 0
    assert runs[True] == runs[False]
    st = llm.engine.scheduler.prefix.stats
    assert (st.hits, st.hit_tokens) == (1, 384)         # only the resumed request can hit
    assert_empty_after_reset(llm)


@pytest.mark.slow
def test_requests_of_one_call_share_what_the_earlier_ones_cached(base):
    system = ids(400, 9)
    prompts = [system + ids(20 + i, 30 + i) for i in range(10)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    cold = over(base, False).generate(requests, GREEDY, use_tqdm=False)
    llm = over(base, True)
    warm = llm.generate(requests, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    # max_num_seqs=4: the first four start cold; the later ones hit the first one's 384
    assert [o.num_cached_tokens for o in warm][4:] == [384] * 6
    assert_empty_after_reset(llm)


def test_the_completions_of_one_request_share_its_prompt(base):
    """n > 1: the other completions wait for the first one's prompt checkpoint and hit it."""
    p = ids(300, 14)
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=5)
    cold = over(base, False).generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
    llm = over(base, True)
    warm = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in warm.outputs] == [c.token_ids for c in cold.outputs]
    st = llm.engine.scheduler.prefix.stats
    assert (st.hits, st.hit_tokens) == (2, 512)
    assert_empty_after_reset(llm)


def test_only_requests_with_the_same_cache_salt_share(base):
    llm = over(base, True)
    p = ids(300, 11)
    outs = [llm.generate({"prompt_token_ids": p, "cache_salt": s}, GREEDY, use_tqdm=False)[0]
            for s in ("a", "b", "a", None)]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 256, 0]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert_empty_after_reset(llm)


def test_bad_prefix_caching_input_names_the_field(base, tiny_v41_dir):
    llm = over(base, True)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids(10, 1), "cache_salt": 5}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prefix_checkpoint_interval=100.*multiple of 128"):
        LLM.from_runner(base.runner, enable_prefix_caching=True, prefix_checkpoint_interval=100)
    want = ("enable_prefix_caching=True with yoco_prefill_truncation_mode='compact'.*allowed "
            "together: yoco_prefill_truncation_mode='off'")
    with pytest.raises(ValueError, match=want):
        LLM(model=str(tiny_v41_dir), dtype="float32", yoco_prefill_truncation_mode="compact",
            enable_prefix_caching=True).generate({"prompt_token_ids": ids(10, 1)}, GREEDY)


def test_on_by_default_where_exact(base, tiny_v41_dir):
    """Unset (None), caching is on, except under V4.1's truncated prefill, where it is off."""
    assert LLM.from_runner(base.runner, tokenizer=base.tokenizer).engine.scheduler.prefix is not None
    v41 = LLM(model=str(tiny_v41_dir), dtype="float32", max_model_len=512)
    assert v41.runner.truncation is None and v41.engine.scheduler.prefix is not None
    compact = LLM(model=str(tiny_v41_dir), dtype="float32", max_model_len=512,
                  yoco_prefill_truncation_mode="compact")
    assert compact.runner.truncation.mode == "compact" and compact.engine.scheduler.prefix is None


def test_v41_hits_exactly_with_truncation_off(tiny_v41_dir):
    opts = dict(dtype="float32", batch_invariant=True, yoco_prefill_truncation_mode="off",
                max_model_len=1024)
    p = ids(300, 12)
    outs = {}
    for caching in (False, True):
        llm = LLM(model=str(tiny_v41_dir), enable_prefix_caching=caching, **opts)
        res = [llm.generate({"prompt_token_ids": q}, GREEDY, use_tqdm=False)[0]
               for q in (p, p + ids(9, 13))]
        outs[caching] = [o.outputs[0].token_ids for o in res]
    assert outs[True] == outs[False]
    assert [o.num_cached_tokens for o in res] == [0, 256]
