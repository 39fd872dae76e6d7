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


def prefix_caching(runner: Any, config: EngineConfig) -> bool:
    """Whether the engine caches prefixes: `enable_prefix_caching`, or where it is None (the
    default) wherever caching is exact. V4.1's prefill truncation ('mask', 'compact') leaves no
    exact window state to cache: None turns caching off there, True is refused."""
    asked = config.cache.enable_prefix_caching
    truncation = getattr(runner, "truncation", None)
    mode = truncation.mode if truncation is not None else "off"
    if asked and mode != "off":
        raise ValueError(f"enable_prefix_caching=True with yoco_prefill_truncation_mode={mode!r}: "
                         f"a prefill truncated to its last tokens leaves no exact window state to "
                         f"cache; allowed together: yoco_prefill_truncation_mode='off'")
    return mode == "off" if asked is None else asked


# unset prefix_checkpoint_slots: 2 x max_num_seqs, within this share of a byte budget (a V4-Flash
# checkpoint is 19 MiB: 512 of them would take 9.5 GiB)
CHECKPOINT_SHARE = 0.1


def cache_request(runner: Any, config: EngineConfig) -> CacheRequest:
    cache, seqs = config.cache, config.scheduler.max_num_seqs
    asked = cache.prefix_checkpoint_slots
    checkpoints = 0 if not prefix_caching(runner, config) else 2 * seqs if asked is None else asked
    return CacheRequest(num_slots=seqs, checkpoint_slots=checkpoints,
                        checkpoint_share=CHECKPOINT_SHARE if asked is None else None,
                        num_blocks=cache.num_cache_blocks, memory_bytes=cache.kv_cache_memory_bytes,
                        gpu_memory_utilization=cache.gpu_memory_utilization,
                        max_model_len=config.model.max_model_len, cpu_memory_bytes=cache.cpu_kv_cache_bytes)


def allocator(runner: Any, config: EngineConfig) -> BlockAllocator:
    """The runner's cache allocator (sized on first use, re-sized when the options change)."""
    runner.profile_tokens = config.scheduler.max_num_batched_tokens
    return runner.allocate_cache(cache_request(runner, config)).allocator


def prefix_cache(runner: Any, config: EngineConfig, blocks: BlockAllocator) -> PrefixCache | None:
    """The scheduler's prefix cache, keyed by what besides the tokens decides the cached state."""
    cache, model = config.cache, config.model
    if not prefix_caching(runner, config):
        return None
    salt = (model.model, str(runner.dtype), model.simulate_qat, cache.kv_cache_dtype, model.batch_invariant)
    return PrefixCache(blocks, runner.cache.layout.block_size, runner.checkpoint_slots,
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
