"""One engine configuration, resolved once: `EngineConfig.from_options(**LLM kwargs)`.

Every engine option is a field of one of the frozen sections below (model, cache, scheduler,
parallel, speculative, observability), declared once with its default, its allowed values and a
one-line doc. `from_options` validates each value (a ValueError naming the field and the allowed
values), fills the defaults that come from the environment (`envs.read_settings()`, read here once)
and refuses what the engine does not implement; the result is passed down to the runner and the
plugins (`BuildContext.options`), so nothing below reads the environment. The CLI's engine flags and
the option table of docs/configuration.md are generated from these fields
(`python -m deepinfer_core.engine_config --markdown`).

Kept free of torch at module level: `python -m deepinfer_core.generate --help` imports it.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from . import readme_tables
from .config_fields import (
    BOOL,
    NO_SPECULATIVE,
    SINGLE_GPU,
    TABLE_DEFAULTS,
    UTILIZATION,
    Rule,
    Section,
    choice,
    env_bool,
    env_if_set,
    env_option,
    is_int,
    normalize_dtype,
    only,
    option,
    path_or_none,
    positive,
    str_or_none,
)
from .envs import read_settings

README_BEGIN = "<!-- options:begin -->"
README_END = "<!-- options:end -->"
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")
LOAD_FORMATS = ("auto", "dummy")
LAUNCHERS = ("spawn", "torchrun")
DEFAULT_NUM_DRAFTS = TABLE_DEFAULTS.use_nextn_decode    # DS-DeepInfer's gamma, for checkpoints that draft


# ---- the sections -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelOptions(Section):
    """The checkpoint, its numerics and where it runs."""

    model: str | None = env_option("DEEPINFER_HF_MODEL_DIR", "checkpoint directory, Hugging Face cache snapshot, "
                             "or repo id in the local HF cache", path_or_none("= DEEPINFER_HF_MODEL_DIR"))
    tokenizer: str | None = option(None, "tokenizer directory",
                                 path_or_none("the model's"))
    dtype: str = option("float32", "compute dtype; 'auto' = bfloat16",
                      Rule("'float32', 'bfloat16', 'auto' (= bfloat16), torch.float32, torch.bfloat16",
                           convert=normalize_dtype))
    simulate_qat: bool = option(True, "DeepSeek's inference numerics: FP8/FP4 activation rounding and the official code's rounding order (docs/numerics.md); False: clean float math", BOOL)
    seed: int = option(0, "seeds the requests that set no seed of their own (with a request counter)",
                     Rule("an int", is_int))
    max_model_len: int | None = option(None, "maximum prompt + output tokens per request",
                                     positive("= the model's max_position_embeddings"))
    device: str | None = option(None, "torch device of the weights and the state cache",
                              str_or_none("the detected platform's device"))
    load_format: str = option("auto", "'auto' loads the checkpoint's safetensors; 'dummy' fills random "
                            "weights of config.json's shape on the device (benchmarks; no weights on disk)",
                            choice(*LOAD_FORMATS))
    batch_invariant: bool = env_option("DEEPINFER_BATCH_INVARIANT", "batch-invariant kernels: a request's logits "
                                 "and tokens do not depend on its batch or its prefill chunking")
    enforce_eager: bool = env_option("DEEPINFER_ENFORCE_EAGER",
                               "CUDA: never capture decode/verification CUDA graphs")
    yoco_prefill_truncation_mode: str = env_option(
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "V4.1 SWA bounded replay (the swa_replay feature): 'off' "
        "= exact; 'mask' / 'compact' = the YOCO consumer layers' windows see only the prompt's last "
        "yoco_prefill_keep_tokens tokens ('compact' also skips the earlier rows there: faster prefill, "
        "no prompt_logprobs)", choice("off", "mask", "compact"))
    yoco_prefill_keep_tokens: int = env_option(
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "V4.1 bounded replay: the prompt suffix the consumer layers "
        "replay (>= sliding_window + max_backtracking_tokens)", positive())
    engram_force_gpu_storage: bool = env_option(
        "DEEPINFER_ENGRAM_FORCE_GPU_STORAGE", "V4.1 Engram: keep the n-gram tables in device memory "
        "(default on CUDA: pinned host memory, gathered by the backend without a copy or a sync)")
    fp4_experts: bool | None = option(
        None, "nvidia backend: keep the checkpoint's FP4 routed experts FP4 and decode them in the MoE "
        "kernels (same results as their FP8 re-encoding at load, with about half the expert bytes); None "
        "= the backend's default for the GPU (off until its compiled suite has passed with them); True "
        "is refused on backends that cannot", Rule("True, False or None", lambda v: v is None or isinstance(v, bool)))


@dataclass(frozen=True)
class CacheOptions(Section):
    """The paged state cache: its size (the first of these set wins) and its storage."""

    num_cache_blocks: int | None = option(None, "an exact number of 128-position blocks (tests, tools)",
                                        positive("sized from the byte budget"))
    kv_cache_memory_bytes: int | None = option(
        None, "an explicit state-cache budget in bytes (any device)",
        positive("gpu_memory_utilization on CUDA, cpu_kv_cache_bytes on CPU"))
    gpu_memory_utilization: float = option(0.9, "CUDA: the fraction of device memory the engine may use; the "
                                         "cache gets what is left after the weights, other users and one "
                                         "profiled step's activations", UTILIZATION)
    cpu_kv_cache_bytes: int = env_option("DEEPINFER_CPU_KV_CACHE_BYTES", "the state-cache budget in bytes on the "
                                   "CPU when kv_cache_memory_bytes is unset",
                                   Rule("an int >= 1, or None (= DEEPINFER_CPU_KV_CACHE_BYTES)",
                                        lambda v: is_int(v) and v >= 1))
    kv_cache_dtype: str = option("auto", "storage of window and compressed KV rows: 'auto'/'bfloat16' = the "
                               "model dtype; 'fp8' = e4m3 no-RoPE dims with a power-of-two scale per 64 + "
                               "bf16 RoPE dims (35% fewer cache bytes; lossless with the QAT simulation; "
                               "needs dtype bfloat16)", choice(*KV_CACHE_DTYPES))
    max_backtracking_tokens: int = env_option(
        "DEEPINFER_MAX_BACKTRACKING_TOKENS", "rollback room in the sliding-window rings (tokens a "
        "verification step may reject)",
        Rule("an int >= 0, or None (= max(DEEPINFER_MAX_BACKTRACKING_TOKENS, DEEPINFER_USE_NEXTN_DECODE + 1))",
             lambda v: is_int(v) and v >= 0),
        setting="effective_max_backtracking_tokens")
    enable_prefix_caching: bool | None = option(
        None, "reuse the cached state of a prompt's longest cached prefix (blocks shared by content, the "
        "window state restored from a checkpoint): exact, the outputs are those of a run without it; "
        "None = on unless an option it cannot serve exactly is set (V4.1's yoco_prefill_truncation_mode "
        "'mask' or 'compact')", Rule("True, False or None", lambda v: v is None or isinstance(v, bool)))
    prefix_checkpoint_interval: int = option(
        0, "prefix caching: also keep a checkpoint every this many positions of a long prompt (0: only at "
        "prompt ends, output ends and shared-prefix junctions)",
        Rule("0 or a multiple of 128", lambda v: is_int(v) and v >= 0 and v % 128 == 0))
    prefix_checkpoint_slots: int | None = option(
        None, "prefix caching: state slots kept for checkpoints (each holds one sequence's window rings "
        "and compressor tails; counted in the cache budget)", positive("2 x max_num_seqs"))


@dataclass(frozen=True)
class SchedulerOptions(Section):
    """Continuous batching: what one step may hold."""

    max_num_seqs: int = option(256, "sequences per step; also the number of state slots (rings, compressor "
                             "tails)", positive())
    max_num_batched_tokens: int = option(8192, "tokens per step: decodes plus prefill chunks (longer prompts "
                                       "are chunked)", positive())
    async_scheduling: bool = env_option("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "overlap the host work of step N "
                                  "with the device forward of step N+1")


@dataclass(frozen=True)
class ParallelOptions(Section):
    """Data parallelism (engine processes: one GPU each over NCCL, or CPU ranks over gloo; on one host, or
    over several under torchrun) with the routed experts optionally sharded over them (expert parallelism)
    and rebalanced (EPLB); every other size is 1."""

    tensor_parallel_size: int = option(1, "devices the weights are split over", only(1, SINGLE_GPU))
    pipeline_parallel_size: int = option(1, "pipeline stages", only(1, SINGLE_GPU))
    data_parallel_size: int = option(1, "engine processes (attention data parallel; on this host, or over nodes: "
                                   "launcher), stepping in lockstep; > 1: rank r on GPU r (under torchrun: GPU "
                                   "LOCAL_RANK; NCCL, CUDA graphs off under expert parallelism) or CPU ranks over "
                                   "gloo; MTP speculation only when num_speculative_tokens is set (unset = 0)",
                                   positive())
    engine_process: bool | None = option(None, "run the engine (scheduler, model, sampler) in a child process "
                                       "while this process keeps the tokenizer and the request front end, so "
                                       "Python work here (an HTTP server's) never holds the GIL the engine's "
                                       "host path needs; None = the server's choice (on for a CUDA device, "
                                       "see docs/serving.md), elsewhere only when data_parallel_size > 1 (its "
                                       "ranks are always processes)", Rule("True, False or None",
                                                                     lambda v: v is None or isinstance(v, bool)))
    launcher: str = option("spawn", "how the data_parallel_size ranks start: 'spawn' = this process starts them on "
                         "this host; 'torchrun' = one torchrun process per rank (any number of nodes, the same "
                         "command on every one, WORLD_SIZE = data_parallel_size): global rank 0 is the front end "
                         "(its engine in a child process), every other rank runs its engine inside LLM(...), "
                         "which then exits that process (code after LLM(...) runs on rank 0 only)",
                         choice(*LAUNCHERS))
    enable_expert_parallel: bool = option(False, "shard the routed experts over the data_parallel_size ranks "
                                        "(each loads only its own); False replicates them on every rank", BOOL)
    enable_eplb: bool = option(False, "expert-parallel load balancing: count each expert's routed tokens and "
                             "periodically move the hot experts' replicas (needs enable_expert_parallel)", BOOL)
    num_redundant_experts: int = option(0, "extra physical expert slots holding replicas of hot experts, rounded "
                                      "up to a multiple of data_parallel_size (needs enable_expert_parallel)",
                                      Rule("an int >= 0", lambda v: is_int(v) and v >= 0))
    enable_ep_cuda_graphs: bool = option(False, "GPU ranks with expert parallelism: decode steps replay CUDA "
                                       "graphs holding fixed-size expert exchanges (the ranks agree on one "
                                       "batch bucket per step); False runs them eagerly. Not yet run on GPUs",
                                       BOOL)
    eplb_window_size: int = option(1000, "EPLB: the load statistics cover this many recent steps", positive())
    eplb_step_interval: int = option(3000, "EPLB: steps between two rearrangements", positive())
    eplb_stat_interval: int = option(128, "EPLB: steps between two balance readings (moe_lb = sum over steps and "
                                   "layers of the busiest rank's tokens / the ranks' mean, >= 1; logged and in "
                                   "each rank's stats)", positive())
    expert_parallel_size: int = option(1, "devices the routed experts are split over",
                                     only(1, "set enable_expert_parallel instead: the experts are then split "
                                              "over the data_parallel_size ranks"))
    context_parallel_size: int = option(1, "devices a long prompt is split over", only(1, SINGLE_GPU))
    engram_parallel_size: int = option(1, "DS-DeepInfer's engram parallelism", only(1, SINGLE_GPU))

    def __post_init__(self) -> None:
        super().__post_init__()
        # Settings that would do nothing are refused, never ignored.
        dp, ep = self.data_parallel_size, self.enable_expert_parallel
        if self.engine_process is False and dp > 1:
            raise ValueError(f"engine_process=False with data_parallel_size={dp}: data-parallel ranks always run "
                             "in processes of their own; allowed: engine_process=True or None")
        if self.launcher == "torchrun" and dp == 1:
            raise ValueError("launcher='torchrun' with data_parallel_size=1: torchrun starts the data-parallel "
                             "ranks, and one rank has none to start; allowed: data_parallel_size >= 2 (= torchrun's "
                             "WORLD_SIZE), or launcher='spawn'")
        if ep and dp == 1:
            raise ValueError("enable_expert_parallel=True with data_parallel_size=1: one rank holds every expert, "
                             "there is nothing to shard; set data_parallel_size >= 2")
        if self.enable_eplb and not ep:
            raise ValueError("enable_eplb=True needs enable_expert_parallel=True (EPLB moves expert replicas "
                             "between the expert-parallel ranks)")
        if self.enable_ep_cuda_graphs and not ep:
            raise ValueError("enable_ep_cuda_graphs=True needs enable_expert_parallel=True (it captures the "
                             "expert-parallel exchanges in the decode graphs)")
        if self.num_redundant_experts and not ep:
            raise ValueError(f"num_redundant_experts={self.num_redundant_experts} needs enable_expert_parallel=True "
                             "(replicas are extra slots of the sharded experts); allowed without it: 0")
        defaults = {f.name: f.default for f in fields(self)}
        for name in ("eplb_window_size", "eplb_step_interval", "eplb_stat_interval"):
            if not self.enable_eplb and getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} needs enable_eplb=True; allowed without it: "
                                 f"{defaults[name]!r} (the default)")

    @property
    def in_processes(self) -> bool:
        """The engine runs in child processes (data-parallel ranks, or the one engine process)."""
        return self.data_parallel_size > 1 or bool(self.engine_process)


@dataclass(frozen=True)
class SpeculativeOptions(Section):
    """Speculative decoding with the checkpoint's MTP block as the drafter: gamma drafts per step, all
    verified, or (enable_mtp_varlen) as many as the confidences and the step times make worth it."""

    num_speculative_tokens: int | None = env_if_set(
        "DEEPINFER_USE_NEXTN_DECODE", "draft tokens verified per request per step (gamma, MTP-gamma); 0 = "
        "no speculation", Rule("an int >= 0, or None (= DEEPINFER_USE_NEXTN_DECODE when set, else "
                               f"{DEFAULT_NUM_DRAFTS} when the checkpoint has mtp.* tensors, else 0)",
                               lambda v: v is None or (is_int(v) and v >= 0)))
    speculative_config: dict[str, Any] | None = option(None, "vLLM's speculative-decoding settings",
                                                     only(None, NO_SPECULATIVE))
    confidence_head_temperature: tuple[float, ...] | None = env_if_set(
        "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "DSpark confidence head calibration temperature(s): one, or "
        "one per draft position", Rule("None (= DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE when set, else the "
                                       "checkpoint's dspark_confidence_temperatures, else 1.0), or a tuple of numbers "
                                       "> 0 (one, or one per draft position)",
                                       lambda v: v is None or isinstance(v, (tuple, list)) and len(v) > 0 and all(
                                           isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                                           for x in v), lambda v: v if v is None else tuple(v)))
    enable_mtp_varlen: bool = env_option("DEEPINFER_ENABLE_MTP_VARLEN", "confidence-scheduled verification: the "
                                   "drafts verified per step follow the drafter's confidences and the step times "
                                   "profiled at start-up (False: every draft)",
                                   env_bool("DEEPINFER_ENABLE_MTP_VARLEN"))


@dataclass(frozen=True)
class ObservabilityOptions(Section):
    """No option yet: the engine logs no periodic stats (vLLM's disable_log_stats=False is refused)."""


SECTIONS: dict[str, type] = {"model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions,
                             "parallel": ParallelOptions, "speculative": SpeculativeOptions,
                             "observability": ObservabilityOptions}

# vLLM / DS-DeepInfer spellings that are no field: name -> (the values accepted because they are what
# the engine does anyway, what it does). Any other value is a ValueError saying so; never ignored.
COMPAT_OPTIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "enable_chunked_prefill": ((True, None), "prefill is always chunked under max_num_batched_tokens"),
    "chunked_prefill": ((True, None), "prefill is always chunked under max_num_batched_tokens"),
    "trust_remote_code": ((True, False, None), "the model code is built in; no checkpoint code ever runs"),
    "revision": ((None, "main"), "a repo id resolves to the local cache snapshot refs/main points at"),
    "tokenizer_revision": ((None, "main"), "the tokenizer is read from a local directory"),
    "tokenizer_mode": (("auto", None), "the checkpoint's tokenizer.json (a fast tokenizer) is used"),
    "swap_space": ((0, None), "a preempted sequence is recomputed; nothing is swapped to the host"),
    "cpu_offload_gb": ((0, None), "weights are never offloaded to the host"),
    "disable_log_stats": ((True, None), "the engine logs no periodic stats (not implemented yet)"),
    "served_model_name": ((None,), "a server option: deepinfer serve --served-model-name"),
    "stop_preempted_request": ((False, None), "a preempted request is recomputed, never stopped"),
    "offline_inference": ((True, None), "LLM is offline inference; deepinfer serve serves online"),
    "disable_custom_all_reduce": ((True, False, None), "one device: there is no all-reduce to customise"),
    "ignore_len": ((False, None), "prompt + output lengths are always held to max_model_len"),
    "tokens_per_block": ((128, None), "state-cache blocks hold 128 positions"),
    "lookahead_tokens": ((0, None), "verify chunks take their blocks when scheduled; no lookahead slots"),
    "compilation_config": ((None,), "CUDA graphs are the engine's own; enforce_eager turns them off"),
    "quantization": ((None,), "weights run in the checkpoint's own FP8/FP4 format"),
    "engine_type": ((None,), "there is one engine type"),
    "engine_rank": ((0, None), "one engine in one process: rank 0"),
    "engine_group_rank": ((0, None), "one engine in one process: rank 0"),
}


