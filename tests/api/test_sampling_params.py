import copy
import dataclasses

import pytest

from deepinfer_core import SamplingParams


def test_vllm_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.detokenize and p.skip_special_tokens and p.so_args is None and p.extra_args is None
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_seed_alias_and_masking():
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=7).seq_seed == 7
    assert SamplingParams(seq_seed=-1).seed == (1 << 64) - 1
    assert SamplingParams(seed=(1 << 70) + 5).seed == 5
    assert SamplingParams(seed=3, seq_seed=3).seed == 3
    with pytest.raises(ValueError, match="seq_seed"):
        SamplingParams(seed=3, seq_seed=4)


@pytest.mark.parametrize("bad", [1.5, "1", True, [1]])
def test_seed_non_int_is_type_error(bad):
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seq_seed=bad)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seed=bad)


def test_top_logprobs_alias_and_bool_logprobs():
    p = SamplingParams(top_logprobs=5)
    assert p.logprobs == 5 and p.top_logprobs == 5
    assert SamplingParams(logprobs=False).logprobs is None     # DS-DeepInfer's "off"
    assert SamplingParams(logprobs=True).logprobs == 0


def test_stop_normalised():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=[5], ignore_eos=False).all_stop_token_ids(1) == {1, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(1) == {5}


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 1 << 31),
    ("min_p", -0.01), ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1),
    ("n", 0), ("logprobs", -1), ("prompt_logprobs", -1), ("presence_penalty", 2.5),
    ("presence_penalty", -2.1), ("frequency_penalty", 3.0), ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0), ("stop", 5), ("stop", ["a", 3]), ("stop", [""]),
    ("stop_token_ids", [1.5]), ("stop_token_ids", "1"), ("stop_token_ids", [-1]),
    ("temperature", "hot"), ("n", 1.0), ("top_k", 2.0), ("so_args", "json"), ("extra_args", [1]),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(min_tokens=100, max_tokens=None)


def test_valid_edges():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2,
                   frequency_penalty=2, repetition_penalty=1e-3, logprobs=0)
    SamplingParams(top_k=1, top_p=1e-9, so_args={"schema_type": "json", "schema": "{}"},
                   extra_args={"x": 1})


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)


def test_copy_and_replace():
    p = SamplingParams(seq_seed=9, stop=["a"], so_args={"schema_type": "json", "schema": "{}"})
    q = copy.deepcopy(p)
    assert q == p and q.stop is not p.stop and q.so_args is not p.so_args
    r = dataclasses.replace(p, temperature=0.5)
    assert r.seed == 9 and r.temperature == 0.5
    assert p.clone() == p
