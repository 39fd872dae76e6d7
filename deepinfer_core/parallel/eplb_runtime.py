"""EPLB while the engine runs: load recording per lockstep iteration, and every `eplb_step_interval`
iterations a new placement with the expert weights moved between the EP ranks (as in DS-DeepInfer's
EPLB). The engine is not stopped: the rearrangement runs between two lockstep iterations, the
requests in flight keep their state (KV cache, sampler positions), and the next forward routes with
the new maps.

One iteration on every EP rank (`RuntimeEPLB.end_step`, called once per lockstep iteration after the
rank's forward or placeholder pass):
    the MoE method's per-slot receive counts of this iteration -> the load window (one step)
    if should_rearrange(iteration, interval):
        window [n, L, P] all-reduced (SUM) over the ranks -> logical load [n, L, E]
        plan = keep_in_place(old, policy(load))  # the same pure float64 function on every rank, its bins
                                                 # laid over the current slots (eplb_keep.py)
        check: every rank planned the same maps  # MIN == MAX all-reduce, else an error (never diverge)
        move_experts(old -> plan)                # weights over the EP group, bit-exact
        maps switched in place, window emptied   # slot ids of the old window mean other experts now

Why every rank reaches the same iteration: the iteration count is the lockstep loop's, equal on all
ranks by construction (dp_worker.py), and it counts every iteration (prefill, decode, placeholder), so
no step-type vote is needed. Counts are taken on the receive side (dispatch's `slot_counts`), so every
rank records exactly the pairs its own slots computed and the all-reduced window is the global load,
including the hash-routed layers (they go through the same dispatch). Results do not change: the
combine adds every (token, expert) contribution in a fixed order whatever the placement (ep_comm.py),
and a moved expert holds the same bits.

Window: the ring holds min(eplb_window_size, eplb_step_interval) steps; it is emptied at every
rearrangement, so it could never hold more than an interval anyway.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .ep_comm import EPCommError
from .ep_moe import EPMoEMethod, moe_layers
from .eplb import ExpertLoadStats, imbalance, rank_load, rebalance, should_rearrange, slot_to_logical
from .eplb_keep import keep_in_place
from .expert_map import ExpertPlacement
from .expert_move import MoveStats, move_experts
from .groups import group_size_rank

log = logging.getLogger("deepinfer.eplb")


@dataclass(frozen=True)
class Rearrangement:
    """One rearrangement on one rank."""

    iteration: int  # lockstep iterations counted when it ran
    window_steps: int  # steps of load it planned on
    moves: MoveStats
    balance_before: float  # window's Σ max rank / Σ mean rank under the old placement (>= 1)
    balance_planned: float  # the same window under the new placement
    seconds: float


@dataclass(eq=False)
class RuntimeEPLB:
    """The EPLB state of one EP rank. `group`: the EP group (weights); `control`: a CPU group over the
    same ranks (counts and the plan check; the same group on gloo)."""

    method: EPMoEMethod
    layers: Sequence[nn.Module]
    group: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    window: int
    interval: int
    policy: Callable[[torch.Tensor, int, int], ExpertPlacement] = rebalance
    stat_interval: int = 128  # balance telemetry: iterations per moe_lb reading
    iterations: int = field(default=0, init=False)
    history: list[Rearrangement] = field(default_factory=list, init=False)
    balance: list[float] = field(default_factory=list, init=False)  # moe_lb of each stat_interval period
    _step_tokens: torch.Tensor = field(init=False, repr=False)  # [stat_interval, L] this rank's pairs per step
    pairs_per_layer: torch.Tensor = field(init=False, repr=False)  # [L] int64, received pairs since start
    load: ExpertLoadStats = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("window", "interval", "stat_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EPLB {name}={v!r}; allowed: an int >= 1")
        placement = self.method.placement
        if [m.layer_id for m in self.layers] != list(range(placement.num_layers)):
            raise ValueError("EPLB: the MoE layers must be the placement's layers 0..L-1 in order")
        self.load = ExpertLoadStats(placement, min(self.window, self.interval))
        self.pairs_per_layer = torch.zeros(placement.num_layers, dtype=torch.int64)
        self._step_tokens = torch.zeros(self.stat_interval, placement.num_layers, dtype=torch.int64)
        device = next(iter(self.layers[0].experts.buffers()), torch.empty(0)).device
        self.method.start_load_recording(device)

    @property
    def placement(self) -> ExpertPlacement:
        return self.method.placement

    def end_step(self) -> Rearrangement | None:
        """One lockstep iteration ended on this rank (every rank calls this at every iteration): record
        its counts, and rearrange when the schedule says so (all ranks at the same iteration)."""
        local = self.method.take_load_counts().cpu()  # one small copy per iteration
        self.pairs_per_layer += local.sum(1)
        self._step_tokens[self.iterations % self.stat_interval] = local.sum(1)
        placement = self.placement
        slots = placement.slots_of_rank(self.method.ep_rank, self.method.ep_size)
        full = torch.zeros(placement.num_layers, placement.num_slots, dtype=torch.int64)
        full[:, slots.start : slots.stop] = local
        self.load.record_counts(full)
        self.load.end_step()
        self.iterations += 1
        if self.iterations % self.stat_interval == 0:
            self._read_balance()
        if not should_rearrange(self.iterations, self.interval):
            return None
        return self.rearrange()

    def _read_balance(self) -> None:
        """Telemetry: the ranks' tokens per step and layer over the last `stat_interval`
        iterations, gathered on every rank: moe_lb = Σ_(t,l) max_rank / Σ_(t,l) mean_rank (>= 1, 1 =
        perfect; a period in which no token was routed reads 1)."""
        ranks = _all_gather(self._step_tokens, self.control, "balance telemetry")  # [ep, N, L]
        mean = ranks.double().mean(0).sum().item()
        self.balance.append(ranks.amax(0).sum().item() / mean if mean > 0 else 1.0)
        log.info("EPLB rank %d iterations %d-%d: moe_lb %.3f", self.method.ep_rank,
                 self.iterations - self.stat_interval + 1, self.iterations, self.balance[-1])

    def rearrange(self) -> Rearrangement:
        """Plan on the all-reduced window, move the weights, switch the maps; every rank together."""
        t0 = time.perf_counter()
        ep_rank, ep_size = self.method.ep_rank, self.method.ep_size
        counts = self.load.counts()
        _all_reduce(counts, dist.ReduceOp.SUM, self.control, "window counts")
        old = self.placement.clone()
        load = slot_to_logical(counts, old)
        # the policy's bins laid over the current placement: same balance, fewer weights moved
        new = keep_in_place(old, self.policy(load, old.num_slots, old.num_slots // ep_size), ep_size)
        _check_same_plan(new, self.control)
        moves = move_experts(self.layers, old, new, ep_rank, ep_size, self.group, self.method.slot_modules)
        self.placement.copy_(new)  # in place: the MoE method routes with the new maps from now on
        self.load.set_placement(self.placement)
        done = Rearrangement(
            iteration=self.iterations,
            window_steps=counts.shape[0],
            moves=moves,
            balance_before=imbalance(rank_load(load, old, ep_size)),
            balance_planned=imbalance(rank_load(load, new, ep_size)),
            seconds=time.perf_counter() - t0,
        )
        self.history.append(done)
        log.info(
            "EPLB rank %d iteration %d: %d layers changed, %d experts received (%d bytes), balance %.3f -> "
            "%.3f, %.3f s",
            ep_rank,
            done.iteration,
            moves.layers_changed,
            moves.experts_received,
            moves.bytes_received,
            done.balance_before,
            done.balance_planned,
            done.seconds,
        )
        return done


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
    """Every rank's `t`, stacked in rank order (a world of one: just `t`)."""
    if group is None:
        return t[None]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(parts, t, group=group)
    except RuntimeError as exc:
        raise EPCommError(f"EPLB {what} all-gather failed: {exc}") from exc
    return torch.stack(parts)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, what: str) -> None:
    if group is None:
        return
    try:
        dist.all_reduce(t, op=op, group=group)
    except RuntimeError as exc:  # DistBackendError and gloo errors are RuntimeErrors
        _, rank = group_size_rank(group)
        raise EPCommError(f"EPLB {what}: all_reduce failed on rank {rank}: {exc}") from exc


