import copy
import time

import pytest
import torch

import deepinfer_core.api.llm as llm_mod
from deepinfer_core.api.llm import InvalidRequestError
from deepinfer_core import LLM, RequestOutput, SamplingParams

S = SamplingParams
GREEDY = dict(temperature=0)


def run(llm, prompts=None, params=None, ids=None):
    return llm.generate(prompts, params, prompt_token_ids=ids, use_tqdm=False)


# ---- greedy, chunked prefill, text --------------------------------------------------------------
def test_greedy_follows_fake_logits(make_llm, fake):
    llm, runner = make_llm(fake.next_word_logits)
    out = run(llm, ids=[[2, 3]], params=S(max_tokens=5, **GREEDY))[0]
    assert isinstance(out, RequestOutput) and out.finished
    c = out.outputs[0]
    assert c.token_ids == [4, 5, 6, 7, 8] and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == "w2 w3 w4 w5 w6" and out.prompt_token_ids == [2, 3] and out.prompt is None
    assert c.logprobs is None and c.cumulative_logprob is None
    assert llm.engine.scheduler.blocks.allocator.reclaim()
    assert runner.calls == [(2, False)] + [(1, False)] * 4   # no forward after the last token


def test_greedy_matches_argmax_of_random_logits(make_llm, fake):
    llm, _ = make_llm(fake.random_logits)
    prompt = [5, 9, 2]
    c = run(llm, ids=[prompt], params=S(max_tokens=8, ignore_eos=True, **GREEDY))[0].outputs[0]
    ctx = list(prompt)
    for t in c.token_ids:
        assert t == int(torch.argmax(fake.random_logits(ctx)))
        ctx.append(t)


def test_chunked_prefill_same_result(make_llm, fake):
    prompt = list(range(2, 22))
    base, _ = make_llm(fake.random_logits)
    chunked, runner = make_llm(fake.random_logits, max_num_batched_tokens=6)
    p = S(max_tokens=6, ignore_eos=True, seed=3)
    assert run(chunked, ids=[prompt], params=p)[0].outputs[0].token_ids == \
        run(base, ids=[prompt], params=p)[0].outputs[0].token_ids
    assert [n for n, _ in runner.calls[:4]] == [6, 6, 6, 2]


def test_text_prompts_and_order(make_llm, fake):
    llm, _ = make_llm(fake.next_word_logits)
    outs = run(llm, ["w1 w2", {"prompt_token_ids": [10]}, {"prompt": "w20"}], S(max_tokens=2, **GREEDY))
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert [o.prompt for o in outs] == ["w1 w2", None, "w20"]
    assert [o.prompt_token_ids for o in outs] == [[3, 4], [10], [22]]
    assert [o.outputs[0].token_ids for o in outs] == [[5, 6], [11, 12], [23, 24]]
    single = run(llm, "w1", S(max_tokens=1, **GREEDY))
    assert len(single) == 1 and single[0].request_id == "3"


def test_prompts_with_matching_token_ids(make_llm, fake):
    llm, _ = make_llm(fake.next_word_logits)
    out = run(llm, ["text kept"], S(max_tokens=1, **GREEDY), ids=[[7]])[0]
    assert out.prompt == "text kept" and out.prompt_token_ids == [7]
    assert run(llm, ids=[3, 4], params=S(max_tokens=1, **GREEDY))[0].prompt_token_ids == [3, 4]
    assert run(llm, ids=[]) == []


# ---- logprobs -----------------------------------------------------------------------------------
def test_logprobs_structure_and_values(make_llm, fake):
    llm, _ = make_llm(fake.random_logits)
    prompt, k = [4, 8], 3
    c = run(llm, ids=[prompt], params=S(max_tokens=6, logprobs=k, ignore_eos=True, seed=5))[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    ctx, total = list(prompt), 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        ref = torch.log_softmax(fake.random_logits(ctx).float(), dim=-1)
        top = ref.argsort(descending=True, stable=True)[:k].tolist()
        assert set(entry) == set(top) | {tok}
        assert [entry[t].rank for t in top] == [1, 2, 3]
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[t].item(), abs=1e-6)
            assert lp.rank == 1 + int((ref > ref[t]).sum())
            assert lp.decoded_token == fake.WORDS[t]
        assert next(iter(entry)) == tok                  # the sampled token comes first
        total += ref[tok].item()
        ctx.append(tok)
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_logprobs_zero_gives_sampled_token_only(make_llm, fake):
    llm, _ = make_llm(fake.random_logits, tokenizer=False)
    c = run(llm, ids=[[3]], params=S(max_tokens=3, logprobs=0, ignore_eos=True))[0].outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
    assert all(e[t].decoded_token is None for e, t in zip(c.logprobs, c.token_ids))


