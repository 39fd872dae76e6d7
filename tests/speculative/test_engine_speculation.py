"""MTP speculative decoding through the engine (`LLM.generate`) on the bundled trained model,
float32 on the CPU with batch-invariant ops:

- lossless: greedy outputs with MTP-1 and MTP-3 equal non-speculative ones token for token; seeded
  sampled outputs equal the reference loop's (whose distribution `benchmarks/spec_distribution.py`
  checks) and do not depend on the batch;
- with preemption, chunked prefill, a short token budget, logprobs (from the verify rows), penalties
  and grammars (verify rows penalised after their drafts, grammar-masked through them), requests that
  do not draft (min_tokens until they are out) and ones that stop early (stop strings, max_tokens):
  still token-identical; sampled requests with a grammar or penalties draft and keep the grammar;
- the metrics (per request and per engine), the default gamma and the errors that name the variable.
"""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest
from spec_cases import GREEDY, OPTIONS, TOKENS  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine_config import EngineConfig  # noqa: E402
from deepinfer_core.runner.model_runner import ModelRunner, resolve_num_drafts  # noqa: E402
from deepinfer_core.speculative.reference_loop import speculative_generate  # noqa: E402

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=TOKENS, ignore_eos=True)
ENGLISH = r"[A-Za-z ,.;:'!?\n]{8,80}"       # a grammar the trained model's own text mostly keeps


