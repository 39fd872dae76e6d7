"""One data-parallel engine rank: its own engine (scheduler, state cache, sampler) over the rank's
requests, stepped in lockstep with the other ranks, so that the expert-parallel collectives pair up.

Online (`RankLoop`; the front end's side is dp_online.py): idle, a rank blocks on its command queue;
a counted command (add, abort, wake) starts a run of lockstep iterations, and when the vote finds no
work anywhere every rank sends an IdleReport and blocks again. After each iteration with news a rank
sends a StepReport: its step's outputs (deltas of streamed requests), its load and gauges. A
prefix-cache reset is uncounted: applied between two steps (or at once while idle), answered with a
ResetReport.

Lockstep, one iteration:
    apply the commands that arrived (adds join this step, aborts free their slots now)
    any_work = all_reduce_max(engine has unfinished requests)      # on the gloo group
    if not any_work: the run ends (the same iteration everywhere)
    a rank with work runs one `engine.step()`; a rank whose step launched no forward (nothing of its
    own, or a step that only post-processed the previous one) joins the exchanges once (`idle_step`)
    with EPLB on: `eplb.end_step()` records the iteration's expert load and, every interval, moves
    expert weights between the ranks and switches the maps (eplb_runtime.py), keeping the requests
    in flight

Invariants this keeps:
* Every rank joins the EP group's dispatch/combine exactly once per main MoE layer per iteration:
  an engine step launches at most one model forward (one pass over the main layers), and a rank
  without one runs the MoE half of a placeholder forward (T = 0). Iteration k's forward on one rank
  therefore always pairs with iteration k's forward or placeholder on every other rank.
* With decode graphs under EP (`enable_ep_cuda_graphs`) the ranks also agree, once per iteration, on
  how (`step_vote.py`): all replay one bucket's graph (a rank without a forward replays it with
  padding rows only), or all run eagerly (`ModelRunner.execute` / `idle_step`).
* Speculative decoding with the MTP block keeps that count: a speculating step launches one forward
  (the verify forward, through the main layers: one dispatch/combine per main MoE layer); verifying
  and drafting (`Speculator.run`: the MTP block over the step's rows, then k - 1 more MTP steps) run
  the MTP block only, whose MoE keeps the single-process method with all its experts (ep_moe.py
  `moe_layers` is the main layers), so no collective. A rank that speculates and one that does not
  (or is idle) still pair. VARLEN's start-up profile runs the same forwards on every rank, whose
  tables then become one (`shared_varlen_policy`). The DSpark drafter's stages are the mtp.* blocks:
  local too.
* Without expert parallelism the ranks share no collective but the vote, and no placeholder runs.
* Any failure (a dead peer: `EPCommError` or a gloo error in the vote; a bad load) is reported to
  the front end as one ("error", rank, text) message, then the process exits at once: its closed
  sockets make every peer fail fast instead of waiting for the group timeout.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from ..device_module import rank_devices
from .dp_messages import (
    EXIT_TEST_HOOK,
    RESET_PREFIX_CACHE,
    IdleReport,
    PrefixKeying,
    RankStats,
    ResetReport,
    StepReport,
    WorkerSpec,
)
from .ep_comm import EPCommError
from .rank_start import restore_stderr

# Environment defaults of a process-group backend, set in a rank unless the user set them. NCCL:
# NVLink multicast off (the portable all-to-all gains nothing from it, and a program using it can
# put a shared host's GPUs out of service).
BACKEND_ENV = {"nccl": (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"))}


def _any_rank(flag: bool, group: dist.ProcessGroup | None, rank: int) -> bool:
    """MAX over the ranks of `flag` (one int on the gloo group); a dead peer becomes an
    EPCommError."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:          # DistBackendError and gloo errors are RuntimeErrors
        raise EPCommError(f"DP vote (any rank has work) failed on rank {rank}: {exc}") from exc
    return bool(t.item())


def _spec_counts(engine) -> tuple[int, int, int, int]:
    """(verify steps, drafted, verified, accepted tokens) of the engine so far; zeros without
    speculation."""
    m = engine.spec_metrics
    if m is None:
        return 0, 0, 0, 0
    return m.num_steps, m.num_drafted_tokens, m.num_verified_tokens, m.num_accepted_tokens


