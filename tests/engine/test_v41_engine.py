"""The engine guarantees of the V4 tests, on the tiny DeepSeek-V4.1 (CPU, float32; QAT off unless
the V4 test runs with it): batched = one at a time, chunked prefill = unchunked, asynchronous
scheduling on = off, preemption loses nothing, bitwise batch invariance with the batch_invariant
feature, JSON schema outputs (the server: tests/serve/test_v41_server.py). The prompts (60-200
tokens) make both top-k levels bind: the tiny V4.1 keeps 8 candidate blocks of 4 entries and 8
index entries, a C2 entry every 2 tokens and a C1 entry every token, behind a 16-token window; the
first test shows that each level cuts."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from deepinfer_batch_invariant.check import random_prompts, run_check

from deepinfer_core import LLM, SamplingParams

NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
LONG = [60, 137, 17, 200, 91, 3, 150, 75]        # mixed with two short ones, which bind nothing


def prompts(n: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


@pytest.fixture(scope="module")
def base(tiny_v41_dir):
    with pytest.MonkeyPatch.context() as mp:
        # JSON may use at most 2 whitespace characters per gap (tests/structured: a random model
        # would otherwise spend its tokens on whitespace); read when the runner is built
        mp.setenv("DEEPINFER_SO_JSON_MAX_WHITESPACE", "2")
        yield LLM(model=str(tiny_v41_dir), dtype="float32", simulate_qat=False, max_model_len=1024)


def llm_over(base: LLM, **opts) -> LLM:
    """Another LLM front end over the same loaded model (fresh request counter)."""
    return LLM.from_runner(base.runner, tokenizer=base.tokenizer, max_model_len=base.max_model_len,
                           **opts)


def generate(llm: LLM, ps, params=GREEDY) -> list:
    out = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    eng = llm.engine
    assert eng.scheduler.blocks.allocator.reclaim(), "slots or blocks leaked"
    assert not eng.has_unfinished_requests() and not eng.scheduler.running and not eng._requests
    return out


def assert_same_outputs(xs, ys) -> None:
    """Tokens, texts and finish reasons exactly; logprobs within 1e-4 (as in
    test_engine_semantics.py: float32 GEMMs round per shape, so a token tied within that rounding
    at the top-k cut may be listed on one side only, within 1e-4 of the other side's lowest)."""
    def same_lp(e, f) -> bool:
        if e is None or f is None:
            return e is f

        def only_at_the_cut(a, b) -> bool:
            floor = min(lp.logprob for lp in b.values())
            return all(abs(a[t].logprob - floor) <= 1e-4 for t in a.keys() - b.keys())
        return (all(abs(e[t].logprob - f[t].logprob) <= 1e-4 for t in e.keys() & f.keys())
                and only_at_the_cut(e, f) and only_at_the_cut(f, e))
    assert len(xs) == len(ys)
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert len(x.outputs) == len(y.outputs)
        for c, d in zip(x.outputs, y.outputs):
            assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == \
                   (d.token_ids, d.text, d.finish_reason, d.stop_reason), f"request {i}"
            assert (c.logprobs is None) == (d.logprobs is None)
            assert all(same_lp(e, f) for e, f in zip(c.logprobs or [], d.logprobs or [])), \
                f"request {i}"


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- the prompts make the top-k levels bind ------------------------------------------------------
def same_weights(ckpt, out, **text) -> LLM:
    """The checkpoint's weights under a config with other `text_config` keys."""
    out.mkdir()
    for f in ckpt.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"].update(text)
    (out / "config.json").write_text(json.dumps(cfg))
    return LLM(model=str(out), dtype="float32", simulate_qat=False, max_model_len=1024)


def differ(xs, ys) -> list[bool]:
    """Per request: other tokens, or a first-token logprob more than 1e-3 away."""
    def one(x, y) -> bool:
        a, b = x.outputs[0], y.outputs[0]
        return a.token_ids != b.token_ids or any(
            abs(a.logprobs[0][t].logprob - b.logprobs[0][t].logprob) > 1e-3
            for t in a.logprobs[0].keys() & b.logprobs[0].keys())
    return [one(x, y) for x, y in zip(xs, ys)]


def test_the_prompts_make_both_top_k_levels_bind(base, tiny_v41_dir, tmp_path):
    """Every candidate block kept (index top-8 of all entries), then every index entry too: each
    step changes the outputs of every long prompt, so each level cuts there; where prompt and
    output stay within 8 tokens, neither level cuts and nothing changes."""
    mc = base.model_config
    assert (mc.sliding_window, mc.index_topk, mc.topology.candidate_block_size,
            mc.topology.candidate_topk_blocks) == (16, 8, 4, 8)
    all_blocks = same_weights(tiny_v41_dir, tmp_path / "blocks", candidate_topk_blocks=1024)
    everything = same_weights(tiny_v41_dir, tmp_path / "all", candidate_topk_blocks=1024,
                              index_topk=1024)
    short, long = prompts(2, [3, 5], seed=5), prompts(3, [60, 137, 200], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    runs = [generate(llm, short + long, params) for llm in (base, all_blocks, everything)]
    assert_same_outputs(runs[0][:2], runs[2][:2])
    assert differ(runs[0][2:], runs[1][2:]) == [True] * 3, "the candidate level cuts nothing"
    assert differ(runs[1][2:], runs[2][2:]) == [True] * 3, "the index top-k cuts nothing"


def test_the_default_numerics_run_with_binding_candidate_blocks(tiny_v41_dir):
    """bfloat16 with the QAT simulation, the engine's defaults: the candidate level scores its
    blocks in bfloat16 there (it once failed on a float32 fill)."""
    llm = LLM(model=str(tiny_v41_dir), dtype="bfloat16", max_model_len=1024)
    assert llm.config.model.simulate_qat
    outs = generate(llm, prompts(2, [137, 200], seed=6),
                    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


# ---- continuous batching (tests/engine/test_continuous_batching.py) ------------------------------
def test_batched_equals_one_at_a_time(base):
    ps = prompts(5, LONG, seed=1)
    # 256 tokens a step: prompts chunked beside decodes
    batched = generate(llm_over(base, max_num_seqs=8, max_num_batched_tokens=256), ps)
    alone = [generate(llm_over(base, max_num_seqs=1), [p])[0] for p in ps]
    assert_same_outputs(batched, alone)
    assert len({tuple(t) for t in tokens(alone)}) == len(ps)     # not one constant output


@pytest.fixture(scope="module")
def chunk_prompts(base):
    ps = prompts(2, [71, 130], seed=2)
    return ps, generate(llm_over(base, max_num_batched_tokens=8192), ps)


@pytest.mark.parametrize("budget", [3, 7])
def test_chunked_prefill_equals_unchunked(base, chunk_prompts, budget):
    """Odd budgets split C2 entries (every 2 tokens), candidate blocks (4 entries: 4 tokens at C1,
    8 at C2) and the 16-token window at every offset."""
    ps, whole = chunk_prompts
    assert_same_outputs(generate(llm_over(base, max_num_batched_tokens=budget), ps), whole)


def test_request_larger_than_the_cache_is_refused_not_hung(base):
    with pytest.raises(ValueError, match="cache blocks"):
        generate(llm_over(base, num_cache_blocks=2), prompts(1, [200], seed=4),
                 SamplingParams(max_tokens=100))


# ---- asynchronous scheduling and preemption (tests/engine/test_engine_semantics.py) --------------
def mixed_params(n: int, stop_id: int) -> list[SamplingParams]:
    """Greedy (one with a stop token the model produces), seeded sampling with logprobs and
    penalties, n = 2, prompt logprobs."""
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2,
                                      stop_token_ids=[stop_id] if i == 0 else None))
        elif kind == 1:
            out.append(SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8 + i % 3,
                                      seed=100 + i, logprobs=2, repetition_penalty=1.3))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.8, top_k=20, n=2, max_tokens=10,
                                      presence_penalty=0.5, frequency_penalty=0.3))
        else:
            out.append(SamplingParams(temperature=0.0, max_tokens=NEW, prompt_logprobs=1,
                                      min_tokens=2))
    return out


