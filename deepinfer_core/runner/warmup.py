"""Warm-up at start-up: compile the kernels and capture every decode CUDA graph while the engine
starts, so no user request pays for it.

Triton compiles a kernel per shape specialisation the first time it runs, and the backends pick
tiles by the number of tokens, so a cold process would compile inside its first requests (tens of
seconds at V4-Flash width). Here the model runs eagerly at token counts from 1 to the step's token
budget through the engine's own path (slots and blocks of the empty cache), then every decode graph
bucket is captured. A count one sequence cannot hold (its block table ends at max_model_len) runs
as several sequences, as a served step of that size does (the prefill chunks of many prompts, a
verify step of gamma + 1 rows per sequence): the MoE tiles follow the step's tokens, not a
sequence's. CPU runners have nothing to compile.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from itertools import accumulate

import torch

log = logging.getLogger(__name__)


def eager_sizes(max_tokens: int) -> list[int]:
    """Token counts the eager warm-up runs: 1, 4, 16, ... (x4) below `max_tokens`, then `max_tokens`."""
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 4
    return sizes + [max_tokens]


def split_rows(n: int, per_seq: int) -> list[int]:
    """The sequences of a warm-up step of `n` tokens: as few as hold them (`per_seq` at most)."""
    full, rest = divmod(n, per_seq)
    return [per_seq] * full + ([rest] if rest else [])


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False)


@torch.no_grad()
def warm_up(runner, max_tokens: int) -> float:
    """Compile and capture now; returns the seconds it took (0 on a CPU).

    The eager sizes run through `runner.execute`, the engine's own path (real slots and blocks
    of the empty cache, block tables gathered on the device), so the kernels see the same shapes,
    strides and specialisations as a user's prefill of that many tokens (over `split_rows`'
    sequences); then the sampler runs once greedy and once seeded on their last rows' logits."""
    if torch.device(runner.device).type != "cuda":
        return 0.0
    with compiles_expected(runner):
        return _warm_up(runner, max_tokens)


def compiles_expected(runner):
    """A context in which kernel compiles are part of start-up: the warm-up and the start-up's memory
    profile forward (which, in a process that already served another engine with other numerics,
    compiles that engine's variants first). A backend that compiles kernels may watch for compiles
    outside it (AttentionBackend's optional `compiles_expected`, contracts.py): those stall every
    request of their step."""
    ops = runner.loaded.ops
    expected = getattr(ops.attention, "compiles_expected", None) if ops is not None else None
    return expected() if expected is not None else nullcontext()


def _warm_up(runner, max_tokens: int) -> float:
    t0 = time.perf_counter()
    alloc, block_size = runner.cache.allocator, runner.cache.layout.block_size
    # one sequence holds at most its block table (max_model_len) and the model's positions; a step
    # holds up to the token budget, over as many sequences as there are slots
    per_seq = min(runner.slot_tables.max_blocks * block_size,
                  int(runner.model_config.max_position_embeddings))
    sizes = eager_sizes(min(int(max_tokens), per_seq * alloc.num_free_slots))
    graphs = runner.graphs
    buckets = list(graphs.buckets) if graphs is not None else []
    bar = _progress(len(sizes) + len(buckets), "warm-up (kernels, CUDA graphs)")
    room = _same_on_every_ep_rank(runner, alloc.num_free_blocks)
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        if bar is not None:
            bar.update(1)
        lens = split_rows(n, per_seq)
        need = [-(-k // block_size) for k in lens]
        if sum(need) <= room:
            _eager_step(runner, lens, need, gen)
    for size in buckets:
        graphs.capture_bucket(size, 1)
        if bar is not None:
            bar.update(1)
    torch.cuda.synchronize()
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d eager sizes and %d decode CUDA graphs in %.1f s", len(sizes), len(buckets), seconds)
    return seconds


def _eager_step(runner, lens: list[int], need: list[int], gen: torch.Generator) -> None:
    """One prefill step of fresh sequences of `lens` tokens (`need` blocks each) through
    `runner.execute`, then the sampler once greedy and once seeded on their last rows' logits."""
    from ..api.sampling_params import SamplingParams
    from ..engine.scheduler import CacheUpdates
    from ..engine.step_executor import StepBatch

    alloc = runner.cache.allocator
    slots, tables = [], []
    try:
        for blocks in need:
            slots.append(alloc.allocate_slot())
            tables.append(alloc.allocate_blocks(blocks))
        # random ids: MoE kernels are chosen by how the tokens spread over the experts, and one
        # repeated id would route every token alike (hash layers map ids to experts)
        vocab, k = int(runner.model_config.vocab_size), len(lens)
        ids = torch.randint(0, vocab, (sum(lens),), generator=gen).tolist()
        writes = [(s, i, b) for s, blocks in zip(slots, tables) for i, b in enumerate(blocks)]
        last = [end - 1 for end in accumulate(lens)]          # each sequence's last row
        updates = CacheUpdates(slots, writes)
        logits = runner.execute(StepBatch(slots, [0] * k, lens, ids, last, updates))
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9)):
            runner.sampler.sample(logits, [params] * k, lens, [0] * k).cpu()
    finally:
        for blocks in tables:
            alloc.free_blocks(blocks)
        for slot in slots:
            alloc.free_slot(slot)


def _same_on_every_ep_rank(runner, blocks: int) -> int:
    """Under expert parallelism every rank must run the same warm-up forwards (each one joins the
    others' exchanges), but each rank sized its cache from its own free memory: the smallest room."""
    if not getattr(runner, "expert_parallel", False):
        return blocks
    import torch.distributed as dist

    from ..parallel.ep_moe import moe_layers
    group = moe_layers(runner.model)[0].method.group
    t = torch.tensor([blocks], dtype=torch.int64, device=runner.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
