"""The trained tiny DSpark drafter (tools/train_tiny/dspark.py, shipped beside the bundled model) through
the engine, float32 on the CPU: greedy outputs equal the non-speculative ones, and a verify step
commits at least 2 tokens on average, which MTP-1 (one draft: tau <= 2) can never exceed. Its
calibration (deepinfer_dspark.calibrate) runs end to end, and the temperatures a checkpoint stores are
the default that DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE overrides."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from deepinfer_dspark.calibrate import calibrate, write_config
from spec_cases import GREEDY, OPTIONS, PROMPTS  # noqa: E402

from deepinfer_core import LLM
from deepinfer_core.tools.trained_model import DSPARK_ARTIFACT, read_drafter


@pytest.fixture(scope="module")
def dspark_llm(dspark_trained_dir, monkeypatch_module):
    monkeypatch_module.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)     # the default: the block size
    return LLM(model=dspark_trained_dir, **OPTIONS)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_greedy_outputs_are_lossless_and_commit_more_than_mtp1_can(dspark_llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    assert dspark_llm.runner.num_drafts == 5
    outs = dspark_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    tau = dspark_llm.engine.spec_metrics.acceptance_length
    assert tau > 2.0, tau


@pytest.mark.parametrize("sampling", ["greedy", "seeded T=1"])
def test_padded_static_graph_batches_draft_as_eager(sampling, dspark_llm, prompts_and_reference):
    """The drafter's CUDA-graph paths without a GPU (`capture=False`: the same bucket-padded batches,
    run eagerly, every input from static device buffers; padding rows of observe steps write into a
    slot no sequence owns): the same drafts and confidences, step after step, as the eager drafter
    (greedy: the whole draft in the graph; sampled: the block forward, then draws), and the same
    outputs (greedy: the non-speculative ones)."""
    prompts, reference = prompts_and_reference
    params = GREEDY if sampling == "greedy" else [dataclasses.replace(GREEDY, temperature=1.0, seed=i)
                                                   for i in range(7)]
    drafter = dspark_llm.engine.executor.speculator.proposer
    real = drafter.propose

    def drafts(static: bool):
        record = []

        def spy(anchors, anchor_positions, states, params, seeds):
            out = real(anchors, anchor_positions, states, params, seeds)
            record.append((len(states), out.ids.tolist(), out.confidence.tolist()))
            return out
        if static:
            drafter.use_graphs(max_seqs=8, pad_slot=dspark_llm.runner.cache.num_slots - 1, capture=False)
        drafter.propose = spy
        try:
            outs = dspark_llm.generate(prompt_token_ids=prompts[:7], sampling_params=params, use_tqdm=False)
            graphs = (drafter.graphs, drafter.observe_graphs)
        finally:
            drafter.propose, drafter.graphs, drafter.observe_graphs = real, None, None
            drafter._observe_settings = None
        return [o.outputs[0].token_ids for o in outs], record, graphs

    eager_tokens, eager, _ = drafts(static=False)
    tokens, static, (propose_graphs, observe_graphs) = drafts(static=True)
    assert tokens == eager_tokens
    if sampling == "greedy":
        assert tokens == reference[:7]
    assert [(n, ids) for n, ids, _ in static] == [(n, ids) for n, ids, _ in eager]
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)
               for (_, _, a), (_, _, b) in zip(static, eager))
    assert any(n not in (1, 2, 4, 8) for n, _, _ in static)              # batches padded to a bucket
    kind = "draft" if sampling == "greedy" else "block"
    assert any(k == kind for _, k in propose_graphs.graphs)
    assert any(q > 1 for _, q in observe_graphs.graphs)                  # verify steps observed


def test_the_shipped_drafter_carries_its_calibration(dspark_llm):
    keys, _, report = read_drafter(DSPARK_ARTIFACT)
    temps = keys["dspark_confidence_temperatures"]
    assert len(temps) == 5 and all(t > 0 for t in temps) and report["steps"] > 0
    assert dspark_llm.runner.confidence_temperatures() == tuple(temps)


def test_calibration_runs_end_to_end_and_its_temperatures_become_the_default(dspark_trained_dir, tmp_path,
                                                                              monkeypatch):
    model = shutil.copytree(dspark_trained_dir, tmp_path / "model")
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)          # gamma: the block size
    result = calibrate(str(model), PROMPTS[:6], tokens=12, **OPTIONS)
    assert len(result["temperatures"]) == 5 and all(t > 0 for t in result["temperatures"])
    assert result["fit_verifications"] > 0 and result["check_verifications"] > 0
    write_config(str(model), [0.5, 2.0, 1.0])
    assert json.loads((model / "config.json").read_text())["dspark_confidence_temperatures"] == [0.5, 2.0, 1.0]
    monkeypatch.delenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", raising=False)
    llm = LLM(model=str(model), num_speculative_tokens=2, **OPTIONS)
    assert llm.runner.confidence_temperatures() == (0.5, 2.0)             # the first gamma of them
    with pytest.raises(ValueError, match="dspark_confidence_temperatures has 3 values for 5 drafts"):
        LLM(model=str(model), num_speculative_tokens=5, **OPTIONS)
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "3")
    assert LLM(model=str(model), num_speculative_tokens=5, **OPTIONS).runner.confidence_temperatures() == (3.0,)
