"""One data-parallel engine rank: its own engine (scheduler, state cache, sampler) over the rank's
requests, stepped in lockstep with the other ranks (spec parallelism.md §3.1).

Lockstep, one iteration:
    any_work = all_reduce_max(engine has unfinished requests)      # on the gloo group
    if not any_work: every rank stops (the same iteration everywhere)
    a rank with work runs one `engine.step()`; a rank whose step launched no forward (nothing of its
    own, or a step that only post-processed the previous one) runs `idle_forward` once
    with EPLB on: `eplb.end_step()` records the iteration's expert load and, every interval, moves
    expert weights between the ranks and switches the maps (eplb_runtime.py), in flight requests kept

Invariants this keeps:
* Every rank joins the EP group's dispatch/combine exactly once per main MoE layer per iteration:
  an engine step launches at most one model forward (one pass over the main layers), and a rank
  without one runs the MoE half of a placeholder forward (T = 0). Iteration k's forward on one rank
  therefore always pairs with iteration k's forward or placeholder on every other rank.
* Speculative decoding is off in DP mode (`num_speculative_tokens=0`): a verify step and its drafter
  forwards would need a per-step vote on their MoE call count (§3.1), which is not built yet. MTP
  blocks keep the single-process MoE method (local, no collective), so they never desynchronise.
* Without expert parallelism the ranks share no collective but the vote, and no placeholder runs.
* Any failure (a dead peer: `EPCommError` or a gloo error in the vote; a bad load) is reported to the
  front end as one ("error", rank, text) message, then the process exits at once: its closed sockets
  make every peer fail fast instead of waiting for the group timeout.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..api.sampling_params import SamplingParams
from ..engine_config import EngineConfig
from .ep_comm import EPCommError


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned rank needs (pickled to the child)."""

    rank: int
    world_size: int
    init_method: str              # tcp://host:port of the gloo rendezvous
    model_dir: str
    config: EngineConfig          # resolved once by the front end (device cpu, no speculation)
    expert_parallel: bool
    num_redundant_experts: int
    timeout_s: float              # gloo collective timeout: a hung peer becomes an error after this
    num_threads: int              # torch intra-op threads of this rank (ranks share the host's cores)


@dataclass(frozen=True)
class RankRequest:
    """One request of a generate call, as the front end resolved it (ids tokenized, seed derived)."""

    index: int                    # position in the caller's list
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass
class RankStats:
    """What one rank did in the last generate call (tests, logs)."""

    rank: int
    num_requests: int = 0
    iterations: int = 0           # lockstep iterations (equal on every rank by construction)
    forwards: int = 0             # engine steps that launched a model forward
    idle_forwards: int = 0        # placeholder MoE passes (iterations without a forward of its own)
    num_preemptions: int = 0      # the scheduler's count over this rank's lifetime
    seconds: float = 0.0
    # EPLB (enable_eplb), during this call: rearrangements and what they moved on this rank
    eplb_rearrangements: int = 0
    eplb_layers_changed: int = 0          # summed over rearrangements
    eplb_experts_received: int = 0        # expert copies received from other ranks
    eplb_experts_sent: int = 0
    eplb_bytes_received: int = 0
    eplb_bytes_sent: int = 0
    eplb_local_copies: int = 0            # slots filled from another slot of this rank
    eplb_seconds: float = 0.0             # time spent in rearrangements (plan + moves)
    eplb_placements: list[list[list[int]]] = field(default_factory=list)   # phys_to_log after each one
    eplb_layer_pairs: list[int] = field(default_factory=list)  # (token, expert) pairs received per layer

    def add_rearrangement(self, r) -> None:
        """Counts one `eplb_runtime.Rearrangement` of this rank."""
        m = r.moves
        self.eplb_rearrangements += 1
        self.eplb_layers_changed += m.layers_changed
        self.eplb_experts_received += m.experts_received
        self.eplb_experts_sent += m.experts_sent
        self.eplb_bytes_received += m.bytes_received
        self.eplb_bytes_sent += m.bytes_sent
        self.eplb_local_copies += m.local_copies
        self.eplb_seconds += r.seconds


@dataclass
class RankResult:
    outputs: dict[int, Any] = field(default_factory=dict)     # caller index -> RequestOutput
    errors: dict[int, str] = field(default_factory=dict)      # caller index -> why it was refused
    stats: RankStats | None = None


EXIT_TEST_HOOK = 17


