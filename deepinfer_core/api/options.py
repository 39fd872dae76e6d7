"""Defaults of the engine options `LLM(**options)` owns: one table for the LLM and the CLI's help
(kept free of torch so `python -m deepinfer_core.generate --help` stays fast)."""
from __future__ import annotations

LLM_OPTION_DEFAULTS = {
    "max_num_batched_tokens": 8192,   # token budget of one step (prefill chunks + decodes)
    "max_num_seqs": 256,              # sequences per step = state-cache slots
    "decode_sequence": False,         # DS-DeepInfer compat: generate returns strings
    "num_cache_blocks": None,         # exact paged-block count (overrides the byte budget)
    "kv_cache_memory_bytes": None,    # state-cache byte budget
    "gpu_memory_utilization": 0.9,    # CUDA: fraction of device memory the engine may use
    "async_scheduling": None,         # None = DEEPINFER_ZERO_OVERHEAD_SCHEDULING
}
