"""The shape of structured-output requests: DS-DeepInfer's `so_args` and vLLM's `structured_outputs`.

    so_args = {"schema_type": "json" | "regex" | "ebnf",
               "schema": str (a dict too for json),
               "trigger_token_ids": [int, ...],     # optional: free text until this id sequence appears
               "bound_token_id": int}               # optional, needs a trigger: once sampled, the
                                                    # trigger is forced, then the grammar applies

`parse_so_args` checks the shape (keys, types, JSON syntax) when a SamplingParams is built; the
grammar itself is parsed and compiled at submission by the structured-outputs plugin, which also
checks token ids against the vocabulary. Differences from DS-DeepInfer: every problem is a ValueError
naming the key (DS-DeepInfer raises KeyError for a missing schema and reports compile errors only as
a finish reason), and unknown keys are refused, not only `serialized` and `bound_token_ids`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA_TYPES = ("json", "regex", "ebnf")
SO_ARGS_KEYS = ("schema_type", "schema", "trigger_token_ids", "bound_token_id")


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(frozen=True)
class SoArgs:
    """Validated so_args; `schema` is always a string (a json dict is serialised, key order kept)."""

    schema_type: str
    schema: str
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None

    @property
    def cache_key(self) -> tuple[str, str]:
        return self.schema_type, self.schema


def parse_so_args(so_args: Any) -> SoArgs:
    """Validate a so_args dict; every problem is a ValueError naming the key and what is allowed."""
    def bad(msg: str) -> ValueError:
        return ValueError(f"SamplingParams: so_args {msg}")

    if not isinstance(so_args, dict):
        raise bad(f"must be a dict, got {type(so_args).__name__}")
    unknown = sorted(str(k) for k in so_args if k not in SO_ARGS_KEYS)
    if unknown:
        raise bad(f"has unknown key(s) {unknown}; allowed: {', '.join(SO_ARGS_KEYS)}")
    for key in ("schema_type", "schema"):
        if key not in so_args:
            raise bad(f"is missing {key!r} (allowed schema_type: {', '.join(SCHEMA_TYPES)})")
    kind = so_args["schema_type"]
    if kind not in SCHEMA_TYPES:
        raise bad(f"schema_type={kind!r}; allowed: {', '.join(SCHEMA_TYPES)}")
    schema = so_args["schema"]
    if kind == "json":
        schema = _json_schema_text(schema, bad)
    elif not isinstance(schema, str):
        raise bad(f"schema for schema_type {kind!r} must be a str, got {type(schema).__name__}")
    if not schema.strip():
        raise bad("schema is empty")
    trigger = so_args.get("trigger_token_ids")
    if trigger is None:
        trigger = ()
    elif not isinstance(trigger, (list, tuple)) or not all(_is_token_id(t) for t in trigger):
        raise bad(f"trigger_token_ids={trigger!r}; allowed: a list of token ids (ints >= 0)")
    bound = so_args.get("bound_token_id")
    if bound is not None:
        if not _is_token_id(bound):
            raise bad(f"bound_token_id={bound!r}; allowed: a token id (int >= 0) or None")
        if not trigger:
            raise bad("bound_token_id needs a non-empty trigger_token_ids (the sequence it forces)")
    return SoArgs(kind, schema, tuple(trigger), bound)


def _json_schema_text(schema: Any, bad) -> str:
    if isinstance(schema, dict):
        try:
            return json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise bad(f"schema is a dict that is not JSON-serialisable: {e}") from None
    if not isinstance(schema, str):
        raise bad(f"schema for schema_type 'json' must be a str or a dict, got {type(schema).__name__}")
    try:
        value = json.loads(schema)
    except ValueError as e:
        raise bad(f"schema is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise bad(f"schema must be a JSON object (a JSON Schema), got {type(value).__name__}")
    return schema


@dataclass
class StructuredOutputsParams:
    """vLLM's spelling: exactly one of json (schema), regex, choice, grammar (EBNF) or json_object."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)   # trigger_token_ids / bound_token_id

    def to_so_args(self) -> dict[str, Any]:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"SamplingParams: structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        kind = given[0]
        if kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"SamplingParams: structured_outputs.choice={self.choice!r}; "
                                 f"allowed: a non-empty list of non-empty strings")
            out = {"schema_type": "ebnf",
                   "schema": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)}
        elif kind == "json_object":
            out = {"schema_type": "json", "schema": {"type": "object"}}
        else:
            out = {"schema_type": {"json": "json", "regex": "regex", "grammar": "ebnf"}[kind],
                   "schema": getattr(self, kind)}
        return {**out, **self.extra}


def structured_outputs_to_so_args(value: Any) -> dict[str, Any]:
    """`SamplingParams(structured_outputs=...)`: a StructuredOutputsParams or a dict of its fields."""
    if isinstance(value, dict):
        allowed = ("json", "regex", "choice", "grammar", "json_object", "extra")
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise ValueError(f"SamplingParams: structured_outputs has unknown key(s) {unknown}; "
                             f"allowed: {', '.join(allowed)}")
        value = StructuredOutputsParams(**value)
    if not isinstance(value, StructuredOutputsParams):
        raise ValueError(f"SamplingParams: structured_outputs must be a StructuredOutputsParams or a dict, "
                         f"got {type(value).__name__}")
    return value.to_so_args()