def _any_rank(flag: bool, group: dist.ProcessGroup | None, rank: int) -> bool:
    """MAX over the ranks of `flag` (one int on the gloo group); a dead peer becomes an EPCommError."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:          # DistBackendError and gloo errors are RuntimeErrors
        raise EPCommError(f"DP vote (any rank has work) failed on rank {rank}: {exc}") from exc
    return bool(t.item())


def serve(engine, runner, groups, requests: list[RankRequest], spec: WorkerSpec, stats: RankStats,
          exit_at_iteration: int | None = None, eplb=None) -> RankResult:
    """Run this rank's share of one generate call in lockstep with the others; returns when no rank
    has work left (every rank returns from the same iteration). `exit_at_iteration` (a test hook): the
    process exits with EXIT_TEST_HOOK at that iteration, as a crash in the middle of a run would.
    `eplb` (eplb_runtime.RuntimeEPLB, enable_eplb): told the end of every iteration, after its MoE
    pass, so every rank records and rearranges at the same iterations (between two forwards)."""
    from .ep_moe import idle_forward
    result = RankResult(stats=stats)
    t0 = time.perf_counter()
    for r in requests:
        try:
            engine.add_request(r.request_id, r.prompt_token_ids, r.params, prompt=r.prompt, seed=r.seed, stream=False)
        except ValueError as exc:        # refused: reported, the others still run (as LLM.generate)
            result.errors[r.index] = f"generate: prompt {r.index} is invalid: {exc}"
    index = {r.request_id: r.index for r in requests if r.index not in result.errors}
    stats.num_requests = len(index)
    idle_needed = groups.ep is not None       # a placeholder pass serves the other ranks' MoE rows
    pairs_before = eplb.pairs_per_layer.clone() if eplb is not None else None
    while _any_rank(engine.has_unfinished_requests(), groups.cpu, spec.rank):
        stats.iterations += 1
        if stats.iterations == exit_at_iteration:
            os._exit(EXIT_TEST_HOOK)          # a crash in the middle of a step (tests)
        launched = engine.num_steps
        if engine.has_unfinished_requests():
            for out in engine.step():
                i = index.get(out.request_id)
                if i is None or not out.finished:
                    continue
                reason = engine.refused.pop(out.request_id, None)
                if reason is not None:
                    result.errors[i] = f"request {i}: {reason}"
                else:
                    result.outputs[i] = out
        if engine.num_steps - launched > 1:   # cannot happen without speculation; would deadlock EP
            raise RuntimeError(f"rank {spec.rank}: one engine step launched {engine.num_steps - launched} "
                               "forwards; DP lockstep needs at most one")
        stats.forwards += engine.num_steps - launched
        if engine.num_steps == launched and idle_needed:
            idle_forward(runner.model, runner.dtype)
            stats.idle_forwards += 1
        if eplb is not None:
            done = eplb.end_step()
            if done is not None:
                stats.add_rearrangement(done)
                stats.eplb_placements.append(eplb.placement.phys_to_log.tolist())
    if eplb is not None:
        stats.eplb_layer_pairs = (eplb.pairs_per_layer - pairs_before).tolist()
    stats.num_preemptions = engine.scheduler.num_preemptions
    stats.seconds = time.perf_counter() - t0
    return result


def build_rank(spec: WorkerSpec):
    """(process groups, LLM over this rank's runner): groups first, then the expert shard the loader
    reads, then the engine (its state cache is this rank's own)."""
    from ..api.llm import LLM
    from ..api.tokenizer import load_tokenizer
    from ..config import ModelConfig
    from ..runner.model_runner import ModelRunner
    from .ep_moe import ExpertShard
    from .expert_map import ExpertPlacement
    from .groups import ParallelLayout, init_process_groups

    layout = ParallelLayout(world_size=spec.world_size, rank=spec.rank, data_parallel_size=spec.world_size,
                            expert_parallel=spec.expert_parallel)
    groups = init_process_groups(layout, backend="gloo", init_method=spec.init_method, timeout_s=spec.timeout_s,
                                 env={})
    shard = None
    if spec.expert_parallel:
        cfg = ModelConfig.from_file(spec.model_dir)
        placement = ExpertPlacement.initial(cfg.num_hidden_layers, cfg.n_routed_experts, layout.ep_size,
                                            spec.num_redundant_experts)
        shard = ExpertShard(placement, layout.ep_rank, layout.ep_size, groups.ep)
    runner = ModelRunner(spec.model_dir, spec.config, expert_shard=shard)
    tokenizer = load_tokenizer(spec.model_dir, spec.config.model.tokenizer)
    # as LLM.__init__ does after building its runner (from_runner wants a runner whose cache exists)
    llm = LLM.__new__(LLM)
    llm._setup(runner, tokenizer, spec.config)
    llm.model_dir, llm.dtype = spec.model_dir, spec.config.model.dtype
    return groups, llm


def worker_main(spec: WorkerSpec, commands, results) -> None:
    """Entry point of a spawned rank: build, say ready, then serve ("generate", [RankRequest]) commands
    (optionally with a test hook's exit iteration) until ("stop",). Messages to the front end:
    ("ready", rank), ("done", rank, RankResult), ("error", rank, text)."""
    torch.set_num_threads(spec.num_threads)
    groups = None
    try:
        groups, llm = build_rank(spec)
        engine = llm.engine                    # sizes the state cache now: a bad budget fails at start-up
        eplb = None
        if spec.expert_parallel:
            from .eplb_runtime import runtime_eplb_from_config
            eplb = runtime_eplb_from_config(spec.config, llm.runner.model, groups.ep, groups.cpu)
        results.put(("ready", spec.rank))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            stats = RankStats(spec.rank)
            hook = cmd[2] if len(cmd) > 2 else None
            result = serve(engine, llm.runner, groups, cmd[1], spec, stats, hook, eplb=eplb)
            results.put(("done", spec.rank, result))
    except BaseException as exc:
        results.put(("error", spec.rank, f"{type(exc).__name__}: {exc}"))
        results.close()
        results.join_thread()                  # the message must leave before the process does
        os._exit(1)                            # no gloo teardown: it may block on the dead peer
    from .groups import destroy_process_groups
    if groups is not None:
        destroy_process_groups(groups)
