"""MTP speculative decoding on the nvidia backend (bf16, batch-invariant ops) through `LLM.generate`:
with CUDA graphs (the target's verify steps and the drafter's observe / draft steps replay graphs)
greedy outputs equal non-speculative ones bit for bit, and the drafts equal the eager drafter's (the
same acceptance counts per request), for MTP-1 and MTP-3. Run on a GPU machine:
`python -m pytest -q -m gpu tests/gpu`."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.tools.trained_model import ARTIFACT, make_trained_checkpoint

pytestmark = pytest.mark.gpu      # deselected in CI; on a machine without CUDA these fail, not skip
HELDOUT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "heldout_prompts.json"
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return str(make_trained_checkpoint(tmp_path_factory.mktemp("trained") / "ckpt", ARTIFACT))


def _llm(ckpt, k: int, eager: bool) -> LLM:
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    gc.collect()
    torch.cuda.empty_cache()
    return LLM(model=ckpt, dtype="bfloat16", device="cuda", batch_invariant=True, num_speculative_tokens=k,
               enforce_eager=eager, max_model_len=512, kv_cache_memory_bytes=1 << 30)


def _prompts(llm: LLM, n: int = 16) -> list[list[int]]:
    return [llm.tokenizer.encode(t) for t in json.loads(HELDOUT.read_text())["prompts"][:n]]


def _run(ckpt, k: int, eager: bool, keep: list | None = None):
    llm = _llm(ckpt, k, eager)
    outs = llm.generate(prompt_token_ids=_prompts(llm), sampling_params=GREEDY, use_tqdm=False)
    graphed = llm.runner.graphs is not None
    if keep is not None:
        keep.append(llm)
    return [o.outputs[0].token_ids for o in outs], [o.metrics.spec for o in outs], graphed


@pytest.mark.parametrize("k", [1, 3])
def test_graphed_speculation_is_lossless_and_drafts_as_eager(trained, k):
    reference, _, _ = _run(trained, 0, eager=False)
    graphed, graphed_metrics, has_graphs = _run(trained, k, eager=False)
    eager, eager_metrics, _ = _run(trained, k, eager=True)
    assert has_graphs
    assert graphed == reference and eager == reference
    assert [(m.num_steps, m.num_accepted_tokens) for m in graphed_metrics] == \
        [(m.num_steps, m.num_accepted_tokens) for m in eager_metrics]


@pytest.fixture(scope="module")
def trained_dspark(tmp_path_factory):
    from deepinfer_core.tools.trained_model import DSPARK_ARTIFACT
    return str(make_trained_checkpoint(tmp_path_factory.mktemp("trained") / "dspark", ARTIFACT,
                                       drafter=DSPARK_ARTIFACT))


def test_graphed_dspark_is_lossless_and_drafts_as_eager(trained, trained_dspark, monkeypatch):
    """The DSpark variant: verify steps replay the decode graphs, which return the target features the
    drafter injects, and the greedy drafts replay the drafter's own graphs; outputs equal the
    non-speculative ones bit for bit and the drafts the eager run's."""
    from deepinfer_core.runner import model_runner
    replays = []
    real = model_runner.DecodeGraphs.replay_output

    def counting(self, *a, **kw):
        out = real(self, *a, **kw)
        replays.append(out is not None and out.features is not None)
        return out

    reference, _, _ = _run(trained, 0, eager=False)
    monkeypatch.setattr(model_runner.DecodeGraphs, "replay_output", counting)
    kept = []
    graphed, graphed_metrics, has_graphs = _run(trained_dspark, 5, eager=False, keep=kept)
    eager, eager_metrics, _ = _run(trained_dspark, 5, eager=True)
    assert has_graphs and replays and all(replays)
    draft_graphs = kept[0].engine.executor.speculator.proposer.graphs
    assert draft_graphs.failed is None and any(g is not None for g, _ in draft_graphs.graphs.values())
    assert graphed == reference and eager == reference
    assert [(m.num_steps, m.num_accepted_tokens) for m in graphed_metrics] == \
        [(m.num_steps, m.num_accepted_tokens) for m in eager_metrics]


def test_grammar_and_penalised_requests_draft_losslessly(trained):
    """Verify rows masked through the drafts (pinned bitmask copies) and penalised after them, on CUDA
    with graphs: the same tokens as the non-speculative engine, and those requests accepted drafts."""
    grammar = {"schema_type": "regex", "schema": r"[A-Za-z ,.;:'!?\n]{8,120}"}
    params = [SamplingParams(temperature=0.0, max_tokens=48, so_args=grammar),
              SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=48, so_args=grammar, presence_penalty=0.4), GREEDY]
    results = []
    for k in (0, 3):
        llm = _llm(trained, k, eager=False)
        prompts = _prompts(llm, 8)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=(params * 2)[:len(prompts)], use_tqdm=False)
        results.append(outs)
    reference, spec = results
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in reference]
    assert all(o.metrics.spec.num_accepted_tokens > 0 for o in spec[:3])


@pytest.mark.parametrize("drafter", ["MTP-3", "DSpark-5"])
def test_graphed_sampled_drafts_equal_eager_ones(drafter, trained, trained_dspark, monkeypatch):
    """Seeded sampled requests (T=1 with top-p, and T=0.7): drafts drawn after the drafter's graph
    replays (MTP: between its step graphs; DSpark: after its block-forward graph) are the eager
    drafter's, so the tokens and acceptance counts equal an eager run's."""
    from deepinfer_core.speculative.mtp_graphs import MTPGraphs
    replays = []
    real = MTPGraphs.draft_step
    monkeypatch.setattr(MTPGraphs, "draft_step", lambda self, *a: replays.append(1) or real(self, *a))
    ckpt, k = (trained, 3) if drafter == "MTP-3" else (trained_dspark, 5)
    params = [SamplingParams(temperature=1.0 if s % 2 else 0.7, top_p=0.9 if s % 2 else 1.0, max_tokens=48,
                             ignore_eos=True, seed=s) for s in range(16)]
    results, kept = [], []
    for eager in (False, True):
        llm = _llm(ckpt, k, eager)
        kept.append(llm)
        outs = llm.generate(prompt_token_ids=_prompts(llm), sampling_params=params, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs],
                        [(o.metrics.spec.num_steps, o.metrics.spec.num_accepted_tokens) for o in outs]))
    if drafter == "MTP-3":
        assert replays
    else:
        graphs = kept[0].engine.executor.speculator.proposer.graphs
        assert any(kind == "block" and g is not None for (_, kind), (g, _) in graphs.graphs.items())
    assert results[0] == results[1]