def _accepts(accepted: tuple[Any, ...], value: Any) -> bool:
    return any(type(value) is type(a) and value == a for a in accepted)   # True is not 1


def option_fields() -> Iterator[tuple[str, str | None, dataclasses.Field, Any]]:
    """(option name, section or None for EngineConfig's own, the field, its type) of every option."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            yield f.name, section, f, hints[f.name]
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        if f.name not in SECTIONS:
            yield f.name, None, f, hints[f.name]


# ---- the config -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineConfig(Section):
    """Every engine option, resolved. Build it with `from_options`; `replace` for a changed copy."""

    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)
    decode_sequence: bool = option(False, "DS-DeepInfer compat: generate returns one string per prompt", BOOL)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache.kv_cache_dtype == "fp8" and self.model.dtype != "bfloat16":
            raise ValueError(f"kv_cache_dtype='fp8' needs dtype='bfloat16' (the RoPE dims stay bf16), "
                             f"got dtype={self.model.dtype!r}")
        drafts = self.speculative.num_speculative_tokens
        self._check_data_parallel()
        if self.speculative.enable_mtp_varlen and self.model.batch_invariant:
            raise ValueError("enable_mtp_varlen=True (DEEPINFER_ENABLE_MTP_VARLEN=1) with batch_invariant=True "
                             "(DEEPINFER_BATCH_INVARIANT=1): the verified draft length would follow the load, "
                             "so a seeded request's tokens would too; turn one of them off")
        if self.speculative.enable_mtp_varlen and drafts == 0:
            raise ValueError("enable_mtp_varlen=True (DEEPINFER_ENABLE_MTP_VARLEN=1) schedules draft verification, "
                             "but num_speculative_tokens=0 (DEEPINFER_USE_NEXTN_DECODE=0) turns speculation off")
        if drafts is not None and drafts + 1 > self.cache.max_backtracking_tokens:
            raise ValueError(f"num_speculative_tokens={drafts} (DEEPINFER_USE_NEXTN_DECODE) needs "
                             f"max_backtracking_tokens >= {drafts + 1} (DEEPINFER_MAX_BACKTRACKING_TOKENS): a "
                             f"verify step may roll back that many tokens; got {self.cache.max_backtracking_tokens}")

    def _check_data_parallel(self) -> None:
        """What data_parallel_size > 1 cannot run with yet (the DP engine: parallel/dp_engine.py)."""
        dp = self.parallel.data_parallel_size
        if dp == 1:
            return
        device = self.model.device
        if device not in (None, "cpu", "cuda", "npu"):
            raise ValueError(f"data_parallel_size={dp} with device={device!r}: rank r runs on GPU r (or "
                             "NPU r) of this host or on the CPU; allowed with data_parallel_size > 1: "
                             "device='cpu', 'cuda', 'npu' or None (the detected platform's)")
        # MTP speculation pairs up: a speculating rank's step launches one verify forward through the main
        # (expert-parallel) layers; the MTP block drafts with its own, local experts (no collective). VARLEN
        # too: every rank profiles the same forwards at start-up and they share one table (dp_worker.py).

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Validate the options, fill the unset env-backed ones from the env table (read once here)."""
        options = dict(options)
        for name in [n for n in options if n in COMPAT_OPTIONS]:
            accepted, what = COMPAT_OPTIONS[name]
            value = options.pop(name)
            if not _accepts(accepted, value):
                raise ValueError(f"{name}={value!r} is not supported: {what}; allowed: "
                                 f"{', '.join(map(repr, accepted))}")
        known = {name: (section, f) for name, section, f, _ in option_fields()}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; accepted: {sorted(known)} (and, with "
                            f"the values this engine implements: {sorted(COMPAT_OPTIONS)})")
        settings = read_settings()
        parts: dict[str | None, dict[str, Any]] = {}
        for name, (section, f) in known.items():
            value = options.get(name)
            if f.metadata["env"] is not None and value is None:
                value = getattr(settings, f.metadata["setting"])
            elif value is None and os.environ.get(f.metadata.get("env_if_set") or "", "").strip():
                value = getattr(settings, f.metadata["setting"])
            elif name not in options:
                continue
            parts.setdefault(section, {})[name] = value
        top = parts.pop(None, {})
        drafts = parts["speculative"].get("num_speculative_tokens")
        if is_int(drafts) and drafts >= 0 and options.get("max_backtracking_tokens") is None:
            # the room the env table reserves follows DEEPINFER_USE_NEXTN_DECODE; an option's gamma too
            cache = parts["cache"]        # (a bad value is refused by the section's validation)
            if is_int(cache["max_backtracking_tokens"]):
                cache["max_backtracking_tokens"] = max(cache["max_backtracking_tokens"], drafts + 1)
        return cls(**{s: cls_(**parts.get(s, {})) for s, cls_ in SECTIONS.items()}, **top)

    def as_options(self) -> dict[str, Any]:
        """The flat `LLM(**options)` form of this config."""
        return {name: getattr(getattr(self, section) if section else self, name)
                for name, section, _, _ in option_fields()}

    def replace(self, **options: Any) -> "EngineConfig":
        """A copy with some options changed (flat names, validated as in `from_options`)."""
        return EngineConfig.from_options(**{**self.as_options(), **options})

    def with_model_limit(self, max_position_embeddings: int) -> "EngineConfig":
        """`max_model_len` resolved against the checkpoint: None -> its max_position_embeddings."""
        limit, value = int(max_position_embeddings), self.model.max_model_len
        if value is None:
            value = limit
        elif value > limit:
            raise ValueError(f"max_model_len={value!r}; allowed: 1..{limit} (max_position_embeddings) "
                             f"or None")
        return dataclasses.replace(self, model=dataclasses.replace(self.model, max_model_len=value))