def test_prompt_logprobs(make_llm, fake):
    llm, runner = make_llm(fake.random_logits, max_num_batched_tokens=2)
    prompt = [3, 9, 4, 7, 11]
    out = run(llm, ids=[prompt], params=S(max_tokens=1, prompt_logprobs=2, n=2))[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        ref = torch.log_softmax(fake.random_logits(prompt[:i]), dim=-1)
        assert prompt[i] in plp[i] and len(plp[i]) in (2, 3)
        assert plp[i][prompt[i]].logprob == pytest.approx(ref[prompt[i]].item(), abs=1e-6)
        assert plp[i][prompt[i]].rank == 1 + int((ref > ref[prompt[i]]).sum())
    assert (2, True) in runner.calls


# ---- stopping -----------------------------------------------------------------------------------
def test_stop_token_ids(make_llm, fake):
    llm, _ = make_llm(fake.next_word_logits)
    c = run(llm, ids=[[2]], params=S(max_tokens=10, stop_token_ids=[6], **GREEDY))[0].outputs[0]
    assert c.token_ids == [3, 4, 5, 6] and c.finish_reason == "stop" and c.stop_reason == 6
    assert c.text == "w1 w2 w3"
    c = run(llm, ids=[[2]], params=S(max_tokens=10, stop_token_ids=[6], include_stop_str_in_output=True,
                                     **GREEDY))[0].outputs[0]
    assert c.text == "w1 w2 w3 w4"


def _eos_after(n):
    def fn(ctx):
        logits = torch.zeros(32)
        logits[1 if len(ctx) > n else 2 + len(ctx)] = 5.0
        return logits
    return fn


def test_eos_and_ignore_eos(make_llm, fake):
    llm, _ = make_llm(_eos_after(3))
    c = run(llm, ids=[[2]], params=S(max_tokens=10, **GREEDY))[0].outputs[0]
    assert c.token_ids == [3, 4, 5, 1] and c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == "w1 w2 w3"
    c = run(llm, ids=[[2]], params=S(max_tokens=6, ignore_eos=True, **GREEDY))[0].outputs[0]
    assert c.token_ids == [3, 4, 5, 1, 1, 1] and c.finish_reason == "length"


def test_min_tokens_masks_stop_tokens(make_llm, fake):
    def fn(ctx):          # EOS is always the favourite, stop id 9 the runner-up
        logits = torch.zeros(32)
        logits[1], logits[9] = 10.0, 8.0
        return logits
    llm, _ = make_llm(fn)
    c = run(llm, ids=[[2]], params=S(max_tokens=10, min_tokens=3, stop_token_ids=[9], **GREEDY))[0].outputs[0]
    assert len(c.token_ids) == 4 and c.token_ids[-1] == 1 and not {1, 9} & set(c.token_ids[:3])
    assert c.finish_reason == "stop"
    c = run(llm, ids=[[2]], params=S(max_tokens=3, min_tokens=3, **GREEDY))[0].outputs[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


def test_stop_strings(make_llm, fake):
    llm, _ = make_llm(fake.next_word_logits)
    c = run(llm, ids=[[2]], params=S(max_tokens=10, stop="w4", **GREEDY))[0].outputs[0]
    assert c.text == "w1 w2 w3 " and c.finish_reason == "stop" and c.stop_reason == "w4"
    assert c.token_ids == [3, 4, 5, 6]
    c = run(llm, ids=[[2]], params=S(max_tokens=10, stop=["w9", "2 w3"], include_stop_str_in_output=True,
                                     **GREEDY))[0].outputs[0]
    assert c.text == "w1 w2 w3" and c.stop_reason == "2 w3" and c.token_ids == [3, 4, 5]
    # A stop string inside the first min_tokens tokens does not end the completion.
    c = run(llm, ids=[[2]], params=S(max_tokens=6, min_tokens=3, stop="w1", **GREEDY))[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6


def test_max_model_len_caps_generation(make_llm, fake):
    llm, _ = make_llm(fake.next_word_logits, max_model_len=8)
    c = run(llm, ids=[[2, 3, 4, 5, 6]], params=S(max_tokens=100, **GREEDY))[0].outputs[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"
    c = run(llm, ids=[[2] * 8], params=S(max_tokens=None, **GREEDY))[0].outputs[0]
    assert len(c.token_ids) == 1


# ---- n > 1 and seeds ----------------------------------------------------------------------------
def test_n_completions(make_llm, fake):
    llm, runner = make_llm(fake.random_logits)
    out = run(llm, ids=[[3, 4]], params=S(n=4, max_tokens=8, ignore_eos=True, seed=1))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert llm.engine.scheduler.blocks.allocator.reclaim() and len(runner.seqs) == 4
    single = run(llm, ids=[[3, 4]], params=S(n=1, max_tokens=8, ignore_eos=True, seed=1))[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids
    assert len(out.metrics.token_times) == 32


def test_seeded_sampling_reproducible(make_llm, fake):
    p = S(max_tokens=10, ignore_eos=True, seq_seed=77, top_k=10)
    a, _ = make_llm(fake.random_logits)
    b, _ = make_llm(fake.random_logits, seed=999)
    first = run(a, ids=[[5]], params=p)[0].outputs[0].token_ids
    # Same seed, different LLM seed, different neighbours and request position: same tokens.
    outs = run(b, ids=[[9, 9], [5], [7]], params=[S(max_tokens=3), p, S(seed=1)])
    assert outs[1].outputs[0].token_ids == first


def test_unseeded_requests_derive_from_llm_seed(make_llm, fake):
    p = S(max_tokens=10, ignore_eos=True)
    runs = []
    for seed in (0, 0, 1):
        llm, _ = make_llm(fake.random_logits, seed=seed)
        runs.append([o.outputs[0].token_ids for o in run(llm, ids=[[5], [5]], params=p)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]          # the request counter gives each request its own seed
    assert runs[0] != runs[2]


def test_sampling_params_deep_copied(make_llm, fake):
    llm, _ = make_llm(fake.random_logits)
    p = S(max_tokens=2, stop=["zz"], extra_args={"a": [1]})
    before = copy.deepcopy(p)
    run(llm, ["w1", "w2"], p)
    assert p == before


# ---- metrics, compat, progress ------------------------------------------------------------------
def test_metrics(make_llm, fake):
    llm, _ = make_llm(fake.random_logits)
    m = run(llm, ids=[[3]], params=S(max_tokens=4, ignore_eos=True))[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 4 and m.token_times == sorted(m.token_times)
    assert m.time_to_first_token >= 0 and m.last_token_time == m.token_times[-1]


def test_metrics_survive_a_wall_clock_step(make_llm, fake, monkeypatch):
    """The wall clock jumping (NTP, a VM's clock sync) mid-request moves no latency: every stamp is
    read off the monotonic clock, so e2e stays inside the generate call that held the request."""
    llm, _ = make_llm(fake.random_logits)
    wall, steps = time.time, iter([0.0, -30.0, 5.0, -2.0])
    monkeypatch.setattr(time, "time", lambda: wall() + next(steps, 60.0))
    t0 = time.perf_counter()
    m = run(llm, ids=[[3]], params=S(max_tokens=4, ignore_eos=True))[0].metrics
    elapsed = time.perf_counter() - t0
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.token_times == sorted(m.token_times)
    assert 0 <= m.finished_time - m.arrival_time <= elapsed


def test_decode_sequence_returns_text(make_llm, fake):
    llm, _ = make_llm(fake.next_word_logits, decode_sequence=True)
    assert run(llm, ["w1"], S(max_tokens=2, **GREEDY)) == ["w2 w3"]


def test_use_tqdm(make_llm, fake, capsys):
    llm, _ = make_llm(fake.next_word_logits)
    assert len(llm.generate(["w1", "w2"], S(max_tokens=1), use_tqdm=True)) == 2
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().vocab_size == 32


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(prompts=None), ValueError, "prompts"),
    (dict(prompts=5), TypeError, "prompts"),
    (dict(prompts=[[1, 2]]), ValueError, "prompts"),
    (dict(prompts=[{"x": 1}]), ValueError, "prompts"),
    (dict(prompts=["w1"], prompt_token_ids=[[1], [2]]), ValueError, "prompt_token_ids"),
    (dict(prompt_token_ids=5), TypeError, "prompt_token_ids"),
    (dict(prompt_token_ids=[[3], 4]), ValueError, "prompt_token_ids"),
    (dict(prompts=[""]), ValueError, "prompt 0 is invalid: the prompt is empty"),
    (dict(prompt_token_ids=[[3], []]), ValueError, "prompt 1 is invalid: the prompt is empty"),
    (dict(prompt_token_ids=[[3, 32]]), ValueError, "token id 32"),
    (dict(prompt_token_ids=[[-1]]), ValueError, "token id -1"),
    (dict(prompt_token_ids=[[2.0]]), ValueError, "token id 2.0"),
    (dict(prompt_token_ids=[[2] * 65]), ValueError, "max_model_len"),
    (dict(prompts=["w1", "w2"], sampling_params=[S()]), ValueError, "sampling_params"),
    (dict(prompts=["w1"], sampling_params={"temperature": 0}), TypeError, "sampling_params"),
    (dict(prompts=["w1"], sampling_params=S(logprobs=33)), ValueError, "logprobs"),
])
def test_bad_generate_inputs(make_llm, fake, kwargs, exc, match):
    llm, runner = make_llm(fake.random_logits, max_model_len=64)
    with pytest.raises(exc, match=match) as info:
        llm.generate(use_tqdm=False, **kwargs)
    if isinstance(info.value, InvalidRequestError):
        # a bad request inside a good call: the good ones ran, the bad one never reached the model
        bad = set(info.value.errors)
        assert all((o is None) == (i in bad) for i, o in enumerate(info.value.outputs))
        assert len(runner.calls) > 0 or len(bad) == len(info.value.outputs)
    else:
        assert runner.calls == []   # a malformed call runs nothing


def test_text_prompt_without_tokenizer(make_llm, fake):
    llm, _ = make_llm(fake.random_logits, tokenizer=False)
    with pytest.raises(ValueError, match="prompt_token_ids or LLM\\(tokenizer="):
        run(llm, ["hello"])
    with pytest.raises(ValueError, match="stop"):
        run(llm, ids=[[3]], params=S(stop="x"))
    assert run(llm, ids=[[3]], params=S(max_tokens=2, ignore_eos=True))[0].outputs[0].text == ""


def test_bad_request_keeps_its_id_and_the_good_one_completes(make_llm, fake):
    llm, _ = make_llm(fake.random_logits)
    with pytest.raises(InvalidRequestError, match="request 1: .*token id 99") as info:
        run(llm, ids=[[3], [99]])
    good, bad = info.value.outputs
    assert "the other 1 completed" in str(info.value) and ".outputs" in str(info.value)   # Python terms
    assert bad is None and good.request_id == "0" and len(good.outputs[0].token_ids) > 0
    assert isinstance(info.value.errors[1], ValueError)
    assert run(llm, ids=[[3]])[0].request_id == "2"     # ids are never reused


# ---- constructor --------------------------------------------------------------------------------
@pytest.fixture
def patched(monkeypatch, fake, tok_dir):
    """LLM.__init__ with model resolution and the runner replaced by the fake."""
    seen = {}

    def make_runner(model_dir, config):
        seen.update(config=config, model_dir=model_dir)
        return fake.FakeRunner(fake.next_word_logits)

    monkeypatch.setattr(llm_mod, "_resolve_model", lambda m: tok_dir)
    monkeypatch.setattr(llm_mod, "_make_runner", make_runner)
    return seen


@pytest.mark.parametrize("dtype,expected", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("auto", "bfloat16"), ("BFloat16", "bfloat16"),
    (torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
])
def test_dtype_accepted(patched, dtype, expected):
    llm = LLM("some/model", dtype=dtype, simulate_qat=False, device="cpu")
    model = patched["config"].model
    assert model.dtype == expected and model.simulate_qat is False and llm.dtype == expected
    assert model.device == "cpu" and model.max_model_len is None      # the LLM resolves it from the model
    assert llm.config.model.max_model_len == 4096 and llm.config.model.dtype == expected
    assert llm.get_tokenizer() is not None                   # tokenizer.json found in the model dir


@pytest.mark.parametrize("dtype", ["float16", "fp8", torch.float16, 3, None])
def test_dtype_rejected(patched, dtype):
    with pytest.raises(ValueError, match="dtype.*allowed.*float32.*bfloat16.*auto"):
        LLM("some/model", dtype=dtype)


def test_ds_and_vllm_kwargs_the_engine_implements_are_accepted(patched):
    llm = LLM("m", gpu_memory_utilization=0.5, trust_remote_code=True, enforce_eager=True,
              tensor_parallel_size=1, revision="main", load_format="dummy", max_num_batched_tokens=128,
              enable_chunked_prefill=True, enable_prefix_caching=False)
    config = patched["config"]
    assert llm.config is not config and llm.config.model.max_model_len == 4096    # resolved by the LLM
    assert config.scheduler.max_num_batched_tokens == 128 and config.cache.gpu_memory_utilization == 0.5
    assert config.model.load_format == "dummy" and config.model.enforce_eager is True
    for refused in ({"tensor_parallel_size": 8}, {"enable_prefix_caching": "yes"},
                    {"enable_chunked_prefill": False}, {"expert_parallel_size": 8}):
        with pytest.raises(ValueError, match=next(iter(refused))):
            LLM("m", **refused)


def test_unknown_kwarg_is_type_error(patched):
    with pytest.raises(TypeError, match="bogus_option.*accepted.*max_num_batched_tokens"):
        LLM("m", bogus_option=1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM("m", max_num_batched_tokens=0)


def test_max_model_len_validated(patched):
    assert LLM("m").config.model.max_model_len == 4096
    assert LLM("m", max_model_len=100).config.model.max_model_len == 100
    for bad in (0, 5000, "10"):
        with pytest.raises(ValueError, match="max_model_len"):
            LLM("m", max_model_len=bad)
    with pytest.raises(ValueError, match="seed='x'; allowed: an int"):
        LLM("m", seed="x")


def test_model_from_env(patched, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    LLM()
    assert patched["model_dir"] is not None
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR")
    bundled = tmp_path / "bundled"
    monkeypatch.setattr("deepinfer_core.tools.bundled_model.bundled_tiny_model_dir", lambda: bundled)
    assert str(LLM().config.model.model) == str(bundled)      # no model at all: the bundled tiny model


def test_bad_tokenizer_argument(patched):
    with pytest.raises(ValueError, match="tokenizer"):
        LLM("m", tokenizer="/no/such/dir")


def test_fp4_experts_is_refused_where_the_backend_cannot_keep_them(tiny_ckpt_dir):
    """An option we accept does what it says: the CPU's portable MoE dequantises experts at load."""
    with pytest.raises(ValueError, match=r"fp4_experts=True: .*PortableMoE.*nvidia backend"):
        LLM(model=str(tiny_ckpt_dir), fp4_experts=True)


def test_llm_admits_in_the_runners_scheduling_policy_order(make_llm):
    """The runner's policy (hook deepinfer_scheduler_policy) orders admission: shortest prompt
    first, one sequence at a time."""
    class ShortestPromptFirst:
        name = "shortest-prompt-first"

        def admission_key(self, request):
            return len(request.prompt_token_ids)

    llm, runner = make_llm(max_num_seqs=1)
    runner.scheduler_policy = ShortestPromptFirst()
    outs = llm.generate(prompt_token_ids=[[5] * 9, [5] * 3, [5] * 6],
                        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    first = [o.metrics.first_scheduled_time for o in outs]
    assert sorted(range(3), key=first.__getitem__) == [1, 2, 0]