@pytest.fixture(scope="module", params=[1, 3])
def spec_llm(request, trained_dir):
    return LLM(model=trained_dir, num_speculative_tokens=request.param, **OPTIONS)


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_greedy_outputs_equal_non_speculative_ones(spec_llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    outs = spec_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert tokens(outs) == reference
    k = spec_llm.runner.num_drafts
    per_request = [o.metrics.spec for o in outs]
    assert all(m is not None and m.num_steps > 0 for m in per_request)
    assert all(len(m.accepted_per_position) == k for m in per_request)
    assert all(m.num_verified_tokens <= m.num_drafted_tokens for m in per_request)
    # every output token after the prefill's came from a verify step (accepted drafts + one each), but
    # the last when a single token was left (nothing to draft for)
    assert all(TOKENS - 2 <= m.num_accepted_tokens + m.num_steps <= TOKENS - 1 for m in per_request)
    total = spec_llm.engine.spec_metrics
    assert total.acceptance_length > 1.3     # the trained MTP block drafts acceptable tokens
    assert total.num_steps >= sum(m.num_steps for m in per_request)


@pytest.mark.parametrize("spec_llm", [3], indirect=True)      # MTP-3 only: k = 1 adds CI minutes, no path
def test_seeded_samples_equal_the_reference_loop_and_ignore_the_batch(spec_llm, prompts_and_reference):
    prompts, _ = prompts_and_reference
    prompts = prompts[:6]
    seeds = [100 + i for i in range(len(prompts))]
    params = [dataclasses.replace(SAMPLED, seed=s) if i % 2 else GREEDY for i, s in enumerate(seeds)]
    batched = tokens(spec_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    k = spec_llm.runner.num_drafts
    loop = speculative_generate(spec_llm.runner, prompts, params, k, seeds=seeds).token_ids
    # The loop verifies k drafts at every step; the engine none past max_tokens, so its last k tokens
    # may be drawn at other steps (with other uniforms) than the loop's
    assert [t[:-k] for t in batched] == [t[:-k] for t in loop]
    assert batched[0::2] == loop[0::2]                           # greedy: all of them
    alone = [tokens(spec_llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False))[0]
             for p, sp in zip(prompts[1::2], params[1::2])]
    assert alone == batched[1::2]


@pytest.mark.parametrize("spec_llm", [3], indirect=True)
def test_sampled_requests_with_grammars_and_penalties_draft_and_keep_the_grammar(spec_llm, prompts_and_reference):
    """Their emitted tokens pass through the grammar matcher (which refuses a token its mask forbids),
    so every accepted draft and every correction kept the grammar; the texts match it too."""
    prompts, _ = prompts_and_reference
    grammar = {"schema_type": "regex", "schema": ENGLISH}
    params = [dataclasses.replace(SAMPLED, seed=3 + i, ignore_eos=False, so_args=grammar) for i in range(3)]
    params += [dataclasses.replace(SAMPLED, seed=9, presence_penalty=0.5, repetition_penalty=1.2),
               dataclasses.replace(SAMPLED, seed=10, so_args=grammar, frequency_penalty=0.5, ignore_eos=False)]
    outs = spec_llm.generate(prompt_token_ids=prompts[:len(params)], sampling_params=params, use_tqdm=False)
    for o, sp in zip(outs, params):
        if sp.so_args is not None:
            assert re.fullmatch(ENGLISH, o.outputs[0].text) or (
                o.outputs[0].finish_reason == "length" and re.fullmatch(ENGLISH[:-6] + "*", o.outputs[0].text))
    assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("spec_llm", [3], indirect=True)
def test_triggered_and_bound_grammars_with_drafts(spec_llm, reference_llm, prompts_and_reference):
    """Grammars that start mid-output (a trigger the model emits on its own; a bound token that forces
    the trigger): drafts cross the free / forcing / grammar phases inside one verify chunk, and the
    matcher is rolled back across them; the greedy tokens equal the non-speculative engine's."""
    prompts, reference = prompts_and_reference
    f = reference[0]
    grammar = {"schema_type": "regex", "schema": ENGLISH}
    params = [SamplingParams(temperature=0.0, max_tokens=TOKENS, so_args={**grammar, "trigger_token_ids": f[4:6]}),
              SamplingParams(temperature=0.0, max_tokens=TOKENS,
                             so_args={**grammar, "trigger_token_ids": f[9:11], "bound_token_id": f[2]})]
    want = reference_llm.generate(prompt_token_ids=[prompts[0]] * 2, sampling_params=params, use_tqdm=False)
    outs = spec_llm.generate(prompt_token_ids=[prompts[0]] * 2, sampling_params=params, use_tqdm=False)
    assert tokens(outs) == tokens(want)
    assert tokens(want)[0][:6] == f[:6] and tokens(want)[1][3:5] == f[9:11]      # the phases did happen
    assert all(o.metrics.spec.num_accepted_tokens > 0 for o in outs)


@pytest.mark.parametrize("drafter, model_fixture, gamma", [("MTP-3", "trained_dir", 3),
                                                            ("DSpark-5", "dspark_trained_dir", 5)])
def test_preemption_chunking_grammars_penalties_and_early_stops(drafter, model_fixture, gamma, request, reference_llm,
                                                            prompts_and_reference):
    """A cache too small for every request (preemption), a 24-token budget (chunked prefill; verify
    chunks cut short), and requests with logprobs, penalties, a grammar, min_tokens, a stop string,
    n=2 and a short max_tokens: the same tokens, text and logprobs as the roomy non-speculative engine,
    with the MTP block and with the trained DSpark drafter (the same target)."""
    model = request.getfixturevalue(model_fixture)
    prompts, _ = prompts_and_reference
    params = [GREEDY,
              SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=TOKENS, so_args={"schema_type": "regex", "schema": ENGLISH}),
              SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, stop=[" the"]),
              SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, n=2),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              GREEDY, GREEDY]
    prompts = prompts[:len(params)]
    for i in (0, 6, 8):          # ~110-token prompts: their outputs cross into a second cache block
        prompts[i] = (prompts[i] * 20)[:110]
    reference = reference_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tight = LLM(model=model, num_speculative_tokens=gamma, num_cache_blocks=4, max_num_seqs=4,
                max_num_batched_tokens=24, **OPTIONS)
    outs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == tokens(reference)
    assert [c.text for o in outs for c in o.outputs] == [c.text for o in reference for c in o.outputs]
    # logprobs of drafted tokens come from the verify rows: the same values as the decode steps'
    assert outs[1].outputs[0].logprobs == reference[1].outputs[0].logprobs
    assert outs[1].metrics.spec is not None and outs[1].metrics.spec.num_accepted_tokens > 0
    assert all(o.metrics.spec.num_accepted_tokens > 0 for o in outs[2:4])   # penalties, grammar: drafted
    assert outs[4].metrics.spec is not None                                  # after its min_tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_post_processes_a_step_after_launching_the_next(async_scheduling, trained_dir,
                                                                        prompts_and_reference, monkeypatch):
    """Async: step N is verified and drafted (its verdict read), step N+1 launched (its drafts named by
    their device codes, the host not waiting for the drafter), and only then step N post-processed;
    off: each step is post-processed before the next is planned. Same tokens."""
    prompts, reference = prompts_and_reference
    llm = LLM(model=trained_dir, num_speculative_tokens=2, async_scheduling=async_scheduling, **OPTIONS)
    engine, order = llm.engine, []             # (what, the step object): held, so no id is reused

    def traced(name, fn):
        def run(step, *args):
            order.append((name, step))
            return fn(step, *args)
        return run
    launch = engine.executor.launch
    monkeypatch.setattr(engine.executor, "launch", lambda *a, **kw: order.append(("launch", r := launch(*a, **kw))) or r)
    monkeypatch.setattr(engine.executor, "speculate", traced("speculate", engine.executor.speculate))
    monkeypatch.setattr(engine, "_process", traced("process", engine._process))
    host_drafts = engine._host_drafts
    lazy = []        # verify steps launched with the drafts' device codes, before the host had them
    monkeypatch.setattr(engine, "_host_drafts", lambda seq: lazy.append(seq.draft_source) or host_drafts(seq))
    outs = llm.generate(prompt_token_ids=prompts[:4], sampling_params=GREEDY, use_tqdm=False)
    assert tokens(outs) == reference[:4]
    steps = [s for name, s in order if name == "launch"]
    assert len(steps) > 8 and engine.spec_metrics.num_accepted_tokens > 0
    assert len(lazy) > 8 and all(source is not None for source in lazy)

    def at(name, step):
        return next(i for i, (n, s) in enumerate(order) if n == name and s is step)
    for step, after in zip(steps, steps[1:]):
        assert at("launch", step) < at("speculate", step) < at("process", step)
        if async_scheduling:     # the next step is launched between its verdict and its post-processing
            assert at("speculate", step) < at("launch", after) < at("process", step)
        else:
            assert at("process", step) < at("launch", after)