def workload(base, lengths, seed: int, n: int = 6):
    """Prompts and mixed_params; request 0 stops early on a token the model really produces."""
    ps = prompts(n, lengths, seed=seed)
    pilot = generate(llm_over(base, async_scheduling=False), ps[:1])
    return ps, mixed_params(len(ps), stop_id=pilot[0].outputs[0].token_ids[3])


def test_async_and_sync_scheduling_give_identical_outputs(base):
    ps, params = workload(base, [60, 137, 200, 17, 91, 75], seed=11)
    runs = {}
    for on in (False, True):
        llm = llm_over(base, async_scheduling=on, seed=7)
        runs[on] = generate(llm, ps, params)
        assert llm.engine.async_scheduling is on
        if on:
            assert llm.engine.num_dropped_tokens > 0      # the overlap really ran ahead of a stop
    assert_same_outputs(runs[True], runs[False])
    assert runs[True][0].outputs[0].finish_reason == "stop"


def test_preemption_loses_nothing_with_async_scheduling_on_or_off(base):
    """A cache of 3 blocks (384 positions) for 4 requests that need 7 (three cross into a second
    128-position block while decoding): preempted and recomputed, they give the unconstrained
    run's outputs."""
    ps, params = workload(base, [125, 126, 60, 124], seed=12, n=4)
    free = generate(llm_over(base, async_scheduling=False, seed=7), ps, params)
    for on in (False, True):
        small = llm_over(base, async_scheduling=on, seed=7, num_cache_blocks=3,
                         max_num_batched_tokens=256)
        tight = generate(small, ps, params)
        assert small.engine.scheduler.num_preemptions > 0
        assert_same_outputs(tight, free)