def shared_varlen_policy(policy, group):
    """VARLEN under DP. Every rank profiled its step-time table with the same forwards in the same
    order (so the expert-parallel layers' collectives lined up); a lockstep iteration lasts as long
    as its slowest rank, so each rank schedules with the elementwise maximum of the ranks' tables:
    one all-reduce, the same table everywhere."""
    from ..speculative.varlen import StepTimes, VarlenPolicy
    times = policy.times
    ms = torch.tensor(times.ms, dtype=torch.float64)
    try:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:
        raise EPCommError(f"VARLEN step-time table exchange failed: {exc}") from exc
    shared = StepTimes(times.buckets, times.max_rows, tuple(tuple(row) for row in ms.tolist()))
    return VarlenPolicy(shared, policy.max_drafts)


def rank_load(engine) -> int:
    """Waiting + running tokens (prompt + generated so far) of the engine's unfinished sequences:
    what the front end balances on."""
    sched = engine.scheduler
    running = sum(s.num_tokens for s in sched.running.values())
    return running + sum(s.num_tokens for s in sched.waiting if not s.finished)


class RankLoop:
    """The rank's side of the online protocol (dp_online.py): block on the command queue while idle;
    a counted command starts a run, stepped in lockstep until no rank has work, then an IdleReport.

    Commands: ("add", [RankRequest]), ("abort", request_id), ("wake",) (join a run another rank's
    request started), and the uncounted ("exit_at", iteration) (test hook: os._exit at that
    iteration of the next run, as a crash would), ("reset_prefix_cache",) (answered with
    ("reset", ResetReport)) and ("stop",)."""

    def __init__(self, engine, runner, groups, spec: WorkerSpec, commands, results, eplb=None):
        self.engine, self.runner, self.groups, self.spec = engine, runner, groups, spec
        self.commands, self.results, self.eplb = commands, results, eplb
        self.consumed = 0
        self.runs = 0
        self.aborted = 0                  # aborts applied here (a gauge the server's tests read)
        self.exit_at: int | None = None
        self.stopping = False
        self.stats = RankStats(spec.rank)
        self._invalid: dict[str, str] = {}
        # the last report's (load, consumed, gauges): unchanged ones are not sent
        self._last: tuple | None = None

    def loop(self) -> None:
        while not self.stopping:
            cmd = self.commands.get()     # idle: block (no spinning)
            if self._apply(cmd):
                self._run()

    def _apply(self, cmd: tuple) -> bool:
        """Apply one command; True when it was a counted one (it starts a run when idle)."""
        kind = cmd[0]
        if kind == "stop":
            self.stopping = True
            return False
        if kind == "exit_at":
            self.exit_at = cmd[1]
            return False
        if kind == RESET_PREFIX_CACHE:        # between two steps, as the in-process engine resets
            reset = self.engine.reset_prefix_cache()
            self.results.put(("reset", ResetReport(self.spec.rank, reset, self._gauges())))
            return False
        self.consumed += 1
        if kind == "add":
            for r in cmd[1]:
                try:
                    self.engine.add_request(r.request_id, r.prompt_token_ids, r.params,
                                            prompt=r.prompt, seed=r.seed, stream=r.stream,
                                            cache_salt=r.cache_salt)
                    self.stats.num_requests += 1
                except ValueError as exc:   # refused: reported; the others run (as LLM.generate)
                    self._invalid[r.request_id] = str(exc)
        elif kind == "abort":
            try:
                self.engine.abort_request(cmd[1])      # frees its slot and blocks now
                self.aborted += 1
            except ValueError:
                pass                # it finished (its output is on the way) before the abort came
        elif kind != "wake":
            raise RuntimeError(f"rank {self.spec.rank}: unknown command {kind!r}")
        return True

    def _drain(self) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            self._apply(cmd)

    def _run(self) -> None:
        """One run: iterations in lockstep with the other ranks until the vote finds no work
        anywhere."""
        engine, stats, eplb = self.engine, self.stats, self.eplb
        self.runs += 1
        t0 = time.perf_counter()
        idle_needed = self.groups.ep is not None   # a placeholder pass serves the others' MoE rows
        pairs_before = eplb.pairs_per_layer.clone() if eplb is not None else None
        readings_before = len(eplb.balance) if eplb is not None else 0
        spec_before = _spec_counts(engine)
        chosen_before = list(engine.varlen.chosen) if engine.varlen is not None else []
        vote = self.runner.step_vote
        graph_steps_before = vote.graph_steps if vote is not None else 0
        while True:
            self._drain()                 # what arrived since the last iteration joins this one
            if self.stopping or not _any_rank(engine.has_unfinished_requests(), self.groups.cpu,
                                              self.spec.rank):
                break
            stats.iterations += 1
            if stats.iterations == self.exit_at:
                os._exit(EXIT_TEST_HOOK)          # a crash in the middle of a step (tests)
            launched = engine.num_steps
            outputs, refused = [], {}
            if engine.has_unfinished_requests():
                outputs = engine.step()
                for out in outputs:
                    reason = engine.refused.pop(out.request_id, None) if out.finished else None
                    if reason is not None:
                        refused[out.request_id] = reason
            if engine.num_steps - launched > 1:   # cannot happen (verify steps too): EP deadlock
                raise RuntimeError(f"rank {self.spec.rank}: one engine step launched "
                                   f"{engine.num_steps - launched} forwards; DP lockstep needs at "
                                   "most one")
            stats.forwards += engine.num_steps - launched
            if engine.num_steps == launched and idle_needed:
                self.runner.idle_step()       # joins the others' exchanges (the agreed way)
                stats.idle_forwards += 1
            if eplb is not None:
                done = eplb.end_step()
                if done is not None:
                    stats.add_rearrangement(done)
                    stats.eplb_placements.append(eplb.placement.phys_to_log.tolist())
            self._report(outputs, refused)
        self._report([], {})              # invalid adds of the last drain
        if eplb is not None:
            stats.eplb_layer_pairs = (eplb.pairs_per_layer - pairs_before).tolist()
            stats.eplb_moe_lb = eplb.balance[readings_before:]
        stats.num_preemptions = engine.scheduler.num_preemptions
        if vote is not None:
            stats.ep_graph_steps = vote.graph_steps - graph_steps_before
        (stats.spec_verify_steps, stats.spec_drafted_tokens, stats.spec_verified_tokens,
         stats.spec_accepted_tokens) = (a - b for a, b in zip(_spec_counts(engine), spec_before))
        speculator = engine.executor.speculator
        if speculator is not None and getattr(speculator, "proposer", None) is not None:
            stats.spec_proposer = type(speculator.proposer).__name__
        if engine.varlen is not None:
            stats.varlen_ms = [list(row) for row in engine.varlen.times.ms]
            stats.varlen_chosen = [a - b for a, b in zip(engine.varlen.chosen, chosen_before)]
        stats.seconds = time.perf_counter() - t0
        load, gauges = rank_load(engine), self._gauges()
        self.results.put(("idle", IdleReport(self.spec.rank, self.runs, self.consumed, load, gauges,
                                             stats)))
        self.stats = RankStats(self.spec.rank)
        self.exit_at = None

    def _gauges(self) -> dict[str, float]:
        from ..serve.metrics import scheduler_gauges  # lazy: the serve package is optional here
        gauges = scheduler_gauges(self.engine)
        gauges["deepinfer_dp_aborted_requests_total"] = self.aborted
        return gauges

    def _report(self, outputs: list, refused: dict[str, str]) -> None:
        load, gauges = rank_load(self.engine), self._gauges()
        state = (load, self.consumed, gauges)
        if not outputs and not refused and not self._invalid and state == self._last:
            return
        self._last = state
        # Pickled each step for every running request: the prompt ids (the front end has them) and
        # the timestamps of a request still running (one per token so far) would dominate the bytes.
        outputs = [replace(out, prompt_token_ids=[], metrics=out.metrics if out.finished else None)
                   for out in outputs]
        self.results.put(("step", StepReport(self.spec.rank, outputs, refused, self._invalid, load,
                                             gauges, self.consumed)))
        self._invalid = {}


