"""The engine's promises on the Ascend backend (the simulated torch_npu of an Ascend 950, alias
mode), through `LLM` as a user runs it, on the tiny model of `model_fixtures.ascend_config` where
every mapped hook serves (SFA and the lightning indexer included), in bf16 with and without the QAT
numerics (the two settings between them serve every mapped op: the MXFP8 linears and MX experts
with QAT, npu_mhc_* without):

* batched = alone: greedy tokens of three prompts in one batch equal each prompt's alone;
* chunked prefill = unchunked: a 16-token step budget (a 150-token prompt in chunks beside the
  other prompts' chunks and decodes) gives the same greedy tokens;
* speculative decoding is lossless: MTP-2 drafts, some accepted and some rejected, give the
  tokens of plain decoding;
* structured outputs: a JSON-schema and a regex request decode to valid output beside an
  unconstrained request, which comes out as without them.

Logprobs are compared to bf16 rounding: torch's bf16 tolerances, what the nvidia backend's CPU-run
tests allow a row computed alone or inside a larger batch (tests/kernels/conftest.py)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from model_fixtures import (
    LI,
    SFA,
    ascend_checkpoint,
    called,
    greedy,
    random_prompts,
    simulated_ascend,
    use_accelerator,
)

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.speculative import mtp

# past the window, 37 CSA rows and the first HCA row (150); below the window (7)
PROMPTS = random_prompts((150, 7, 40), seed=1)
STEPS = 6
OPTS = dict(device="cpu", dtype="bfloat16", num_cache_blocks=16, max_num_seqs=4,
            enforce_eager=True)
QAT = pytest.mark.parametrize("qat", [True, False], ids=["qat", "clean"])
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ann", "bob", "cy"]},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}-[0-9]{2}"


@pytest.fixture(scope="module")
def ascend(tmp_path_factory):
    """(FakeNpu, MonkeyPatch): the simulated Ascend 950 for this module (see model_fixtures); JSON
    gaps hold at most 2 whitespace characters (the random model never stops adding them)."""
    with simulated_ascend(tmp_path_factory.mktemp("ascend_platform")) as (fake, mp):
        mp.setenv("DEEPINFER_SO_JSON_MAX_WHITESPACE", "2")
        use_accelerator(mp, "ascend")
        yield fake, mp


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ascend_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def engines(ckpt, ascend):
    """`engines(qat)`: (the Ascend engine, bf16, QAT on or off, its attention the Ascend
    backend's, eagerly: decode graphs replay what eager runs and have tests of their own; the
    prompts' greedy outputs batched and unchunked, with logprobs), built once per setting."""
    from deepinfer_ascend.attention import AscendAttentionBackend
    built: dict[bool, tuple] = {}

    def get(qat: bool):
        if qat not in built:
            llm = LLM(model=str(ckpt), simulate_qat=qat, num_speculative_tokens=0, **OPTS)
            assert llm.runner.loaded.ctx.platform.name == "ascend"
            assert isinstance(llm.runner.model.layers[0].attn.backend, AscendAttentionBackend)
            built[qat] = llm, greedy(llm, PROMPTS, STEPS, logprobs=1)
        return built[qat]
    return get


def sfa_calls(fake, start: int) -> list[dict]:
    return [args for name, args in fake.calls[start:] if name == SFA]


def chosen_logprobs(out) -> list[float]:
    return [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def assert_same_outputs(got, want) -> None:
    """Greedy tokens identical, their logprobs equal to bf16 rounding."""
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(chosen_logprobs(g), chosen_logprobs(w), **BF16_TOL)


@QAT
def test_batched_equals_alone(engines, ascend, qat):
    fake, _ = ascend
    llm, reference = engines(qat)
    start = len(fake.calls)
    one_at_a_time = LLM.from_runner(llm.runner, tokenizer=llm.tokenizer, max_num_seqs=1)
    alone = [greedy(one_at_a_time, [p], STEPS, logprobs=1)[0] for p in PROMPTS]
    assert {SFA, LI} <= called(fake, start)
    assert max(len(a["actual_seq_lengths_query"]) for a in sfa_calls(fake, start)) == 1
    assert_same_outputs(reference, alone)


@QAT
def test_chunked_prefill_equals_unchunked(engines, ascend, qat):
    fake, _ = ascend
    llm, reference = engines(qat)
    start = len(fake.calls)
    chunked = LLM.from_runner(llm.runner, tokenizer=llm.tokenizer, max_num_seqs=4,
                              max_num_batched_tokens=16)
    got = greedy(chunked, PROMPTS, STEPS, logprobs=1)
    assert {SFA, LI} <= called(fake, start)
    # every SFA batch within the 16-token budget (the long prompt chunked), some of several
    # sequences (chunks beside decodes)
    calls = sfa_calls(fake, start)
    assert max(int(a["actual_seq_lengths_query"][-1]) for a in calls) <= 16
    assert max(len(a["actual_seq_lengths_query"]) for a in calls) > 1
    assert_same_outputs(got, reference)


@QAT
def test_speculative_decoding_is_lossless(engines, ckpt, ascend, qat, monkeypatch):
    """MTP-2 through the Ascend ops (the MTP block drafts, the target verifies 3 tokens per
    sequence in one SFA batch, rejected drafts are rolled back). The random MTP block's drafts are
    never right, so where the plain run's token at a draft's position is known (the prompts'
    output positions do not overlap) and the position is not a multiple of 3, the draft becomes
    that token: steps accept 0, 1 or 2 drafts. Greedy tokens equal plain decoding's."""
    fake, _ = ascend
    _, reference = engines(qat)
    known: dict[int, int] = {}
    for p, out in zip(PROMPTS, reference):
        for pos, tok in enumerate(out.token_ids, start=len(p)):
            assert pos not in known
            known[pos] = tok
    propose = mtp.MTPDrafter.propose

    def oracle(self, logits, streams, states, last_positions, *args, **kwargs):
        drafts = propose(self, logits, streams, states, last_positions, *args, **kwargs)
        ids = drafts.ids.clone()
        for i, last in enumerate(last_positions):
            for j in range(ids.shape[1]):
                pos = last + 2 + j             # the first draft goes to the last row + 2
                if pos in known and pos % 3:
                    ids[i, j] = known[pos]
        drafts.ids = ids
        return drafts

    monkeypatch.setattr(mtp.MTPDrafter, "propose", oracle)
    spec = LLM(model=str(ckpt), simulate_qat=qat, num_speculative_tokens=2, **OPTS)
    start = len(fake.calls)
    got = greedy(spec, PROMPTS, STEPS, logprobs=1)
    assert [g.token_ids for g in got] == [w.token_ids for w in reference]
    m = spec.engine.spec_metrics
    assert 0 < m.num_accepted_tokens < m.num_verified_tokens, m
    # verify steps: 3 query tokens of each sequence in one SFA batch
    assert any(len(a["actual_seq_lengths_query"]) > 1
               and set(torch.diff(a["actual_seq_lengths_query"], prepend=torch.zeros(1)).tolist())
               == {3} for a in sfa_calls(fake, start))
    assert_same_outputs(got, reference)


def test_structured_outputs_follow_their_grammars(engines, ascend):
    """bf16 without QAT (the grammar masks are the core's, over the backend's logits; the QAT
    setting changes nothing there but costs time on the simulated MX ops): a JSON-schema and a
    regex request finish with valid output; the unconstrained request beside them comes out as in
    the plain batch."""
    fake, _ = ascend
    llm, reference = engines(False)
    params = [SamplingParams(temperature=0, max_tokens=40,
                             so_args={"schema_type": "json", "schema": SCHEMA}),
              SamplingParams(temperature=0, max_tokens=30,
                             so_args={"schema_type": "regex", "schema": REGEX}),
              SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)]
    start = len(fake.calls)
    outs = llm.generate(prompt_token_ids=[PROMPTS[2][:20], PROMPTS[0][:30], PROMPTS[1]],
                        sampling_params=params, use_tqdm=False)
    assert {SFA, LI} <= called(fake, start)
    as_json, as_regex, free = (o.outputs[0] for o in outs)
    assert as_json.finish_reason == "stop" and as_regex.finish_reason == "stop"
    jsonschema.validate(json.loads(as_json.text), SCHEMA)
    assert re.fullmatch(REGEX, as_regex.text), as_regex.text
    assert_same_outputs([free], [reference[1]])
