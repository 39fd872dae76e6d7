"""so_args / structured_outputs validation: every invalid input is a ValueError naming the key, at
SamplingParams construction (shape) or at submission (grammar syntax, token ids vs the vocabulary)."""
from __future__ import annotations

import pytest

from deepinfer_core import SamplingParams, StructuredOutputsParams
from deepinfer_core.api.structured_outputs import parse_so_args
from deepinfer_core.engine.constraints import attach_constraint

J = {"schema_type": "json", "schema": {"type": "object"}}


@pytest.mark.parametrize("so_args, match", [
    ("json", "must be a dict"),
    ({"schema_type": "json"}, "missing 'schema'"),
    ({"schema": "{}"}, "missing 'schema_type'"),
    ({"schema_type": "xml", "schema": "<a/>"}, "schema_type='xml'; allowed: json, regex, ebnf"),
    ({"schema_type": "regex", "schema": 5}, "must be a str"),
    ({"schema_type": "json", "schema": 5}, "str or a dict"),
    ({"schema_type": "regex", "schema": "  "}, "schema is empty"),
    ({"schema_type": "json", "schema": "{not json"}, "not valid JSON"),
    ({"schema_type": "json", "schema": "[1, 2]"}, "must be a JSON object"),
    ({"schema_type": "json", "schema": {"x": {1, 2}}}, "not JSON-serialisable"),
    ({**J, "serialized": "..."}, r"unknown key\(s\) \['serialized'\]"),
    ({**J, "bound_token_ids": [3]}, r"unknown key\(s\) \['bound_token_ids'\]"),
    ({**J, "trigger_token_ids": [1, -2]}, "trigger_token_ids"),
    ({**J, "trigger_token_ids": [True]}, "trigger_token_ids"),
    ({**J, "trigger_token_ids": 7}, "trigger_token_ids"),
    ({**J, "bound_token_id": 3}, "needs a non-empty trigger_token_ids"),
    ({**J, "trigger_token_ids": [], "bound_token_id": 3}, "needs a non-empty trigger_token_ids"),
    ({**J, "trigger_token_ids": [5], "bound_token_id": -1}, "bound_token_id"),
    ({**J, "trigger_token_ids": [5], "bound_token_id": "5"}, "bound_token_id"),
])
def test_bad_so_args_raise_at_construction(so_args, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(so_args=so_args)


def test_good_so_args_normalise():
    so = parse_so_args({"schema_type": "json", "schema": {"b": 1, "a": 2}, "trigger_token_ids": [4, 5],
                        "bound_token_id": 0})
    assert so.schema == '{"b": 1, "a": 2}'          # key order kept: it orders the generated properties
    assert so.trigger_token_ids == (4, 5) and so.bound_token_id == 0
    assert parse_so_args({"schema_type": "regex", "schema": "a+"}).trigger_token_ids == ()


def test_changed_params_are_validated_again():
    p = SamplingParams(so_args=J)
    p.so_args = {"schema_type": "yaml", "schema": "x"}
    with pytest.raises(ValueError, match="schema_type='yaml'"):
        p.validate()


@pytest.mark.parametrize("value, expected", [
    (StructuredOutputsParams(json={"type": "object"}), {"schema_type": "json", "schema": {"type": "object"}}),
    (StructuredOutputsParams(regex="[0-9]+"), {"schema_type": "regex", "schema": "[0-9]+"}),
    (StructuredOutputsParams(grammar='root ::= "a"'), {"schema_type": "ebnf", "schema": 'root ::= "a"'}),
    (StructuredOutputsParams(choice=["yes", 'say "no"']),
     {"schema_type": "ebnf", "schema": 'root ::= "yes" | "say \\"no\\""'}),
    ({"json_object": True}, {"schema_type": "json", "schema": {"type": "object"}}),
    ({"regex": "a", "extra": {"trigger_token_ids": [9]}},
     {"schema_type": "regex", "schema": "a", "trigger_token_ids": [9]}),
])
def test_structured_outputs_convenience(value, expected):
    assert SamplingParams(structured_outputs=value).so_args == expected


@pytest.mark.parametrize("kwargs, match", [
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "exactly one of"),
    ({"structured_outputs": {"schema": "a"}}, r"unknown key\(s\) \['schema'\]"),
    ({"structured_outputs": "a+"}, "StructuredOutputsParams or a dict"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"regex": "a"}, "so_args": J}, "not both"),
])
def test_bad_structured_outputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_so_args_without_a_claiming_processor_is_refused():
    """Never silently unconstrained: with no structured-outputs processor the request is refused."""
    with pytest.raises(ValueError, match="so_args needs the structured-outputs feature"):
        attach_constraint([], SamplingParams(so_args=J), tokenizer=None, vocab_size=10, eos_token_id=1)
    assert attach_constraint([], SamplingParams(), tokenizer=None, vocab_size=10, eos_token_id=1) is None
