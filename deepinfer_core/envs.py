"""The one table of every DEEPINFER_* environment variable.

Each variable is declared once here (name, type, default, allowed values, one-line doc) and
validated in one place. Read the environment once at start-up with `read_settings()` (or `get()`
for a single variable) and pass the values on; nothing on the hot path reads `os.environ`.

An empty value counts as unset. Booleans accept 0/1/true/false/yes/no (any case).
`python -m deepinfer_core.envs --markdown` prints the README table generated from `ENV_VARS`.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from . import readme_tables

logger = logging.getLogger("deepinfer.envs")

PREFIX = "DEEPINFER_"
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")
_PLUGIN_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
SECRET_MIN_CHARS = 16

README_BEGIN = "<!-- envs:begin -->"
README_END = "<!-- envs:end -->"


class EnvError(ValueError):
    """A DEEPINFER_* variable holds a value outside its allowed set."""


@dataclass(frozen=True)
class EnvVar:
    """One declared variable. `kind` is bool | int | choice | path | list | floats | secret (a string
    never printed: neither in errors nor by `python -m deepinfer_core.envs`)."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()     # kind == "choice"
    minimum: int | None = None        # kind == "int"

    def allowed(self) -> str:
        """Human-readable allowed values, used in errors and in the README table."""
        if self.kind == "bool":
            return "0, 1, true, false, yes, no"
        if self.kind == "choice":
            return ", ".join(self.choices)
        if self.kind == "int":
            return f"integer >= {self.minimum}" if self.minimum is not None else "integer"
        if self.kind == "path":
            return "path to an existing directory"
        if self.kind == "list":
            return "comma-separated plugin names (letters, digits, _ . -)"
        if self.kind == "floats":
            return "a number > 0, or a comma-separated list of them"
        if self.kind == "secret":
            return f"a string of {SECRET_MIN_CHARS} or more characters"
        raise AssertionError(self.kind)

    def default_text(self) -> str:
        if self.default is None:
            return "unset"
        if self.kind == "bool":
            return "1" if self.default else "0"
        if self.kind in ("list", "floats"):
            return ",".join(map(str, self.default)) or "unset"
        return str(self.default)

    def parse(self, raw: str | None) -> Any:
        """Turn a raw environment string into the typed value, or raise `EnvError`."""
        if raw is None or raw.strip() == "":
            return self.default
        value = raw.strip()
        if self.kind == "bool":
            low = value.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
        elif self.kind == "choice":
            if value.lower() in self.choices:
                return value.lower()
        elif self.kind == "int":
            try:
                number = int(value, 10)
            except ValueError:
                number = None
            if number is not None and (self.minimum is None or number >= self.minimum):
                return number
        elif self.kind == "path":
            if Path(value).expanduser().is_dir():
                return str(Path(value).expanduser())
        elif self.kind == "list":
            items = tuple(item.strip() for item in value.split(",") if item.strip())
            if items and all(_PLUGIN_NAME.match(item) for item in items):
                return items
        elif self.kind == "floats":
            try:
                numbers = tuple(float(item) for item in value.split(","))
            except ValueError:
                numbers = ()
            if numbers and all(x > 0 for x in numbers):
                return numbers
        elif self.kind == "secret":
            if len(value) >= SECRET_MIN_CHARS:
                return value
            raise EnvError(f"{self.name} (set, {len(value)} characters) is invalid; allowed: {self.allowed()}")
        raise EnvError(f"{self.name}={raw!r} is invalid; allowed: {self.allowed()}")


