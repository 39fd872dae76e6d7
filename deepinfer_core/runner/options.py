"""What the runner resolves from the engine options against the checkpoint at start-up: how the
state cache stores window and compressed rows (kv_fp8) and how many draft tokens a step verifies.
Plain functions of their arguments (tests call them without a model).
"""
from __future__ import annotations

import logging

import torch

from ..engine_config import DEFAULT_NUM_DRAFTS, KV_CACHE_DTYPES

log = logging.getLogger("deepinfer_core.runner.model_runner")    # said as the runner (as before)


def resolve_kv_fp8(kv_cache_dtype: str, dtype: torch.dtype, simulate_qat: bool,
                   family: str = "v4") -> bool:
    """Whether window rings and compressed rows are stored as packed FP8 (`ops.kv_fp8`).

    "auto" (as in vLLM) keeps the model dtype; "bfloat16" says so explicitly. "fp8" stores 584 B
    instead of 1024 B per 512-wide row (35% fewer cache bytes per token for V4-Flash): lossless
    with the QAT simulation, which fake-quantises those rows to exactly these FP8 values before
    caching, a real extra quantisation without it. Not the default yet: the attention kernel's
    dequantising loads make prefill attention about 2x slower on the H200 (docs/performance.md)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; allowed: "
                         f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
    if kv_cache_dtype == "fp8" and dtype != torch.bfloat16:
        raise ValueError(f"kv_cache_dtype='fp8' needs dtype='bfloat16' (the RoPE dims stay bf16), "
                         f"got {dtype}")
    if kv_cache_dtype == "fp8" and family != "v4":
        # V4.1 rounds its compressed rows to FP4 (or MXFP8): V4's packed layout would round again
        raise ValueError(f"kv_cache_dtype='fp8' is V4's packed row layout; a {family} model allows "
                         f"'auto' or 'bfloat16'")
    return kv_cache_dtype == "fp8"


def resolve_num_drafts(requested: int | None, num_mtp_blocks: int,
                       dspark_block: int | None = None) -> int:
    """Draft tokens per request per step. Unset: the DSpark block size when the checkpoint's drafter
    is DSpark (`dspark_block`), DS-DeepInfer's default when it is an MTP block, else none, said once
    here. Asked for without a drafter: an error."""
    if requested is None:
        if num_mtp_blocks:
            return dspark_block or DEFAULT_NUM_DRAFTS
        log.info("the checkpoint has no drafter tensors (mtp.*): decoding without speculation "
                 "(DEEPINFER_USE_NEXTN_DECODE=0 says so explicitly)")
        return 0
    if requested and not num_mtp_blocks:
        raise ValueError(f"num_speculative_tokens={requested} (DEEPINFER_USE_NEXTN_DECODE) asks "
                         "for drafts, but the checkpoint has no drafter (mtp.* tensors); set it to "
                         "0 to decode without speculation")
    return requested


def no_dspark_plugin(requested: int | None) -> int:
    """A DSpark checkpoint without the dspark feature plugin: no drafter to draft with."""
    if requested:
        raise ValueError(f"num_speculative_tokens={requested} (DEEPINFER_USE_NEXTN_DECODE) asks "
                         "for drafts, but the checkpoint's drafter is DSpark and the "
                         "deepinfer-dspark feature plugin is not installed or is disabled "
                         "(DEEPINFER_DISABLE_PLUGINS / DEEPINFER_PLUGINS); set it to 0")
    if requested is None:
        log.info("the checkpoint's drafter is DSpark, but the deepinfer-dspark feature plugin is "
                 "not loaded: decoding without speculation")
    return 0
