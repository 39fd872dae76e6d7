"""An online `Engine` assembled over a built runner from the `EngineConfig`: the state cache sized
(with the prefix cache's checkpoint slots), the scheduler, its prefix cache, the speculator.

`LLM.engine` builds its engine here, and so does each data-parallel rank (parallel/dp_worker.py),
which therefore needs no `LLM`.
"""
from __future__ import annotations

from typing import Any

from ..cache.block_allocator import BlockAllocator
from ..cache.budget import CacheRequest
from ..cache.prefix_cache import PrefixCache
from ..engine.engine import Engine
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..engine_config import EngineConfig


def checkpoint_slots(config: EngineConfig) -> int:
    """State slots kept for prefix-cache checkpoints (0 with prefix caching off)."""
    cache = config.cache
    if not cache.enable_prefix_caching:
        return 0
    n = cache.prefix_checkpoint_slots
    return 2 * config.scheduler.max_num_seqs if n is None else n


def cache_request(config: EngineConfig) -> CacheRequest:
    cache = config.cache
    return CacheRequest(num_slots=config.scheduler.max_num_seqs, checkpoint_slots=checkpoint_slots(config),
                        num_blocks=cache.num_cache_blocks, memory_bytes=cache.kv_cache_memory_bytes,
                        gpu_memory_utilization=cache.gpu_memory_utilization,
                        max_model_len=config.model.max_model_len, cpu_memory_bytes=cache.cpu_kv_cache_bytes)


def allocator(runner: Any, config: EngineConfig) -> BlockAllocator:
    """The runner's cache allocator (sized on first use, re-sized when the options change)."""
    runner.profile_tokens = config.scheduler.max_num_batched_tokens
    return runner.allocate_cache(cache_request(config)).allocator


def prefix_cache(runner: Any, config: EngineConfig, blocks: BlockAllocator) -> PrefixCache | None:
    """The scheduler's prefix cache, keyed by what besides the tokens decides the cached state."""
    cache, model = config.cache, config.model
    if not cache.enable_prefix_caching:
        return None
    truncation = getattr(runner, "truncation", None)
    if truncation is not None and truncation.mode != "off":
        raise ValueError(f"enable_prefix_caching=True with yoco_prefill_truncation_mode="
                         f"{truncation.mode!r}: a prefill truncated to its last tokens leaves no exact "
                         f"window state to cache; allowed together: yoco_prefill_truncation_mode='off'")
    salt = (model.model, str(runner.dtype), model.simulate_qat, cache.kv_cache_dtype, model.batch_invariant)
    return PrefixCache(blocks, runner.cache.layout.block_size, checkpoint_slots(config),
                       cache.prefix_checkpoint_interval, salt)


def build_engine(runner: Any, tokenizer: Any, config: EngineConfig,
                 blocks: BlockAllocator | None = None) -> Engine:
    """An engine over `runner` (`blocks`: its allocator when the caller sized the cache already);
    `config` with max_model_len resolved (`EngineConfig.with_model_limit`)."""
    blocks = blocks if blocks is not None else allocator(runner, config)
    sched = config.scheduler
    cfg = SchedulerConfig(max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                          max_model_len=config.model.max_model_len)
    engine = Engine(runner, runner.sampler,
                    Scheduler(cfg, blocks, runner.scheduler_policy, prefix_cache(runner, config, blocks)),
                    tokenizer, max_model_len=config.model.max_model_len, async_scheduling=sched.async_scheduling,
                    seed=config.model.seed, logits_processors=list(runner.logits_processors),
                    speculator=runner.make_speculator())
    if config.speculative.enable_mtp_varlen:
        engine.use_varlen(runner.varlen_policy(sched.max_num_seqs))
    return engine