# The table. Order here is the order of the README table and of `Settings`.
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("DEEPINFER_ACCELERATOR", "choice", None,
           "Hardware backend to use; unset = auto-detect (an installed backend whose hardware is "
           "present, else the portable CPU core).", choices=("nvidia", "ascend", "cpu")),
    EnvVar("DEEPINFER_HF_MODEL_DIR", "path", None,
           "Local checkpoint directory (config.json, *.safetensors) used instead of a download."),
    EnvVar("DEEPINFER_ENABLE_MTP_VARLEN", "bool", False,
           "Confidence-scheduled verification: the drafts verified per step follow the drafter's "
           "confidences and the step times profiled at start-up; 0 verifies every draft. Refused with "
           "DEEPINFER_BATCH_INVARIANT=1."),
    EnvVar("DEEPINFER_USE_NEXTN_DECODE", "int", 5,
           "Draft tokens per request per step (gamma; MTP-gamma with the checkpoint's mtp.* block); 0 "
           "disables speculative decoding. Unset: the DSpark block size (5) when the checkpoint has a "
           "DSpark drafter, 5 when it has an MTP block, else off (logged once).", minimum=0),
    EnvVar("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "floats", (1.0,),
           "DSpark confidence head: calibration temperature(s), one for every draft position or one "
           "per position (as many as DEEPINFER_USE_NEXTN_DECODE); each clamped to >= 1e-5. Unset: the "
           "checkpoint's dspark_confidence_temperatures (python -m deepinfer_dspark.calibrate "
           "--write-config), else 1.0."),
    EnvVar("DEEPINFER_MAX_BACKTRACKING_TOKENS", "int", 0,
           "Rollback room in the SWA rings; the effective value is max(value, gamma + 1).",
           minimum=0),
    EnvVar("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "choice", "off",
           "V4.1 SWA bounded replay (the swa_replay feature): 'off' = exact; 'mask' / 'compact' = the "
           "YOCO consumer layers' windows see only the prompt's last KEEP tokens ('compact' also skips "
           "the earlier rows in those layers: faster prefill).",
           choices=("off", "mask", "compact")),
    EnvVar("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "int", 140,
           "V4.1 bounded replay: the prompt suffix (KEEP) the YOCO consumer layers replay; at least "
           "sliding_window + the backtracking room.",
           minimum=1),
    EnvVar("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE", "bool", False,
           "V4.1 Engram: keep the n-gram tables in device memory instead of pinned host memory "
           "(the default on CUDA when the backend can gather from host memory)."),
    EnvVar("DEEPINFER_BATCH_INVARIANT", "bool", False,
           "Batch-invariant kernels (cpu and nvidia): a request's logits and tokens do not depend on "
           "its batch or its prefill chunking; with DEEPINFER_ENABLE_MTP_VARLEN=0 and a seed, "
           "deterministic sampling."),
    EnvVar("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "bool", True,
           "Overlap host post-processing of step N with the device forward of step N+1."),
    EnvVar("DEEPINFER_CPU_KV_CACHE_BYTES", "int", 1 << 30,
           "State-cache budget in bytes on the CPU (window rings, compressor tails, paged "
           "compressed rows and indexer keys); LLM(kv_cache_memory_bytes=...) overrides it.",
           minimum=1),
    EnvVar("DEEPINFER_ENFORCE_EAGER", "bool", False,
           "Disable CUDA graphs for the main model (always eager)."),
    EnvVar("DEEPINFER_PDL", "bool", False,
           "nvidia backend, SM90 and later: launch every DeepInfer kernel with programmatic dependent "
           "launch (it starts while its predecessor runs and waits in a gate; the FP8 GEMMs prefetch "
           "their weights meanwhile). Opt-in: not yet measured on a GPU."),
    EnvVar("DEEPINFER_XGRAMMAR_TIMEOUT", "int", 20,
           "Structured outputs: seconds a grammar may take to compile before its request is refused.",
           minimum=1),
    EnvVar("DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES", "int", 10 << 30,
           "Structured outputs: memory cap of the compiled-grammar cache (least recently used "
           "grammars are evicted past it).", minimum=0),
    EnvVar("DEEPINFER_XGRAMMAR_DISABLE_CACHE", "bool", False,
           "Structured outputs: compile every request's grammar afresh (no compiled-grammar cache)."),
    EnvVar("DEEPINFER_SO_BUILDER_CPUS", "int", 4,
           "Structured outputs: threads that compile grammars off the step loop.", minimum=1),
    EnvVar("DEEPINFER_SO_JSON_MAX_WHITESPACE", "int", 16,
           "Structured outputs: JSON schemas allow up to this many whitespace characters between "
           "elements; 0 = none beyond single-space separators.", minimum=0),
    EnvVar("DEEPINFER_PLUGINS", "list", None,
           "Allow-list of entry-point plugin names to load; unset = all (the core is always "
           "loaded)."),
    EnvVar("DEEPINFER_DISABLE_PLUGINS", "list", (),
           "Deny-list of entry-point plugin names never to load."),
    EnvVar("DEEPINFER_TRACE_PLUGINS", "bool", False,
           "Log every plugin hook call with its arguments and result."),
    EnvVar("DEEPINFER_DP_AUTHKEY", "secret", None,
           "launcher='torchrun': the key the data-parallel ranks authenticate their connections to the "
           "front end with (HMAC challenge); the same on every node. Unset: derived from torchrun's "
           "TORCHELASTIC_RUN_ID, MASTER_ADDR and MASTER_PORT, which anyone on the cluster network can "
           "know."),
)}