# ---- the README table -------------------------------------------------------------------------------
def _default_text(f: dataclasses.Field) -> str:
    default = f.default if f.default is not dataclasses.MISSING else None
    return f"{default!r} (`{f.metadata['env']}`)" if f.metadata["env"] else repr(default)


def markdown_table() -> str:
    """The README's engine-option tables, generated from the fields and `COMPAT_OPTIONS`."""
    rows = ["| option | config | default | allowed values | meaning |", "|---|---|---|---|---|"]
    for name, section, f, _ in option_fields():
        path = f"{section}.{name}" if section else name
        rows.append(f"| `{name}` | `{path}` | {_default_text(f)} | {f.metadata['rule'].allowed} "
                    f"| {f.metadata['doc']} |")
    rows += ["", "vLLM / DS-DeepInfer spellings, accepted only with the values this engine implements (any "
             "other value is a `ValueError` saying why):", "",
             "| option | accepted values | why |", "|---|---|---|"]
    for name, (accepted, what) in COMPAT_OPTIONS.items():
        rows.append(f"| `{name}` | {', '.join(f'`{a!r}`' for a in accepted)} | {what} |")
    return "\n".join(rows)


def update_readme(path: str | Path) -> bool:
    """Rewrite the tables between the README markers; True if the file changed."""
    return readme_tables.update(path, README_BEGIN, README_END, markdown_table())


def main(argv: list[str] | None = None) -> int:
    return readme_tables.cli("python -m deepinfer_core.engine_config", "DeepInfer engine options.", markdown_table,
                             README_BEGIN, README_END, argv)


if __name__ == "__main__":
    sys.exit(main())
