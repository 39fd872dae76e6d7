"""The building blocks of `EngineConfig`'s fields: a `Rule` (what a field accepts, named in every
error, --help line and README row), the field makers (`option`, `env_option`, `env_if_set`) that
attach a rule and a one-line doc to a dataclass field, and `Section`, which applies the rules on
construction. Kept free of torch, as engine_config is."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .envs import Settings, field_name

TABLE_DEFAULTS = Settings()         # the env table's defaults (no environment read)


@dataclass(frozen=True)
class Rule:
    """What a field accepts: `allowed` is shown in errors, --help and the README table."""

    allowed: str
    ok: Callable[[Any], bool] = lambda v: True
    convert: Callable[[Any], Any] = lambda v: v
    why: str = ""                   # appended to the error: why only these values

    def __call__(self, name: str, value: Any) -> Any:
        if not self.ok(value):
            why = f" ({self.why})" if self.why else ""
            raise ValueError(f"{name}={value!r}; allowed: {self.allowed}{why}")
        return self.convert(value)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive(none: str | None = None) -> Rule:
    """An int >= 1; with `none`, also None meaning `none`."""
    if none is None:
        return Rule("an int >= 1", lambda v: is_int(v) and v >= 1)
    return Rule(f"an int >= 1, or None ({none})", lambda v: v is None or (is_int(v) and v >= 1))


def path_or_none(none: str) -> Rule:
    return Rule(f"a path or repo id (str or os.PathLike), or None ({none})",
                lambda v: v is None or isinstance(v, (str, os.PathLike)), lambda v: v if v is None else str(v))


def str_or_none(none: str) -> Rule:
    return Rule(f"a str, or None ({none})", lambda v: v is None or (isinstance(v, str) and v != ""))


def choice(*values: str) -> Rule:
    return Rule(", ".join(map(repr, values)), lambda v: isinstance(v, str) and v in values)


def env_bool(env: str) -> Rule:
    return Rule(f"True, False, None (= {env})", lambda v: isinstance(v, bool))


def only(value: Any, why: str) -> Rule:
    """Options whose other values the engine does not implement yet."""
    return Rule(repr(value), lambda v: type(v) is type(value) and v == value, why=why)


DTYPE_ALIASES = {"float32": "float32", "float": "float32", "fp32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16", "auto": "bfloat16"}


def normalize_dtype(dtype: Any) -> str:
    """Accept "float32"/"bfloat16"/"auto"/aliases/torch dtypes; anything else names the allowed values.
    Torch-free for strings (the CLI validates before importing torch): a torch dtype means torch is loaded."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    if isinstance(dtype, str) and dtype.lower() in DTYPE_ALIASES:
        return DTYPE_ALIASES[dtype.lower()]
    raise ValueError(f"dtype={dtype!r} is not supported; allowed: 'float32', 'bfloat16', "
                     f"'auto' (= bfloat16), torch.float32, torch.bfloat16")


BOOL = Rule("True, False", lambda v: isinstance(v, bool))
UTILIZATION = Rule("a number in (0, 1]", lambda v: not isinstance(v, bool) and isinstance(v, (int, float))
                   and 0 < v <= 1, float)
SINGLE_GPU = "not implemented; data and expert parallelism are (data_parallel_size, enable_expert_parallel)"
NO_SPECULATIVE = "use num_speculative_tokens (DEEPINFER_USE_NEXTN_DECODE): MTP drafts are the only method yet"


def validate_utilization(value: Any) -> float:
    """`gpu_memory_utilization` as a float in (0, 1], else a ValueError naming it."""
    return UTILIZATION("gpu_memory_utilization", value)


def option(default: Any, doc: str, rule: Rule) -> Any:
    return field(default=default, metadata={"doc": doc, "rule": rule, "env": None, "setting": None})


def env_if_set(env: str, doc: str, rule: Rule) -> Any:
    """A field filled from `env` only when that variable is set; None otherwise (the default then
    depends on something resolved later, e.g. the checkpoint)."""
    return field(default=None, metadata={"doc": doc, "rule": rule, "env": None, "env_if_set": env,
                                         "setting": field_name(env)})


def env_option(env: str, doc: str, rule: Rule | None = None, setting: str | None = None) -> Any:
    """A field filled from the DEEPINFER_* variable `env` when the option is unset or None (`setting`:
    the `Settings` attribute, when not the variable's own); its default is the env table's."""
    setting = setting or field_name(env)
    return field(default=getattr(TABLE_DEFAULTS, setting),
                 metadata={"doc": doc, "rule": rule or env_bool(env), "env": env, "setting": setting})


class Section:
    """Validates (and normalises) every field with its rule, on construction and on `replace`."""

    def __post_init__(self) -> None:
        for f in fields(self):
            rule = f.metadata.get("rule")
            if rule is not None:
                object.__setattr__(self, f.name, rule(f.name, getattr(self, f.name)))
