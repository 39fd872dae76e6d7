"""The long-lived online engine: requests added while others run, aborts that free everything at
once, step() deltas that concatenate to the whole output, and bad input refused without touching
what is in flight. Runs the tiny checkpoint on the CPU (float32, QAT off), async on and off."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams


@pytest.fixture(scope="module")
def base(tiny_ckpt_dir):
    return LLM(model=str(tiny_ckpt_dir), dtype="float32", simulate_qat=False, max_model_len=512)


def fresh(base: LLM, **opts) -> LLM:
    return LLM.from_runner(base.runner, tokenizer=base.tokenizer, max_model_len=base.max_model_len, **opts)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (5 + 7 * i,), generator=g).tolist() for i in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def drain(engine, outputs: dict | None = None) -> dict:
    """Step until nothing is left; the concatenated deltas (token ids, text) per request."""
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, text, done = outputs.get(out.request_id, ([], "", False))
            c = out.outputs[0]
            outputs[out.request_id] = (ids + c.token_ids, text + c.text, out.finished)
    return outputs


def assert_clean(engine) -> None:
    assert engine.scheduler.blocks.allocator.reclaim(), "slots or blocks leaked"
    assert not engine.has_unfinished_requests() and not engine.scheduler.running


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_deltas_concatenate_to_the_whole_output(base, async_scheduling):
    llm = fresh(base, async_scheduling=async_scheduling)
    ps = prompts(3, seed=1)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)
    whole = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    engine = llm.engine
    for i, p in enumerate(ps):
        engine.add_request(f"s{i}", p, params.clone())
    seen_partial = False
    outputs: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen_partial = seen_partial or not out.finished
            ids, text, _ = outputs.get(out.request_id, ([], "", False))
            outputs[out.request_id] = (ids + out.outputs[0].token_ids, text + out.outputs[0].text, out.finished)
    assert seen_partial, "a streamed request reported only once"
    for i, w in enumerate(whole):
        ids, text, finished = outputs[f"s{i}"]
        assert finished and ids == w.outputs[0].token_ids and text == w.outputs[0].text
    assert_clean(engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_added_while_others_run(base, async_scheduling):
    """A request that joins mid-run gets the same tokens as alone (greedy), and so do the others."""
    llm = fresh(base, async_scheduling=async_scheduling)
    ps = prompts(4, seed=2)
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
             for p in ps]
    engine = llm.engine
    engine.add_request("a0", ps[0], GREEDY.clone())
    engine.add_request("a1", ps[1], GREEDY.clone())
    outputs: dict = {}
    for _ in range(4):                      # the first two are decoding when the others arrive
        for out in engine.step():
            ids, text, _ = outputs.get(out.request_id, ([], "", False))
            outputs[out.request_id] = (ids + out.outputs[0].token_ids, text, out.finished)
    assert engine.scheduler.running
    engine.add_request("a2", ps[2], GREEDY.clone())
    engine.add_request("a3", ps[3], GREEDY.clone())
    drain(engine, outputs)
    assert [outputs[f"a{i}"][0] for i in range(4)] == alone
    assert_clean(engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_mid_generation_frees_everything_at_once(base, async_scheduling):
    llm = fresh(base, async_scheduling=async_scheduling)
    engine = llm.engine
    ps = prompts(3, seed=3)
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=2)
    engine.add_request("keep", ps[0], GREEDY.clone())
    engine.add_request("drop", ps[1], long)
    outputs: dict = {}
    for _ in range(3):
        for out in engine.step():
            ids, text, _ = outputs.get(out.request_id, ([], "", False))
            outputs[out.request_id] = (ids + out.outputs[0].token_ids, text, out.finished)
    outputs.pop("drop", None)
    alloc = engine.scheduler.blocks.allocator
    used_before = alloc.num_used_slots
    engine.abort_request("drop")
    assert alloc.num_used_slots == used_before - 2, "the aborted request's two slots are not free"
    drain(engine, outputs)
    assert "drop" not in outputs                # no output after an abort
    assert outputs["keep"][2] and len(outputs["keep"][0]) == GREEDY.max_tokens
    assert_clean(engine)
    want = llm.generate(prompt_token_ids=[ps[0]], sampling_params=GREEDY, use_tqdm=False)[0]
    assert outputs["keep"][0] == want.outputs[0].token_ids


def test_bad_input_through_the_online_interface(base):
    """Each is a ValueError naming the problem; the request in flight finishes as if alone."""
    llm = fresh(base)
    engine = llm.engine
    ps = prompts(2, seed=4)
    engine.add_request("r", ps[0], GREEDY.clone())
    engine.step()
    with pytest.raises(ValueError, match="request_id 'r' is already in the engine"):
        engine.add_request("r", ps[1], GREEDY.clone())
    with pytest.raises(ValueError, match="no request 'nope'"):
        engine.abort_request("nope")
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        engine.add_request("x", ps[1], {"temperature": 0.0})
    with pytest.raises(ValueError, match="request_id must be a non-empty str"):
        engine.add_request(7, ps[1], GREEDY.clone())
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of int"):
        engine.add_request("y", "hello", GREEDY.clone())
    for bad, where in [([1, 129280], "129280 at position 1"), ([5, 6, -1], "-1 at position 2"),
                       ([1, True], "True at position 1"), ([2.0, 3], "2.0 at position 0")]:
        with pytest.raises(ValueError, match=f"token id {where} of the prompt is outside"):
            engine.add_request("z", bad, GREEDY.clone())
    outputs = drain(engine)
    assert set(outputs) == {"r"}
    want = llm.generate(prompt_token_ids=[ps[0]], sampling_params=GREEDY, use_tqdm=False)[0]
    assert outputs["r"][0] == want.outputs[0].token_ids
    assert_clean(engine)