def rank_device(spec: WorkerSpec, bind: bool = False) -> torch.device:
    """Where rank r runs: device `local_rank` of its node for an accelerator type ('cuda', 'npu':
    one device per rank; the spawned ranks' local rank is their rank), else the CPU. `bind` (in the
    rank's own process, before any device work): that device also becomes the current one
    (torch.<type>.set_device), so the config's bare type ("cuda", "npu") means this rank's
    device."""
    device = spec.config.model.device      # None: one engine process, its engine's own choice
    ranks = None if device is None else rank_devices(device)
    if ranks is None:
        return torch.device("cpu")
    if bind:
        ranks.bind(spec.local_rank)
    return ranks.device(spec.local_rank)


def build_rank(spec: WorkerSpec, device: torch.device):
    """(process groups, this rank's runner, its engine) on `device` (`rank_device`): groups first,
    then the expert shard the loader reads, then the engine, which sizes this rank's own state cache
    now (a bad budget fails at start-up). The groups' backend is the device's (torch.distributed's
    map: gloo on the CPU, nccl on a GPU, hccl on an NPU), the control traffic (votes, tables) a gloo
    twin."""
    from ..api.engine_builder import build_engine
    from ..api.tokenizer import load_tokenizer
    from ..config import ModelConfig
    from ..runner.model_runner import ModelRunner
    from .ep_moe import ExpertShard
    from .expert_map import ExpertPlacement
    from .groups import ParallelLayout, device_backend, init_process_groups

    layout = ParallelLayout(world_size=spec.world_size, rank=spec.rank,
                            data_parallel_size=spec.world_size,
                            expert_parallel=spec.expert_parallel)
    # under torchrun (init_method env://) torch joins the agent's store: RANK, WORLD_SIZE must agree
    env = os.environ if spec.init_method == "env://" else {}
    backend = device_backend(device)
    for name, value in BACKEND_ENV.get(backend, ()):
        os.environ.setdefault(name, value)      # read when the backend builds its communicators
    groups = init_process_groups(layout, backend=backend, init_method=spec.init_method,
                                 timeout_s=spec.timeout_s, device=device, env=env,
                                 graph_ep=spec.config.parallel.enable_ep_cuda_graphs)
    shard = None
    if spec.expert_parallel:
        cfg = ModelConfig.from_file(spec.model_dir)
        placement = ExpertPlacement.initial(cfg.num_hidden_layers, cfg.n_routed_experts,
                                            layout.ep_size, spec.num_redundant_experts)
        # the maps live where the router's expert ids do (no host round trip per layer)
        shard = ExpertShard(placement.to(device), layout.ep_rank, layout.ep_size, groups.ep,
                            groups.ep_graph)
    runner = ModelRunner(spec.model_dir, spec.config, expert_shard=shard)
    tokenizer = load_tokenizer(spec.model_dir, spec.config.model.tokenizer)
    config = spec.config.with_model_limit(runner.model_config.max_position_embeddings)
    return groups, runner, build_engine(runner, tokenizer, config)


