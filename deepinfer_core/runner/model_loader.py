"""Model loading: config -> hooks resolved once -> graph on the meta device -> checkpoint (or dummy
weights) -> runtime weights, with the checks that a requested mode is one the chosen hooks provide."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..contracts import (
    DraftVerifier,
    ModelOps,
    PrefillTruncation,
    SchedulingPolicy,
    TokenSampler,
    check_contract,
    resolve_model_ops,
    resolve_proposer,
    resolve_sampler,
    resolve_scheduling,
    resolve_truncation,
)
from ..engine.constraints import LogitsProcessor
from ..engine_config import EngineConfig
from ..model import bind_ops, build_model, process_weights
from ..model.attention import Numerics
from ..model.deepseek_v4 import DeepseekV4Model
from ..plugin_context import BuildContext
from ..plugins import get_plugin_manager

log = logging.getLogger(__name__)


def check_fp4_experts(ops: ModelOps, ctx: BuildContext) -> None:
    """fp4_experts=True was asked for: the chosen MoE method must keep FP4 experts FP4 (None leaves
    the choice to the backend)."""
    if ctx.options.model.fp4_experts is True and not getattr(ops.moe, "fp4_experts", False):
        raise ValueError(f"fp4_experts=True: the MoE method of this platform ({ctx.platform.name}: "
                         f"{type(ops.moe).__qualname__}) cannot keep FP4 experts FP4; the nvidia backend can")


def check_batch_invariant(ops: ModelOps, sampler: TokenSampler) -> None:
    """Batch invariance was asked for: every op object must declare it (`batch_invariant = True`,
    set by the batch_invariant feature plugin), else nothing would make the output invariant."""
    chosen = {**{f"linear method ({f})": m for f, m in ops.linear.items()}, "attention backend": ops.attention,
              "MoE method": ops.moe, "mHC method": ops.mhc, "pointwise method": ops.pointwise, "sampler": sampler}
    missing = [f"{what} {type(op).__module__}.{type(op).__qualname__}" for what, op in chosen.items()
               if not op.batch_invariant]
    if missing:
        from ..plugins import PluginError
        raise PluginError("DEEPINFER_BATCH_INVARIANT=1 (batch_invariant=True), but these ops are not batch "
                          f"invariant: {'; '.join(missing)}. Is the deepinfer-batch-invariant feature installed "
                          "and not disabled (DEEPINFER_DISABLE_PLUGINS / DEEPINFER_PLUGINS)?")


def place_engram(model, device, force_gpu: bool, pointwise) -> None:
    """Engram tables to pinned host memory (a GPU whose pointwise method reads it), else left to
    move with the model; logged with their size."""
    from ..model.engram import engram_storage, place_tables
    storage = engram_storage(device, force_gpu, pointwise)
    size = place_tables(model, storage)
    log.info("Engram tables: %.2f GB in %s memory", size / 1e9,
             "pinned host" if storage == "host" else f"{device} device")


@dataclass
class LoadedModel:
    model: DeepseekV4Model
    ctx: BuildContext
    sampler: TokenSampler
    load_seconds: float
    ops: ModelOps
    logits_processors: list = field(default_factory=list)   # deepinfer_logits_processors, once
    proposer: Any = None        # deepinfer_proposer's drafter factory for this checkpoint, or None
    scheduler_policy: SchedulingPolicy | None = None    # deepinfer_scheduler_policy
    verifier: DraftVerifier | None = None               # deepinfer_verifier
    truncation: PrefillTruncation | None = None         # deepinfer_prefill_truncation (V4.1)


def engine_config(config: EngineConfig | None, options: dict) -> EngineConfig:
    """The config given, or one built from `options` (LLM's keyword arguments; tests and tools)."""
    if config is not None and options:
        raise TypeError(f"pass an EngineConfig or options, not both (got options {sorted(options)})")
    return config if config is not None else EngineConfig.from_options(**options)


def load_model(model_dir: str | Path, config: EngineConfig | None = None, expert_shard=None,
               **options) -> LoadedModel:
    """Config -> hooks -> graph on the meta device -> checkpoint (one shard at a time) -> runtime weights.
    `load_format="dummy"`: the graph on the device, filled with random weights in the checkpoint's format
    (only config.json is read), then the same runtime conversion.
    `expert_shard` (parallel.ep_moe.ExpertShard, an EP rank): read only this rank's experts and bind
    the expert-parallel MoE method; None = every expert, the single-process method."""
    config = engine_config(config, options)
    t0 = time.perf_counter()
    cfg = ModelConfig.from_file(model_dir)
    pm = get_plugin_manager()
    platform = pm.detect_platform()
    device = config.model.device or platform.device_type        # None: the detected platform's device
    ctx = BuildContext(model_config=cfg, platform=platform, device=device, dtype=config.model.dtype,
                       simulate_qat=config.model.simulate_qat, batch_invariant=config.model.batch_invariant,
                       options=config)
    pm.configure(ctx)
    ops = resolve_model_ops(pm, ctx)
    sampler = resolve_sampler(pm, ctx)
    if ctx.batch_invariant:
        check_batch_invariant(ops, sampler)
    logits_processors = [check_contract(p, LogitsProcessor, "logits processor")
                         for p in pm.logits_processors(ctx)]
    proposer = resolve_proposer(pm, ctx)
    scheduler_policy, verifier = resolve_scheduling(pm, ctx)
    truncation = resolve_truncation(pm, ctx)
    check_fp4_experts(ops, ctx)
    skip = None
    if config.model.load_format == "dummy" and expert_shard is None:
        model = build_model(cfg, device=device)       # real buffers on the device, filled in place
    else:
        model = build_model(cfg, device="meta")
        if expert_shard is not None:
            from ..parallel.ep_moe import prune_remote_experts
            skip = prune_remote_experts(model, expert_shard)
    if config.model.load_format == "dummy":
        from ..model.dummy_weights import fill_dummy_weights
        if expert_shard is not None:      # only this rank's experts get memory (the full model may not fit)
            model.to_empty(device=device)
        fill_dummy_weights(model, cfg, seed=config.model.seed)    # seeded per tensor name: rank-independent
    else:
        from ..model.weights import (
            load_checkpoint,  # local: the loader pulls in safetensors
        )
        load_checkpoint(model, model_dir, compute_dtype=ctx.torch_dtype, skip=skip)   # may drop model.mtp
    bind_ops(model, ops, Numerics(dtype=ctx.torch_dtype, simulate_qat=ctx.simulate_qat))
    if expert_shard is not None:      # before process_weights: the wrapped method packs this rank's slots
        from ..parallel.ep_moe import bind_expert_parallel
        bind_expert_parallel(model, expert_shard.placement, expert_shard.ep_rank, expert_shard.ep_size,
                             expert_shard.group, expert_shard.graph_group)
    process_weights(model)
    if cfg.engram is not None:
        place_engram(model, device, config.model.engram_force_gpu_storage, ops.pointwise)
    model.to(device)
    if cfg.engram is not None:
        from ..model.engram import tokenizer_json_for
        model.bind_engram(tokenizer_json_for(model_dir), device)
    return LoadedModel(model=model, ctx=ctx, sampler=sampler, load_seconds=time.perf_counter() - t0, ops=ops,
                       logits_processors=logits_processors, proposer=proposer,
                       scheduler_policy=scheduler_policy, verifier=verifier, truncation=truncation)
