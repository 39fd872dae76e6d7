"""DSpark drafting through the engine (the drafter comes from the deepinfer-dspark
feature plugin's `deepinfer_proposer`) on a tiny random DSpark checkpoint (official format,
V4-Flash-0731 names), float32, batch-invariant ops on the CPU:

- every draft the engine proposes equals what a fresh drafter proposes after one prefill of the
  committed tokens (so the keys injected from prefill chunks and verify rows, and the rejected rows
  they overwrite, leave exactly the context a from-scratch run has);
- greedy outputs equal non-speculative ones (DSpark at its default gamma = dspark_block_size, with
  and without VARLEN on its confidence head); seeded samples do not depend on the batch;
- confidences are probabilities, and the temperature list is checked against gamma;
- without the plugin the checkpoint is served without speculation, and asking for drafts is an error.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from deepinfer_dspark.drafter import DSparkDrafter, parse_temperatures
from test_dspark_checkpoint import DSPARK  # noqa: E402
from test_varlen import table  # noqa: E402

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.model.forward_batch import ForwardBatch
from deepinfer_core.speculative.varlen import VarlenPolicy
from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint

OPTIONS = dict(dtype="float32", device="cpu", batch_invariant=True, max_model_len=128)
TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
PROMPTS = [[0] + [1000 + 37 * i + 11 * j for j in range(6 + 5 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dspark_drafting"), DSPARK, seed=5)


@pytest.fixture(scope="module")
def reference(dspark_dir):
    llm = LLM(model=str(dspark_dir), num_speculative_tokens=0, **OPTIONS)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def dspark_llm(dspark_dir, monkeypatch_module):
    monkeypatch_module.delenv("DEEPINFER_USE_NEXTN_DECODE")          # the default: the block size
    return LLM(model=str(dspark_dir), **OPTIONS)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_greedy_outputs_equal_non_speculative_ones(dspark_llm, reference):
    assert dspark_llm.runner.num_drafts == DSPARK["dspark_block_size"]
    assert isinstance(dspark_llm.engine.executor.speculator.proposer, DSparkDrafter)
    outs = dspark_llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = dspark_llm.engine.spec_metrics
    assert m.num_steps > 0 and m.num_drafted_tokens > 0


def test_every_draft_is_what_a_fresh_drafter_proposes(dspark_llm, reference):
    spec = dspark_llm.engine.executor.speculator
    drafter, runner = spec.proposer, dspark_llm.runner
    calls = []
    propose = drafter.propose

    def spy(anchors, anchor_positions, states, params, seeds):
        out = propose(anchors, anchor_positions, states, params, seeds)
        calls.append((anchors.tolist(), list(anchor_positions), out.ids.tolist()))
        return out
    drafter.propose = spy
    try:
        prompt = PROMPTS[3]
        out = dspark_llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    finally:
        del drafter.propose
    tokens = prompt + out[0].outputs[0].token_ids
    assert len(calls) >= 3
    fresh = DSparkDrafter(runner.model, drafter.num_drafts)
    for anchors, positions, drafts in calls:
        (a,), (n,), (got,) = anchors, positions, drafts
        assert tokens[n] == a
        st = runner.new_sequence()
        try:
            st.reserve(n + drafter.num_drafts)
            fb = ForwardBatch.build([tokens[:n]], [st], runner.device, all_logits=True)
            fresh.observe(fb, runner.model(fb))
            fb.commit()
            want = fresh.propose(torch.tensor([a]), [n], [st], [GREEDY], [0])
        finally:
            runner.release(st)
        assert want.ids.tolist()[0] == got
        c = want.confidence
        assert c.shape == (1, drafter.num_drafts) and bool(((c >= 0) & (c <= 1)).all())


def test_varlen_on_the_confidence_head_is_lossless(dspark_llm, reference):
    k = dspark_llm.runner.num_drafts
    dspark_llm.engine.use_varlen(VarlenPolicy(table(1.0, 0.01, buckets=(1, 2, 4, 8), rows=k + 1), max_drafts=k))
    try:
        outs = dspark_llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        chosen = dspark_llm.engine.varlen.chosen
    finally:
        dspark_llm.engine.use_varlen(None)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(chosen) > 0


def test_seeded_samples_do_not_depend_on_the_batch(dspark_llm):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=40 + i)
              for i in range(len(PROMPTS))]
    batched = dspark_llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    alone = [dspark_llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0]
             for p, sp in zip(PROMPTS[:2], params[:2])]
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in batched[:2]]
    again = dspark_llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=[dataclasses.replace(p) for p in params[:2]],
                                use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in batched[:2]]


def test_temperature_lists_are_checked_against_gamma(dspark_dir, monkeypatch):
    assert parse_temperatures((2.0,), 3) == [2.0] * 3
    assert parse_temperatures((1.0, 0.0, 3.0), 3) == [1.0, 1e-5, 3.0]
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "1.0,2.0")
    with pytest.raises(ValueError, match="DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE has 2 values; allowed: 1 or 3"):
        LLM(model=str(dspark_dir), num_speculative_tokens=3, **OPTIONS)


def test_without_the_plugin_no_drafts(dspark_dir, monkeypatch, caplog):
    from deepinfer_core.plugins import get_plugin_manager
    monkeypatch.setenv("DEEPINFER_DISABLE_PLUGINS", "dspark")
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    get_plugin_manager(refresh=True)
    try:
        with caplog.at_level(logging.INFO, logger="deepinfer_core.runner.model_runner"):
            llm = LLM(model=str(dspark_dir), **OPTIONS)
        assert llm.runner.num_drafts == 0 and "deepinfer-dspark feature plugin is not loaded" in caplog.text
        with pytest.raises(ValueError, match="num_speculative_tokens=2 .*DEEPINFER_USE_NEXTN_DECODE.* deepinfer-dspark"):
            LLM(model=str(dspark_dir), num_speculative_tokens=2, **OPTIONS)
    finally:
        monkeypatch.delenv("DEEPINFER_DISABLE_PLUGINS")
        get_plugin_manager(refresh=True)
