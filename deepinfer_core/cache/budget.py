"""How many paged blocks the state cache gets: from an explicit block count, an explicit byte budget,
`gpu_memory_utilization` of an accelerator (the free and total bytes its torch module's `mem_get_info`
reports: torch.cuda, torch.npu, ...), or the CPU byte budget (`EngineConfig.cache`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config_fields import validate_utilization
from ..device_module import memory_query
from ..envs import ENV_VARS
from .state_cache import CacheLayout


@dataclass(frozen=True)
class CacheRequest:
    """What the user asked for; the first field that is set wins (in this order)."""

    num_slots: int                              # = max_num_seqs
    checkpoint_slots: int = 0                   # prefix caching's checkpoints (more slots of the same size)
    checkpoint_share: float | None = None       # those at most this share of a byte budget
    num_blocks: int | None = None               # exact block count (tests, tools)
    memory_bytes: int | None = None             # LLM(kv_cache_memory_bytes=...)
    gpu_memory_utilization: float = 0.9         # fraction of the whole device the engine may use
    max_model_len: int | None = None            # caps the blocks at what that many full sequences need
    # the budget on the CPU when memory_bytes is unset: config.cache.cpu_kv_cache_bytes (this default is
    # the env table's, for tools that size a cache without a config)
    cpu_memory_bytes: int = ENV_VARS["DEEPINFER_CPU_KV_CACHE_BYTES"].default


def resolve_num_blocks(layout: CacheLayout, req: CacheRequest, device: str,
                       activation_bytes: Callable[[], int] = lambda: 0) -> tuple[int, int, str]:
    """(number of blocks, number of checkpoint slots, one line saying where the figures came
    from)."""
    if req.num_blocks is not None:
        return req.num_blocks, req.checkpoint_slots, f"num_cache_blocks={req.num_blocks}"
    detail = ""                                  # the device figures behind the budget, for the log line
    query = None if req.memory_bytes is not None else memory_query(device)
    if req.memory_bytes is not None:
        budget, name = req.memory_bytes, "kv_cache_memory_bytes"
    elif query is not None:                      # an accelerator: torch.cuda / torch.npu / ...
        util = validate_utilization(req.gpu_memory_utilization)
        free, total = query(device)
        used = total - free                    # weights, other processes, the device runtime's context
        act = activation_bytes()
        budget = int(util * total) - used - act
        name = "gpu_memory_utilization"
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={util}: {util * total / 2**30:.2f} GiB allowed but "
                             f"{used / 2**30:.2f} GiB are in use and one step's activations need "
                             f"{act / 2**30:.2f} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens")
        detail = f" ({used / 2**30:.2f} GiB in use, {act / 2**30:.2f} GiB activations)"
    else:
        budget, name = req.cpu_memory_bytes, "cpu_kv_cache_bytes"
        detail = " (DEEPINFER_CPU_KV_CACHE_BYTES)"
    note = f"{name}{detail}: {budget} bytes"
    checkpoints = req.checkpoint_slots
    share = req.checkpoint_share
    if share is not None and checkpoints * layout.slot_bytes > share * budget:
        checkpoints = max(1, int(share * budget) // layout.slot_bytes)
        note += f", checkpoint slots capped at {share:.0%} of it"
    n = layout.num_blocks_for_budget(budget, req.num_slots + checkpoints, name)
    if req.max_model_len is not None:
        cap = (req.num_slots + checkpoints) * -(-req.max_model_len // layout.block_size)
        if n > cap:
            n, note = cap, note + f", capped at max_num_seqs x max_model_len = {cap} blocks"
    return n, checkpoints, note