def test_online_aborts_and_late_requests_with_a_step_in_flight(trained_dir, prompts_and_reference):
    """Online, pipelined: an abort while a verify step is in flight (its tokens are dropped, its slot and
    blocks free at once), a request that stops on a token while already planned into the next step, and
    a request added meanwhile leave the outputs as the reference's."""
    prompts, reference = prompts_and_reference
    engine = LLM(model=trained_dir, num_speculative_tokens=2, async_scheduling=True, **OPTIONS).engine
    engine.add_request("keep", prompts[0], GREEDY.clone())
    stop = reference[3][6]
    engine.add_request("stops", prompts[3], dataclasses.replace(GREEDY, stop_token_ids=[stop]))
    engine.add_request("drop", prompts[1], dataclasses.replace(GREEDY, max_tokens=4 * TOKENS))
    got: dict[str, list[int]] = {}

    def collect(outs) -> None:
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    for _ in range(6):
        collect(engine.step())
    assert engine._in_flight is not None and engine._in_flight.spec_inputs is not None
    got.pop("drop", None)
    used = engine.scheduler.blocks.allocator.num_used_slots
    engine.abort_request("drop")
    assert engine.scheduler.blocks.allocator.num_used_slots == used - 1
    engine.add_request("late", prompts[2], GREEDY.clone())
    while engine.has_unfinished_requests():
        collect(engine.step())
    stopped = reference[3][:reference[3].index(stop) + 1]
    assert "drop" not in got and got == {"keep": reference[0], "late": reference[2], "stops": stopped}
    assert engine.num_dropped_tokens > 0
    assert engine.scheduler.blocks.allocator.reclaim() and engine.spec_metrics.num_accepted_tokens > 0


def test_default_gamma_follows_ds_deepinfer_and_the_checkpoint(trained_dir, tiny_ckpt_dir, monkeypatch, caplog):
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")
    config = EngineConfig.from_options()
    assert config.speculative.num_speculative_tokens is None and config.cache.max_backtracking_tokens == 6
    assert ModelRunner(trained_dir, dtype="float32", device="cpu").num_drafts == 5
    with caplog.at_level(logging.INFO, logger="deepinfer_core.runner.model_runner"):
        assert resolve_num_drafts(None, num_mtp_blocks=0) == 0
    assert caplog.text.count("no drafter tensors") == 1
    assert resolve_num_drafts(0, num_mtp_blocks=0) == 0 and resolve_num_drafts(2, num_mtp_blocks=1) == 2
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    config = EngineConfig.from_options()
    assert config.speculative.num_speculative_tokens == 2 and config.cache.max_backtracking_tokens == 3


def test_bad_speculative_settings_name_the_variable():
    with pytest.raises(ValueError, match="num_speculative_tokens=1 .*DEEPINFER_USE_NEXTN_DECODE.* no drafter"):
        resolve_num_drafts(1, num_mtp_blocks=0)
    with pytest.raises(ValueError, match="max_backtracking_tokens >= 6 .*DEEPINFER_MAX_BACKTRACKING_TOKENS"):
        EngineConfig.from_options(num_speculative_tokens=5, max_backtracking_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens=-1; allowed: an int >= 0"):
        EngineConfig.from_options(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="enable_mtp_varlen='yes'; allowed: True, False, None"):
        EngineConfig.from_options(enable_mtp_varlen="yes")
    with pytest.raises(ValueError, match="enable_mtp_varlen=True .* batch_invariant=True"):
        EngineConfig.from_options(enable_mtp_varlen=True, batch_invariant=True)