def _exit_with_parent(rank: int) -> None:
    """A spawned rank leaves at once when the front end's process dies without stopping it (SIGKILL,
    a crash): blocked on its command queue it would otherwise outlive it (under torchrun the agent
    reaps only the process it started). A torchrun rank has no multiprocessing parent: its
    connection's end tells it the same (torchrun.py)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        print(f"deepinfer: data-parallel rank {rank}: the front end's process (pid {parent.pid}) "
              "died; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="deepinfer-dp-parent", daemon=True).start()


def worker_main(spec: WorkerSpec, commands, results, stderr_fd: int | None = None) -> None:
    """Entry point of a rank (a spawned process, or a torchrun process: torchrun.py): build, say
    ready, then serve commands (`RankLoop`) until ("stop",). `commands`: get() / get_nowait();
    `results`: put() / close(). Messages to the front end: ("ready", rank, gauges, PrefixKeying or
    None), ("step", StepReport), ("idle", IdleReport), ("reset", ResetReport), ("error", rank,
    text). `stderr_fd`: a spawned rank's real stderr (its start-up output went through the front
    end: rank_start.py)."""
    restore_stderr(stderr_fd)
    # Ctrl-C reaches the whole process group: the front end decides when the ranks stop (close()).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(spec.rank)
    torch.set_num_threads(spec.num_threads)
    groups = None
    try:
        groups, runner, engine = build_rank(spec, rank_device(spec, bind=True))
        if engine.varlen is not None:   # (profiled when the engine was built, every rank in step)
            engine.use_varlen(shared_varlen_policy(engine.varlen, groups.cpu))
        if runner.graphs is not None and runner.expert_parallel:   # decode graphs hold EP exchanges
            from .step_vote import StepVote
            runner.step_vote = StepVote(groups.cpu, spec.rank)
        eplb = None
        if spec.expert_parallel:
            from .eplb_runtime import runtime_eplb_from_config
            eplb = runtime_eplb_from_config(spec.config, runner.model, groups.ep, groups.cpu)
        rank_loop = RankLoop(engine, runner, groups, spec, commands, results, eplb)
        prefix = engine.scheduler.prefix
        keying = None if prefix is None else PrefixKeying(prefix.salt, prefix.block_size)
        # the gauges: the server's /metrics has them at once; the keying: the front end's router's
        results.put(("ready", spec.rank, rank_loop._gauges(), keying))
        rank_loop.loop()
    except BaseException as exc:
        # written before it returns
        results.put(("error", spec.rank, f"{type(exc).__name__}: {exc}"))
        results.close()
        os._exit(1)                            # no gloo teardown: it may block on the dead peer
    from .groups import destroy_process_groups
    if groups is not None:
        destroy_process_groups(groups)
