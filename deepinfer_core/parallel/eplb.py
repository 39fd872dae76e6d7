"""EPLB: per-slot load statistics, the rearrangement schedule and the placement policies.

The policies are pure functions of `load` [W, L, E] (tokens routed to each logical expert, per step
of a window of W steps, per MoE layer) to an `ExpertPlacement`. Each layer is planned independently
(the loops below run over slots and replicas, all layers at once). A rank's load at step t is the
sum over its slots of `load_t[e] / cnt[e]`: the replica choice splits an expert's tokens evenly over
its `cnt[e]` replicas.

* `rebalance` ("deepinfer"): minimises the sum over the window's steps of the per-step maximum rank
  load, the quantity MoE latency follows (every rank waits for the slowest one at every step),
  rather than the imbalance of window totals (which can be perfect while every single step is not).
* `rebalance_simple` ("eplb_global", the public EPLB global policy): plans on window totals.

Determinism (every rank must reach the same maps): float64 on CPU, ties made strict
by adding `1e-4 * logical_id` to the loads (they are token counts, so this never outweighs one
token), stable sorts, and argmin/argmax, which return the first (lowest) index on ties. Neither
policy looks at the current placement (no cost for moving weights).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .expert_map import ExpertPlacement, _check_int, _is_int

TIE_BREAK = 1e-4        # per logical id, added to the loads so that no two experts tie


def rebalance(load: torch.Tensor, num_slots: int, slots_per_rank: int) -> ExpertPlacement:
    """The "deepinfer" policy (DS-DeepInfer's `rebalance_experts_global`). Replicate: each spare
    slot goes to the expert whose extra replica minimises the sum over steps of the step's
    bottleneck `max_e load_t[e] / cnt[e]`. Pack: replicas in descending order of window total, each
    to the rank (with a free slot) minimising `sum_t max(peak_t, rank_load_t + v_t)`, the lowest
    rank on ties."""
    with _one_thread():
        return _rebalance(_check_load(load), num_slots, slots_per_rank)


def rebalance_simple(load: torch.Tensor, num_slots: int, slots_per_rank: int) -> ExpertPlacement:
    """The public EPLB global policy on window totals: each spare slot replicates
    `argmax(total / cnt)`; replicas, heaviest first, go to the lightest rank that has a free slot."""
    with _one_thread():
        return _rebalance_simple(_check_load(load), num_slots, slots_per_rank)


def _rebalance(x: torch.Tensor, num_slots: int, slots_per_rank: int) -> ExpertPlacement:
    num_experts = x.shape[2]
    _check_slots(num_experts, num_slots, slots_per_rank)
    x = x + TIE_BREAK * torch.arange(num_experts, dtype=torch.float64)
    x = x.transpose(0, 1).contiguous()                      # [L, W, E]: layers are independent
    cnt = _replicate_by_bottleneck(x, num_slots - num_experts)
    experts = _replica_experts(cnt)
    # v [L, P, W]: each replica's share of its expert's load at every step.
    per_replica = (x / cnt[:, None, :]).transpose(1, 2)
    v = per_replica.gather(1, experts[..., None].expand(-1, -1, x.shape[1]))
    slot = _pack_by_step_peaks(v, slots_per_rank)
    return _placement(experts, slot, num_experts)


def _rebalance_simple(x: torch.Tensor, num_slots: int, slots_per_rank: int) -> ExpertPlacement:
    num_experts = x.shape[2]
    _check_slots(num_experts, num_slots, slots_per_rank)
    total = x.sum(0)                                        # [L, E]
    cnt = torch.ones_like(total)
    layers = torch.arange(total.shape[0])
    for _ in range(num_slots - num_experts):
        cnt[layers, (total / cnt).argmax(1)] += 1
    experts = _replica_experts(cnt)
    weight = (total / cnt).gather(1, experts)               # [L, P]
    slot = _pack_lightest(weight, slots_per_rank)
    return _placement(experts, slot, num_experts)


def rank_load(load: torch.Tensor, placement: ExpertPlacement, ep_size: int) -> torch.Tensor:
    """[W, L, ep] float64: each rank's load per step and layer under `placement`, each expert's load
    split evenly over its replicas."""
    x = _check_load(load)
    num_steps, num_layers, num_experts = x.shape
    if (num_layers, num_experts) != (placement.num_layers, placement.num_experts):
        raise ValueError(f"load has {num_layers} layers x {num_experts} experts; allowed: the placement's "
                         f"{placement.num_layers} x {placement.num_experts}")
    slots = placement.slots_of_rank(0, ep_size)             # validates ep_size against the slot count
    p2l = placement.phys_to_log.to("cpu", torch.int64)
    per_replica = x / placement.log_count.to("cpu", torch.float64)
    slot_load = per_replica.gather(2, p2l.expand(num_steps, -1, -1))
    return slot_load.view(num_steps, num_layers, ep_size, len(slots)).sum(-1)


def imbalance(rank_loads: torch.Tensor) -> float:
    """`sum max_rank / sum mean_rank` over all leading dims of [..., ep] (>= 1; 1 = perfect; the
    DS-DeepInfer's `moe_lb`). An all-zero window counts as perfectly balanced."""
    mean = rank_loads.mean(-1).sum().item()
    return rank_loads.amax(-1).sum().item() / mean if mean > 0 else 1.0


def should_rearrange(step: int, interval: int) -> bool:
    """Whether to rearrange once `step` steps have been counted: first after `max(1, interval // 4)`
    steps (cold-start placement), then every `interval` steps; `interval` 0 turns EPLB off. Gaps of
    a full interval (not multiples of it) keep every later window (W <= interval) inside one placement."""
    _check_int("step", step, 0)
    _check_int("interval", interval, 0)
    if interval == 0:
        return False
    first = max(1, interval // 4)
    return step >= first and (step - first) % interval == 0


@dataclass(eq=False)
class ExpertLoadStats:
    """Per-step, per-layer, per-physical-slot token counts over a ring window of the last `window`
    finished steps, recorded under `placement` (slot ids only mean something with their placement,
    so `set_placement` empties the window). Add a step's counts with `record`/`record_counts`, then
    `end_step()`. Counts are int64 on CPU."""

    placement: ExpertPlacement
    window: int
    steps: int = field(default=0, init=False)   # finished steps since the last set_placement
    _ring: torch.Tensor = field(init=False, repr=False)       # [W, L, P]
    _current: torch.Tensor = field(init=False, repr=False)    # [L, P], the step being recorded

    def __post_init__(self) -> None:
        _check_int("window", self.window, 1)
        shape = (self.placement.num_layers, self.placement.num_slots)
        self._ring = torch.zeros((self.window, *shape), dtype=torch.int64)
        self._current = torch.zeros(shape, dtype=torch.int64)

    def record(self, layer: int, physical_ids: torch.Tensor) -> None:
        """Counts one layer's routed (token, slot) pairs; -1 entries (masked rows) are not counted."""
        if not _is_int(layer) or not 0 <= layer < self.placement.num_layers:
            raise ValueError(f"layer={layer!r}; allowed: an int in [0, {self.placement.num_layers})")
        if physical_ids.is_floating_point() or physical_ids.dtype == torch.bool:
            raise ValueError(f"physical_ids is {physical_ids.dtype}; allowed: an integer tensor")
        ids = physical_ids.flatten()
        ids = ids[ids >= 0]
        counts = torch.bincount(ids, minlength=self.placement.num_slots)
        if counts.numel() > self.placement.num_slots:         # some id >= P
            raise ValueError(f"physical_ids holds {int(ids.max())}; allowed: -1 (masked) or a slot in "
                             f"[0, {self.placement.num_slots})")
        self._current[layer] += counts.cpu()

    def record_counts(self, counts: torch.Tensor) -> None:
        """Adds a [L, P] table of counts (e.g. the dispatch's expert_count) to the current step."""
        if tuple(counts.shape) != tuple(self._current.shape) or counts.is_floating_point():
            raise ValueError(f"counts is {tuple(counts.shape)} {counts.dtype}; allowed: an integer tensor of "
                             f"shape {tuple(self._current.shape)} (layers x physical slots)")
        self._current += counts.to("cpu", torch.int64)

    def end_step(self) -> None:
        """Moves the current step's counts into the window (overwriting the oldest step when full)."""
        self._ring[self.steps % self.window] = self._current
        self._current.zero_()
        self.steps += 1

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Switches to the placement of a rearrangement and empties the window."""
        if (placement.num_layers, placement.num_slots) != tuple(self._current.shape):
            raise ValueError(f"placement has {placement.num_layers} layers x {placement.num_slots} slots; "
                             f"allowed: {tuple(self._current.shape)} like the recorded one")
        self.placement = placement
        self._ring.zero_()
        self._current.zero_()
        self.steps = 0

    def counts(self) -> torch.Tensor:
        """[n, L, P] the window's finished steps, oldest first (n = min(steps, window))."""
        if self.steps < self.window:
            return self._ring[:self.steps].clone()
        return self._ring.roll(-(self.steps % self.window), dims=0)

    def logical_load(self) -> torch.Tensor:
        """[n, L, E] float64: the window's counts summed from slots to the logical experts they hold,
        the policies' input."""
        return slot_to_logical(self.counts(), self.placement)

    def balance(self, placement: ExpertPlacement | None, ep_size: int) -> float:
        """`sum_t max_rank / sum_t mean_rank` over the window's steps and layers (>= 1). With
        `placement=None` the measured one (rank load = its slots' recorded counts); with a placement,
        what the window's logical load would give under it (replicas sharing evenly), e.g. a plan.
        An empty window counts as perfectly balanced (1.0)."""
        if self.steps == 0:
            return 1.0
        if placement is None:
            slots = self.placement.slots_of_rank(0, ep_size)
            counts = self.counts().to(torch.float64)
            return imbalance(counts.view(counts.shape[0], counts.shape[1], ep_size, len(slots)).sum(-1))
        return imbalance(rank_load(self.logical_load(), placement, ep_size))


def slot_to_logical(counts: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """[n, L, E] float64 from per-slot counts [n, L, P] recorded under `placement`: each slot's count
    added to the logical expert it holds (e.g. a window all-reduced over the EP ranks)."""
    if tuple(counts.shape[1:]) != (placement.num_layers, placement.num_slots):
        raise ValueError(f"counts is {tuple(counts.shape)}; allowed: [steps, {placement.num_layers}, "
                         f"{placement.num_slots}] (steps x layers x physical slots)")
    x = counts.to("cpu", torch.float64)
    p2l = placement.phys_to_log.to("cpu", torch.int64).expand(x.shape[0], -1, -1)
    load = x.new_zeros(x.shape[0], placement.num_layers, placement.num_experts)
    return load.scatter_add_(2, p2l, x)


# ---- policy pieces (all layers at once) -------------------------------------------------------------
@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Runs a plan with one intra-op thread. Its loops issue thousands of ops on tensors of at most ~1M
    elements, where threads only add synchronisation (full size on a 2-core CPU: ~0.2 s on one thread;
    on two, no faster idle and up to 10 s when the CPU was oversubscribed); one thread also fixes the
    order of every float sum, whatever the process's thread count. Plans run between forwards
    (stop-the-world), so no other work loses its threads meanwhile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _replicate_by_bottleneck(x: torch.Tensor, spare: int) -> torch.Tensor:
    """cnt [L, E] float64 for x [L, W, E]. Only a step's argmax expert can lower that step's maximum: a
    replica of j turns the maximum of the steps j tops into max(second largest, x_t[j] / (cnt[j] + 1)).
    So the objective with j replicated is `sum_t max_t - gain_j`, gain_j summing those decreases, and
    the argmin of the objective is the argmax of the gain (first on ties; ties at a step's top give
    gain 0 whichever of them topk returns)."""
    num_layers, num_steps, num_experts = x.shape
    cnt = x.new_ones(num_layers, num_experts)
    if num_experts == 1:
        return cnt + spare
    v = x.clone()                                           # x / cnt, updated one column at a time
    layers = torch.arange(num_layers)
    for _ in range(spare):
        top2, idx = v.topk(2, dim=-1)                       # [L, W, 2]
        top, arg = top2[..., 0], idx[..., 0]
        relieved = torch.maximum(top2[..., 1], x.gather(-1, arg[..., None]).squeeze(-1) / (cnt.gather(1, arg) + 1))
        gain = x.new_zeros(num_layers, num_experts).scatter_add_(1, arg, top - relieved)
        best = gain.argmax(1)
        cnt[layers, best] += 1
        v[layers, :, best] = x[layers, :, best] / cnt[layers, best][:, None]
    return cnt


def _replica_experts(cnt: torch.Tensor) -> torch.Tensor:
    """[L, P] int64: the expert of each replica, grouped by expert in ascending id order."""
    num_layers, num_experts = cnt.shape
    ids = torch.arange(num_experts).repeat(num_layers)
    return ids.repeat_interleave(cnt.to(torch.int64).flatten()).view(num_layers, -1)


def _pack_by_step_peaks(v: torch.Tensor, slots_per_rank: int) -> torch.Tensor:
    """slot [L, P] of each replica, given its per-step load v [L, P, W]."""
    num_layers, num_slots, num_steps = v.shape
    if slots_per_rank == 1:         # one replica per rank: every assignment has the same rank loads
        return torch.arange(num_slots).expand(num_layers, -1).clone()
    ep = num_slots // slots_per_rank
    order = torch.sort(v.sum(-1), dim=1, descending=True, stable=True).indices
    rank_loads = v.new_zeros(num_layers, ep, num_steps)
    peak = v.new_zeros(num_layers, num_steps)
    used = torch.zeros(num_layers, ep, dtype=torch.int64)
    slot = torch.empty(num_layers, num_slots, dtype=torch.int64)
    layers = torch.arange(num_layers)
    for i in range(num_slots):
        rep = order[:, i]
        vi = v[layers, rep]                                 # [L, W]
        score = torch.maximum(peak[:, None, :], rank_loads + vi[:, None, :]).sum(-1)
        rank = score.masked_fill_(used == slots_per_rank, float("inf")).argmin(-1)
        rank_loads[layers, rank] += vi
        peak = torch.maximum(peak, rank_loads[layers, rank])
        slot[layers, rep] = rank * slots_per_rank + used[layers, rank]
        used[layers, rank] += 1
    return slot


def _pack_lightest(weight: torch.Tensor, slots_per_rank: int) -> torch.Tensor:
    """slot [L, P] of each replica: heaviest first to the lightest rank with a free slot."""
    num_layers, num_slots = weight.shape
    ep = num_slots // slots_per_rank
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    rank_loads = weight.new_zeros(num_layers, ep)
    used = torch.zeros(num_layers, ep, dtype=torch.int64)
    slot = torch.empty(num_layers, num_slots, dtype=torch.int64)
    layers = torch.arange(num_layers)
    for i in range(num_slots):
        rep = order[:, i]
        rank = rank_loads.masked_fill(used == slots_per_rank, float("inf")).argmin(-1)
        rank_loads[layers, rank] += weight[layers, rep]
        slot[layers, rep] = rank * slots_per_rank + used[layers, rank]
        used[layers, rank] += 1
    return slot


def _placement(experts: torch.Tensor, slot: torch.Tensor, num_experts: int) -> ExpertPlacement:
    phys_to_log = torch.empty_like(experts).scatter_(1, slot, experts)
    return ExpertPlacement.from_phys_to_log(phys_to_log, num_experts)


def _check_load(load: object) -> torch.Tensor:
    """load as float64 on CPU (the plan is computed on one rank and broadcast)."""
    if not isinstance(load, torch.Tensor) or load.dim() != 3 or min(load.shape) < 1 or load.is_complex():
        shape = tuple(load.shape) if isinstance(load, torch.Tensor) else type(load).__name__
        raise ValueError(f"load is {shape}; allowed: a real tensor [steps >= 1, layers >= 1, experts >= 1]")
    x = load.to("cpu", torch.float64)
    if not torch.isfinite(x).all() or (x < 0).any():
        raise ValueError("load has negative or non-finite entries; allowed: token counts >= 0")
    return x


def _check_slots(num_experts: int, num_slots: int, slots_per_rank: int) -> None:
    _check_int("slots_per_rank", slots_per_rank, 1)
    if not _is_int(num_slots) or num_slots < num_experts or num_slots % slots_per_rank:
        raise ValueError(f"num_slots={num_slots!r}; allowed: an int >= num_experts ({num_experts}) and a "
                         f"multiple of slots_per_rank ({slots_per_rank})")