def _check_same_plan(plan: ExpertPlacement, group: dist.ProcessGroup | None) -> None:
    """Every rank must have planned the same maps (the plan is computed on each rank, not broadcast):
    MIN and MAX over the ranks of phys_to_log agree everywhere exactly when all ranks agree."""
    if group is None:
        return
    lo = plan.phys_to_log.to("cpu", torch.int64)
    hi = lo.clone()
    _all_reduce(lo, dist.ReduceOp.MIN, group, "plan check")
    _all_reduce(hi, dist.ReduceOp.MAX, group, "plan check")
    if not torch.equal(lo, hi):
        layer = int((lo != hi).any(1).nonzero()[0])
        raise RuntimeError(
            f"EPLB: the EP ranks planned different placements (first in layer {layer}); the "
            "window counts or the policy are not deterministic across ranks"
        )


def runtime_eplb_from_config(
    config: object, model: nn.Module, group: dist.ProcessGroup | None, control: dist.ProcessGroup | None
) -> RuntimeEPLB | None:
    """The rank's RuntimeEPLB when `config.parallel.enable_eplb` (and the model is expert-parallel),
    else None. The options are read with defaults so that a config without them means EPLB off."""
    par = getattr(config, "parallel", None)
    if not getattr(par, "enable_eplb", False):
        return None
    method = moe_layers(model)[0].method
    if not isinstance(method, EPMoEMethod):
        raise ValueError("enable_eplb=True needs expert-parallel MoE layers (enable_expert_parallel=True)")
    return RuntimeEPLB(
        method,
        moe_layers(model),
        group,
        control,
        window=par.eplb_window_size,
        interval=par.eplb_step_interval,
        stat_interval=getattr(par, "eplb_stat_interval", 128),
    )
