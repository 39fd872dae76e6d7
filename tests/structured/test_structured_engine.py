"""Structured outputs end to end on the tiny V4 model (random weights, real 129,280-token tokenizer):
every constrained output is valid (checked without xgrammar: jsonschema, re, Lark), at temperature 0
and 1 on every sampler path, batched with unconstrained requests that come out exactly as without
them; triggers and bound tokens; preemption and asynchronous scheduling; invalid grammars, compile
failures and timeouts refuse only their own request.

The random model is adversarial: it never prefers to close a string or stop, so every grammar in
`so_corpus` is length-bounded, and JSON may use at most 2 whitespace characters per gap here
(DEEPINFER_SO_JSON_MAX_WHITESPACE=2; the default 16 could make a greedy path spend hundreds of
tokens on whitespace before max_tokens, see so_corpus)."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from so_corpus import EBNF_GRAMMARS, JSON_SCHEMAS, REGEXES, check_ebnf, check_json, check_regex  # noqa: E402

from deepinfer_core import InvalidRequestError, LLM, SamplingParams  # noqa: E402

JSON_MAX_TOKENS, TEXT_MAX_TOKENS = 200, 64
SAMPLERS = [dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05), dict(temperature=0.7, top_k=200)]


@pytest.fixture(scope="module")
def llm(tiny_ckpt_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_SO_JSON_MAX_WHITESPACE", "2")
        # QAT off: float32 batches of different shapes then agree on sampled tokens (with QAT on,
        # a last-bit difference between batch shapes can flip an FP8 rounding).
        yield LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False)


def prompts(n: int, seed: int, length: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(1000, 100000) for _ in range(length)] for _ in range(n)]


def corpus() -> list[tuple[str, dict, callable]]:
    out = [(f"json:{n}", {"schema_type": "json", "schema": s}, lambda t, s=s: check_json(t, s))
           for n, s in JSON_SCHEMAS]
    out += [(f"regex:{n}", {"schema_type": "regex", "schema": r}, lambda t, r=r: check_regex(t, r))
            for n, r in REGEXES]
    out += [(f"ebnf:{n}", {"schema_type": "ebnf", "schema": g}, lambda t, lg=lg: check_ebnf(t, lg))
            for n, g, lg in EBNF_GRAMMARS]
    return out


def test_every_constrained_output_is_valid_beside_unconstrained_requests(llm):
    cases = corpus()
    assert (sum(c[0].startswith("json") for c in cases), sum(c[0].startswith("regex") for c in cases),
            sum(c[0].startswith("ebnf") for c in cases)) >= (20, 10, 5)
    params, checks = [], []
    for i, (name, so, check) in enumerate(cases):
        limit = JSON_MAX_TOKENS if name.startswith("json") else TEXT_MAX_TOKENS
        params.append(SamplingParams(temperature=0, max_tokens=limit, so_args=so, logprobs=1))
        params.append(SamplingParams(**{"temperature": 1.0, **SAMPLERS[i % len(SAMPLERS)]}, max_tokens=limit,
                                     so_args=so, seed=1000 + i))
        checks += [(name + "@T0", check), (name + "@T1", check)]
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.8, max_tokens=24, seed=7, ignore_eos=True)] * 3
    free_prompts = prompts(len(free), seed=1)
    # Unconstrained requests interleaved with the constrained ones (masks must hit the right rows).
    order = list(range(len(params) + len(free)))
    random.Random(0).shuffle(order)
    all_params, all_prompts = params + free, prompts(len(params), seed=2) + free_prompts
    outs = llm.generate(prompt_token_ids=[all_prompts[k] for k in order],
                        sampling_params=[all_params[k] for k in order], use_tqdm=False)
    by_index = {k: o for k, o in zip(order, outs)}
    failures = []
    for i, (name, check) in enumerate(checks):
        comp = by_index[i].outputs[0]
        try:
            assert comp.finish_reason == "stop" and comp.stop_reason is None, comp.finish_reason
            check(comp.text)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
        if params[i].temperature == 0:        # the mask is in the logprobs: greedy = rank 1 of the masked row
            assert all(lp[t].rank == 1 for t, lp in zip(comp.token_ids, comp.logprobs)), name
    assert not failures, f"{len(failures)} of {len(checks)} invalid:\n" + "\n".join(failures)
    alone = llm.generate(prompt_token_ids=free_prompts, sampling_params=free, use_tqdm=False)
    for j, o in enumerate(alone):
        assert by_index[len(params) + j].outputs[0].token_ids == o.outputs[0].token_ids, j


def test_triggers_and_bound_tokens(llm):
    p = prompts(1, seed=3)[0]
    free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True), use_tqdm=False)
    f = free[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    regex = "[0-9]{2,4}"
    trig = tok.encode("```json")
    base = dict(temperature=0, max_tokens=40)
    cases = [
        # the trigger appears on its own (the greedy path emits f[2], f[3]): the grammar starts after it
        SamplingParams(**base, so_args={"schema_type": "regex", "schema": regex, "trigger_token_ids": f[2:4]}),
        # the bound token (the model's 2nd free token) forces the trigger, then the grammar
        SamplingParams(**base, so_args={"schema_type": "regex", "schema": regex, "trigger_token_ids": trig,
                                        "bound_token_id": f[1]}),
        # a trigger that never appears: free text to max_tokens, unconstrained
        SamplingParams(**base, ignore_eos=True,
                       so_args={"schema_type": "regex", "schema": regex, "trigger_token_ids": [5, 6]}),
        # the grammar's end stops the request even with ignore_eos; n = 2 completions each constrained
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=40, ignore_eos=True,
                       so_args={"schema_type": "regex", "schema": regex}),
        # min_tokens holds the stop token back while the grammar can go on (<= 3 digits per token),
        # not once the grammar can only end
        SamplingParams(temperature=1.0, seed=6, max_tokens=40, min_tokens=4,
                       so_args={"schema_type": "regex", "schema": "[0-9]{1,12}"}),
        SamplingParams(temperature=1.0, seed=6, max_tokens=40, min_tokens=6,
                       so_args={"schema_type": "regex", "schema": "[ab]"}),
    ]
    outs = llm.generate(prompt_token_ids=[p] * len(cases), sampling_params=cases, use_tqdm=False)
    natural, bound, never, plain, held, short = (o.outputs for o in outs)
    ids = held[0].token_ids
    assert len(ids) >= 5 and ids[-1] == 1 and held[0].finish_reason == "stop", ids
    check_regex(held[0].text, "[0-9]{1,12}")
    assert len(short[0].token_ids) == 2 and short[0].token_ids[-1] == 1 and short[0].finish_reason == "stop"
    check_regex(short[0].text, "[ab]")
    ids = natural[0].token_ids
    assert ids[:4] == f[:4] and ids[-1] == 1
    check_regex(tok.decode(ids[4:-1]), regex)
    ids = bound[0].token_ids
    assert ids[:2] == f[:2] and ids[2:2 + len(trig)] == trig and ids[-1] == 1
    check_regex(tok.decode(ids[2 + len(trig):-1]), regex)
    never_free = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert never[0].token_ids == never_free[0].outputs[0].token_ids and never[0].finish_reason == "length"
    assert len(plain) == 2 and plain[0].token_ids != plain[1].token_ids
    for c in plain:
        assert c.finish_reason == "stop" and c.token_ids[-1] == 1
        check_regex(c.text, regex)


def test_preemption_and_async_scheduling_keep_the_outputs(tiny_ckpt_dir, llm):
    cases = [(name, so, check) for name, so, check in corpus() if name in
             ("json:point", "json:enum_color", "regex:email", "ebnf:sql_select")]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, so_args=so)
              for i, (_, so, _) in enumerate(cases) for t in (0, 1.0)]
    ps = prompts(len(params), seed=4, length=124)        # the outputs cross the 128-position block
    ref = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    sync = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, async_scheduling=False)
    small = LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, num_cache_blocks=len(params) + 1)
    for other in (sync, small):
        outs = other.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert small.engine.scheduler.num_preemptions > 0
    for (name, _, check), o in zip([c for c in cases for _ in (0, 1)], ref):
        check(o.outputs[0].text)


def test_bad_grammars_and_timeouts_refuse_only_their_request(llm, monkeypatch):
    ok = SamplingParams(temperature=0, max_tokens=40, so_args={"schema_type": "regex", "schema": "[a-c]{3}"})
    bad = [SamplingParams(temperature=0, so_args={"schema_type": "json", "schema": {"type": "foo"}}),
           SamplingParams(temperature=0, so_args={"schema_type": "regex", "schema": "(ab"}),
           SamplingParams(temperature=0, so_args={"schema_type": "ebnf", "schema": "root ::= x"}),
           SamplingParams(temperature=0, so_args={"schema_type": "regex", "schema": "a",
                                                  "trigger_token_ids": [10 ** 6]})]
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(prompt_token_ids=prompts(6, seed=5), sampling_params=[ok, *bad, ok], use_tqdm=False)
    e = err.value
    assert sorted(e.errors) == [1, 2, 3, 4]
    assert "invalid JSON schema" in str(e.errors[1]) and "invalid regex" in str(e.errors[2])
    assert "invalid EBNF grammar" in str(e.errors[3]) and "outside [0, vocab_size" in str(e.errors[4])
    assert e.outputs[1:5] == [None] * 4
    for o in (e.outputs[0], e.outputs[5]):
        check_regex(o.outputs[0].text, "[a-c]{3}")

    # A slow grammar does not hold up the others; one past DEEPINFER_XGRAMMAR_TIMEOUT is refused.
    proc = llm.logits_processors[0]
    real = proc.service._compile

    def slow(grammar, *args):
        if "9" in str(grammar):
            time.sleep(1.5)
        return real(grammar, *args)
    monkeypatch.setattr(proc.service, "_compile", slow)
    slow_ok = SamplingParams(temperature=0, max_tokens=20, so_args={"schema_type": "regex", "schema": "[7-9]{2}"})
    free = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts(2, seed=6), sampling_params=[slow_ok, free], use_tqdm=False)
    slow_m, free_m = outs[0].metrics, outs[1].metrics
    assert free_m.finished_time < slow_m.first_scheduled_time      # done before the grammar was ready
    check_regex(outs[0].outputs[0].text, "[7-9]{2}")
    monkeypatch.setattr(proc, "settings", dataclasses.replace(proc.settings, timeout_s=0.5))
    late = SamplingParams(temperature=0, max_tokens=20, so_args={"schema_type": "regex", "schema": "[8-9]{3}"})
    with pytest.raises(InvalidRequestError, match="did not compile within 0.5 s") as err:
        llm.generate(prompt_token_ids=prompts(2, seed=7), sampling_params=[late, free], use_tqdm=False)
    assert err.value.outputs[0] is None and err.value.outputs[1].outputs[0].finish_reason == "length"
