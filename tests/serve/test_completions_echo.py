"""`/v1/completions` with `echo`: the prompt's logprobs as lm-eval-harness scores a deployment.

Oracle: `LLM.generate(prompt_token_ids, SamplingParams(prompt_logprobs=...))` in this process,
float32. The request shapes are lm-eval's loglikelihood requests (`echo`, `logprobs: 1`,
`temperature: 0`, token-id prompts in a batch, `max_tokens: 1` as lm-eval 0.4 sends, `max_tokens: 0`
as older clients and OpenAI's legacy API take); each (context, continuation) pair's loglikelihood
and is-greedy flag, read from the answer as lm-eval's `LocalCompletionsAPI.parse_logprobs` reads
them, must equal the oracle's prompt logprobs within 1e-4. When `lm_eval` is installed (the `test`
extra), its own client scores the same little task against the server.
"""
from __future__ import annotations

import httpx
import pytest
import sse

from deepinfer_core import LLM, SamplingParams

MODEL = "tiny"
COMMON = {"max_model_len": 256, "dtype": "float32", "simulate_qat": False,
          "num_speculative_tokens": 0}
# a small local task: (context, continuation) pairs, the continuation as lm-eval splits it off
TASK = [("ROMEO.\nBut soft, what light", " through yonder window breaks?"),
        ("KING.\nMy lord,", " the queen is dead."),
        ("HAMLET.\nTo be, or not to be:", " that is the question."),
        ("HAMLET.\nTo be, or not to be:", " the king is here.")]
TOL = 1e-4


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, **COMMON)


@pytest.fixture(scope="module")
def url(model_dir, start_server):
    llm = LLM(model=model_dir, **COMMON)
    url, _ = start_server(llm, 64, MODEL, None)
    return url


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's split: the whole text's tokens, and how many of them are the context's."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    return whole, len(tokenizer.encode(context, add_special_tokens=False))


def oracle(offline: LLM, whole: list[int], ctxlen: int) -> tuple[list[float], bool]:
    """The continuation tokens' logprobs from the offline prompt_logprobs, and whether each is the
    argmax of its position."""
    out = offline.generate(prompt_token_ids=[whole], sampling_params=SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)[0]
    entries = out.prompt_logprobs[ctxlen:]
    lps = [e[t].logprob for e, t in zip(entries, whole[ctxlen:])]
    greedy = all(e[t].rank == 1 for e, t in zip(entries, whole[ctxlen:]))
    return lps, greedy


def parse(choice: dict, ctxlen: int, generated: int) -> tuple[list[float], bool]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs reads: token_logprobs from the context's
    end to the prompt's end, and is-greedy against each position's top_logprobs."""
    end = len(choice["logprobs"]["token_logprobs"]) - generated
    lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
    return lps, all(lp == max(top.values()) for lp, top in zip(lps, tops))


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=120)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_request_shape_equals_prompt_logprobs(url, offline, max_tokens):
    tok = offline.get_tokenizer()
    pairs = [encode_pair(tok, c, x) for c, x in TASK]
    body = {"prompt": [w for w, _ in pairs], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = post(url, body)
    assert r.status_code == 200, r.text
    got = r.json()
    choices = sorted(got["choices"], key=lambda c: c["index"])
    assert len(choices) == len(TASK)
    for choice, (whole, ctxlen) in zip(choices, pairs):
        lp = choice["logprobs"]
        n = len(whole) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(x is not None for x in lp["token_logprobs"][1:])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
        assert choice["text"] == "".join(lp["tokens"])
        assert choice["text"].startswith(tok.decode(whole, skip_special_tokens=False))
        lps, greedy = parse(choice, ctxlen, max_tokens)
        want, want_greedy = oracle(offline, whole, ctxlen)
        assert lps == pytest.approx(want, abs=TOL) and greedy == want_greedy
        assert sum(lps) == pytest.approx(sum(want), abs=TOL)
    assert got["usage"]["prompt_tokens"] == sum(len(w) for w, _ in pairs)
    assert got["usage"]["completion_tokens"] == max_tokens * len(TASK)
    if max_tokens == 0:
        assert all(c["finish_reason"] == "length" for c in choices)


def test_text_prompt_echo_without_generation(url, offline):
    prompt = "".join(TASK[0])
    got = post(url, {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0}).json()
    choice = got["choices"][0]
    ids = offline.get_tokenizer().encode(prompt)
    want = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                            "total_tokens": len(ids), "prompt_tokens_details": {"cached_tokens": 0}}
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [e[t].logprob for e, t in zip(want[1:], ids[1:])], abs=TOL)
    assert all(len(top) >= 2 for top in choice["logprobs"]["top_logprobs"][1:])


def test_echo_prepends_the_prompt_to_the_completion(url, offline):
    prompt = TASK[1][0]
    want = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1,
                                                     prompt_logprobs=1), use_tqdm=False)[0]
    plain = post(url, {"prompt": prompt, "echo": True, "max_tokens": 6, "temperature": 0}).json()
    assert plain["choices"][0]["text"] == prompt + want.outputs[0].text
    assert plain["choices"][0]["logprobs"] is None
    full = post(url, {"prompt": prompt, "echo": True, "max_tokens": 6, "temperature": 0,
                      "logprobs": 1}).json()["choices"][0]["logprobs"]
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    entries = want.prompt_logprobs[1:] + want.outputs[0].logprobs
    want_lps = [e[t].logprob for e, t in zip(entries, ids[1:])]
    assert full["token_logprobs"][1:] == pytest.approx(want_lps, abs=TOL)


def stream_events(url: str, body: dict) -> list[dict]:
    return sse.events(url, "completions", body, MODEL)


@pytest.mark.parametrize("max_tokens", [5, 0])
def test_streamed_echo_joins_to_the_unstreamed_answer(url, max_tokens):
    body = {"prompt": TASK[2][0], "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0}
    whole = post(url, body).json()["choices"][0]
    events = stream_events(url, body)
    assert events[0]["choices"][0]["text"].startswith(TASK[2][0])
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        joined = [x for e in events for x in e["choices"][0]["logprobs"][key]]
        assert joined == whole["logprobs"][key]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    if max_tokens == 0:
        assert len(events) == 1 and whole["text"] == TASK[2][0]


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt": "x", "echo": "maybe"}, "echo"),
])
def test_bad_echo_requests_are_400s_naming_the_field(url, body, field):
    r = post(url, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_lm_eval_local_completions_client(url, offline, model_dir):
    """lm-eval-harness's own client (`lm_eval --model local-completions`), token-id requests in
    batches of two, scoring the task's pairs: its loglikelihoods equal the offline prompt
    logprobs."""
    api = pytest.importorskip("lm_eval.models.openai_completions",
                              reason="lm_eval is not installed (the test extra: build.sh --test)")
    from lm_eval.api.instance import Instance
    lm = api.LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL,
                                 tokenizer=model_dir, tokenizer_backend="huggingface",
                                 max_length=256, batch_size=2)
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(TASK)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    tok = offline.get_tokenizer()
    for (ll, greedy), (context, continuation) in zip(got, TASK):
        lps, want_greedy = oracle(offline, *encode_pair(tok, context, continuation))
        assert ll == pytest.approx(sum(lps), abs=TOL) and greedy == want_greedy