# ---- batch invariance (tests/engine/test_batch_invariance.py) ------------------------------------
# Two former causes of variance, each with its own test below: the Engram gate's torch.sigmoid
# (fp32 CPU: vectorised body, scalar tail) and torch.topk's tie-breaking by the row's length (it
# depends on where a prefill chunk ends).


@pytest.fixture(scope="module")
def invariant_llm(tiny_v41_dir):
    return LLM(model=str(tiny_v41_dir), dtype="float32", batch_invariant=True, max_num_seqs=64)


@pytest.fixture(scope="module")
def invariant_report(invariant_llm):
    targets = random_prompts(6, random.Random(7), 60, 160, invariant_llm.vocab_size)
    report = run_check(invariant_llm, targets, batch_sizes=(12,), chunk_sizes=(7,), max_tokens=6,
                       filler_len=(1, 48))
    print(report.table())
    return report


def test_the_invariance_check_ran_every_scenario(invariant_report):
    assert invariant_report.batch_invariant
    # alone and in a batch of 12: all 6 targets; chunks of 7 (tiny): half of them, one at a time
    assert [s.runs for s in invariant_report.scenarios] == [6, 6, 3]


def mismatches(report, kind: str) -> list[int]:
    return [t for s in report.scenarios if s.name.startswith(kind) for t in s.mismatches]


def test_logprobs_bitwise_equal_across_batches(invariant_report):
    assert not mismatches(invariant_report, "batch"), invariant_report.table()


def test_logprobs_bitwise_equal_across_prefill_chunks(invariant_report):
    assert not mismatches(invariant_report, "chunked"), invariant_report.table()


def test_engram_gate_rows_do_not_depend_on_the_other_rows(invariant_llm):
    """The first cause alone: an Engram layer's output rows, together vs one token at a time."""
    engram = invariant_llm.runner.loaded.model.layers[1].engram
    ec = invariant_llm.model_config.engram
    g = torch.Generator().manual_seed(0)
    T, (m, D) = 257, engram.q_weight.shape
    h = torch.randn(T, m, D, generator=g)
    rows = torch.randint(0, engram.embed.weight.shape[0], (T, (ec.max_ngram - 1) * ec.n_heads),
                         generator=g)
    with torch.no_grad():
        whole = engram(h, rows)
        assert all(torch.equal(engram(h[t:t + 1], rows[t:t + 1]), whole[t:t + 1]) for t in range(T))


def test_top_k_selection_does_not_depend_on_the_rows_not_yet_visible(invariant_llm):
    """The second cause alone: the index top-k of query rows with tied scores, without and with
    the masked (-inf) rows of later positions that a longer prefill chunk has already written."""
    attn = invariant_llm.runner.loaded.ops.attention
    assert attn.official                            # QAT on: the default, as in the V4 test
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (64, 40), generator=g).float()    # small integers: many ties
    valid = torch.ones_like(scores, dtype=torch.bool)
    padded = torch.cat([scores, torch.full((64, 13), float("-inf"))], dim=1)
    longer = torch.cat([valid, torch.zeros(64, 13, dtype=torch.bool)], dim=1)
    assert torch.equal(attn.top_mask(padded, longer, 8)[:, :40], attn.top_mask(scores, valid, 8))


def test_without_the_feature_float32_cpu_results_differ(base):
    """The check can fail on the V4.1 graph: without the feature, logprobs move with the batch."""
    llm = llm_over(base, max_num_seqs=16)
    report = run_check(llm, random_prompts(2, random.Random(7), 60, 160, llm.vocab_size),
                       batch_sizes=(8,), chunk_sizes=(), max_tokens=2)
    print(report.table())
    assert not report.batch_invariant and not report.all_equal


# ---- structured output (tests/structured/test_structured_engine.py) ------------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9 ._-]{1,10}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}


def test_json_schema_output_validates_beside_unconstrained_requests(base):
    so = {"schema_type": "json", "schema": SCHEMA}
    constrained = [SamplingParams(temperature=0.0, max_tokens=200, so_args=so, logprobs=1),
                   SamplingParams(temperature=1.0, max_tokens=200, so_args=so, seed=3)]
    ps = prompts(4, [90, 150, 60, 200], seed=8)
    outs = generate(llm_over(base), ps, constrained + [GREEDY] * 2)
    for o in outs[:2]:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None, c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    greedy = outs[0].outputs[0]        # the mask is in the logprobs: rank 1 of the masked row
    assert all(lp[t].rank == 1 for t, lp in zip(greedy.token_ids, greedy.logprobs))
    assert_same_outputs(outs[2:], generate(llm_over(base), ps[2:]))