def effective_max_backtracking_tokens(value: int, nextn: int) -> int:
    """Rollback room actually reserved: a verify step may reject up to `nextn + 1` tokens."""
    return max(value, nextn + 1)


@dataclass(frozen=True)
class Settings:
    """Typed snapshot of every DEEPINFER_* variable, read once at start-up."""

    accelerator: str | None = None
    hf_model_dir: str | None = None
    enable_mtp_varlen: bool = False
    use_nextn_decode: int = 5
    dflash_confidence_head_temperature: tuple[float, ...] = (1.0,)
    max_backtracking_tokens: int = 0
    yoco_prefill_truncation_mode: str = "off"
    yoco_prefill_keep_tokens: int = 140
    engram_force_gpu_storage: bool = False
    batch_invariant: bool = False
    zero_overhead_scheduling: bool = True
    cpu_kv_cache_bytes: int = 1 << 30
    enforce_eager: bool = False
    pdl: bool = False
    xgrammar_timeout: int = 20
    xgrammar_cache_limit_bytes: int = 10 << 30
    xgrammar_disable_cache: bool = False
    so_builder_cpus: int = 4
    so_json_max_whitespace: int = 16
    plugins: tuple[str, ...] | None = None
    disable_plugins: tuple[str, ...] = ()
    trace_plugins: bool = False
    dp_authkey: str | None = field(default=None, repr=False)

    @property
    def effective_max_backtracking_tokens(self) -> int:
        return effective_max_backtracking_tokens(self.max_backtracking_tokens,
                                                 self.use_nextn_decode)


def field_name(var_name: str) -> str:
    """DEEPINFER_USE_NEXTN_DECODE -> use_nextn_decode (the `Settings` field)."""
    return var_name[len(PREFIX):].lower()


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Typed, validated value of one declared variable (the default when unset)."""
    try:
        var = ENV_VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in deepinfer_core/envs.py") from None
    return var.parse(_environ(environ).get(name))


_warned: set[str] = set()


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """DEEPINFER_* names present in the environment but not declared in the table."""
    env = _environ(environ)
    return sorted(k for k in env if k.startswith(PREFIX) and k not in ENV_VARS)


def warn_unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log one warning naming undeclared DEEPINFER_* variables (each name once per process)."""
    new = [name for name in unknown_variables(environ) if name not in _warned]
    if new:
        _warned.update(new)
        logger.warning("ignoring unknown environment variable(s) %s (not declared in "
                       "deepinfer_core/envs.py; typo?)", ", ".join(new))
    return new


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every declared variable once; raises `EnvError` on the first bad one."""
    env = _environ(environ)
    warn_unknown(env)
    values = {field_name(name): var.parse(env.get(name)) for name, var in ENV_VARS.items()}
    return Settings(**values)


def markdown_table() -> str:
    """The README environment-variable table, generated from `ENV_VARS`."""
    rows = ["| variable | type | default | allowed values | meaning |",
            "|---|---|---|---|---|"]
    for var in ENV_VARS.values():
        rows.append(f"| `{var.name}` | {var.kind} | `{var.default_text()}` | {var.allowed()} "
                    f"| {var.doc} |")
    return "\n".join(rows)


def readme_section(text: str) -> str | None:
    """The text between the README markers, or None when they are missing."""
    return readme_tables.section(text, README_BEGIN, README_END)


def update_readme(path: str | Path) -> bool:
    """Rewrite the table between the README markers; returns True if the file changed."""
    return readme_tables.update(path, README_BEGIN, README_END, markdown_table())


def _check_settings_match_table() -> None:
    # Guards against adding a variable to the table but not to `Settings` (or vice versa).
    names = [f.name for f in fields(Settings)]
    if names != [field_name(n) for n in ENV_VARS]:
        raise RuntimeError("deepinfer_core.envs: Settings fields and ENV_VARS disagree")


_check_settings_match_table()


def main(argv: list[str] | None = None) -> int:
    return readme_tables.cli("python -m deepinfer_core.envs", "DeepInfer environment variables.", markdown_table,
                             README_BEGIN, README_END, argv, default=_print_settings)


def _print_settings() -> int:
    try:
        settings = read_settings()
    except EnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for var in ENV_VARS.values():
        value = getattr(settings, field_name(var.name))
        if var.kind == "secret" and value is not None:
            value = "<set>"
        print(f"{var.name}={value!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
