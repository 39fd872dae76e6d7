"""Where each routed expert lives: physical slots, the logical<->physical maps and the replica choice.

Invariants of an `ExpertPlacement` (checked on construction, per layer l):
* `P = E + R` physical slots; EP rank r owns the contiguous slots `[r*P/ep, (r+1)*P/ep)`.
* `phys_to_log[l, s]` is the logical expert held by slot s; every logical expert has >= 1 slot.
* `log_count[l, e]` is the number of slots holding e (its replicas).
* `log_to_phys[l, e, :log_count[l, e]]` lists those slots (distinct), the rest of the row is -1; the
  row has room for `R + 1` entries, the most one expert can have when every spare slot replicates it.
  `from_phys_to_log` lists them in ascending slot order, which makes the maps a function of
  `phys_to_log` alone (ranks that agree on it agree on everything).

The replica choice `(ep_rank + row * 23333) mod log_count[e]` spreads an expert's tokens evenly over
its replicas: consecutive rows cycle through all replicas because 23333 is prime (coprime with any
replica count below it), and different EP ranks start the cycle at different replicas.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

REPLICA_HASH_PRIME = 23333          # the constant of the gate kernel's replica choice


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, value: object, low: int) -> int:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name}={value!r}; allowed: an int >= {low}")
    return value


def padded_redundant(num_experts: int, ep_size: int, num_redundant: int) -> int:
    """`num_redundant` rounded up so that `(num_experts + R) % ep_size == 0` (every rank gets the same
    number of slots)."""
    _check_int("num_experts", num_experts, 1)
    _check_int("ep_size", ep_size, 1)
    _check_int("num_redundant", num_redundant, 0)
    return num_redundant + (-(num_experts + num_redundant)) % ep_size


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Per-layer expert maps (int32, on one device). Compare two with `equals` (tensors have no `==`)."""

    phys_to_log: torch.Tensor       # [L, P]
    log_to_phys: torch.Tensor       # [L, E, R + 1], -1 padded
    log_count: torch.Tensor         # [L, E]

    def __post_init__(self) -> None:
        _validate(self.phys_to_log, self.log_to_phys, self.log_count)

    @property
    def num_layers(self) -> int:
        return self.phys_to_log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phys_to_log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.log_count.shape[1]

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_experts

    @classmethod
    def initial(cls, num_layers: int, num_experts: int, ep_size: int, num_redundant: int) -> ExpertPlacement:
        """The load-time placement of every layer: slot s < E holds logical s, spare slot E + i holds
        logical `i mod E`. `num_redundant` is rounded up to a multiple that fills all ranks equally."""
        _check_int("num_layers", num_layers, 1)
        r = padded_redundant(num_experts, ep_size, num_redundant)
        if r != num_redundant:
            log.warning("num_redundant=%d rounded up to %d so that %d experts + redundant fill ep_size=%d "
                        "ranks equally", num_redundant, r, num_experts, ep_size)
        slots = torch.arange(num_experts + r, dtype=torch.int32) % num_experts
        return cls.from_phys_to_log(slots.expand(num_layers, -1).clone(), num_experts)

    @classmethod
    def from_phys_to_log(cls, phys_to_log: torch.Tensor, num_experts: int) -> ExpertPlacement:
        """Builds `log_count` and `log_to_phys` (slots in ascending order) from `phys_to_log` [L, P]."""
        return cls(*_maps_from_phys_to_log(phys_to_log, num_experts))

    def slots_of_rank(self, rank: int, ep_size: int) -> range:
        """The physical slots EP rank `rank` owns (contiguous, P/ep of them)."""
        _check_int("ep_size", ep_size, 1)
        if self.num_slots % ep_size:
            raise ValueError(f"ep_size={ep_size}; allowed: a divisor of the {self.num_slots} slots per layer")
        if not _is_int(rank) or not 0 <= rank < ep_size:
            raise ValueError(f"rank={rank!r}; allowed: an int in [0, {ep_size})")
        per_rank = self.num_slots // ep_size
        return range(rank * per_rank, (rank + 1) * per_rank)

    def copy_(self, other: ExpertPlacement) -> None:
        """Switches these maps to `other`'s in place (same shapes), so every holder of this placement
        or of its tensors (the MoE method, captured device graphs) sees the new maps at once. Both are
        validated placements, so the copy is one too."""
        if (other.phys_to_log.shape, other.log_to_phys.shape) != (self.phys_to_log.shape, self.log_to_phys.shape):
            raise ValueError(f"placement of shape {tuple(other.phys_to_log.shape)} / {tuple(other.log_to_phys.shape)}; "
                             f"allowed: this one's {tuple(self.phys_to_log.shape)} / {tuple(self.log_to_phys.shape)}")
        for mine, theirs in ((self.phys_to_log, other.phys_to_log), (self.log_to_phys, other.log_to_phys),
                             (self.log_count, other.log_count)):
            mine.copy_(theirs)

    def to(self, device: torch.device | str) -> ExpertPlacement:
        """A copy of the maps on `device` (an EP rank routes with maps on its experts' device; the EPLB
        planner works on a CPU copy)."""
        return ExpertPlacement(self.phys_to_log.to(device, copy=True), self.log_to_phys.to(device, copy=True),
                               self.log_count.to(device, copy=True))

    def clone(self) -> ExpertPlacement:
        return ExpertPlacement(self.phys_to_log.clone(), self.log_to_phys.clone(), self.log_count.clone())

    def equals(self, other: ExpertPlacement) -> bool:
        return all(torch.equal(a, b) for a, b in ((self.phys_to_log, other.phys_to_log),
                                                   (self.log_to_phys, other.log_to_phys),
                                                   (self.log_count, other.log_count)))


def choose_physical(logical_ids: torch.Tensor, rows: torch.Tensor, ep_rank: int,
                    placement: ExpertPlacement, layer: int) -> torch.Tensor:
    """Physical slot of each (token, selected expert): replica `(ep_rank + row * 23333) mod log_count[e]`
    of expert e. `logical_ids` [T, K] (-1 = masked, stays -1), `rows` [T] the tokens' row indices in
    this rank's batch. Returns int64 [T, K] (torch's index dtype), on the maps' device."""
    if logical_ids.dim() != 2:
        raise ValueError(f"logical_ids has shape {tuple(logical_ids.shape)}; allowed: [tokens, top_k]")
    if rows.dim() != 1 or rows.shape[0] != logical_ids.shape[0]:
        raise ValueError(f"rows has shape {tuple(rows.shape)}; allowed: [{logical_ids.shape[0]}] "
                         f"(one row index per token of logical_ids)")
    _check_int("ep_rank", ep_rank, 0)
    if not _is_int(layer) or not 0 <= layer < placement.num_layers:
        raise ValueError(f"layer={layer!r}; allowed: an int in [0, {placement.num_layers})")
    ids = logical_ids.to(torch.int64)
    masked = ids < 0
    ids = ids.clamp(min=0)          # masked entries look up expert 0, then are overwritten with -1
    count = placement.log_count[layer].to(torch.int64)[ids]
    # int64: row * 23333 overflows int32 past ~92k rows.
    replica = (ep_rank + rows.to(torch.int64)[:, None] * REPLICA_HASH_PRIME) % count
    phys = placement.log_to_phys[layer].to(torch.int64)[ids, replica]
    return phys.masked_fill(masked, -1)


def _check_tensor(name: str, t: object, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} is a {type(t).__name__}; allowed: a torch.Tensor")
    if t.dim() != dims or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} is a {t.dim()}-d {t.dtype} tensor; allowed: a {dims}-d integer tensor")


def _maps_from_phys_to_log(phys_to_log: torch.Tensor, num_experts: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phys_to_log, log_to_phys, log_count) as int32, the slots of an expert in ascending order."""
    _check_int("num_experts", num_experts, 1)
    _check_tensor("phys_to_log", phys_to_log, 2)
    p2l = phys_to_log.to(torch.int64)
    num_layers, num_slots = p2l.shape
    if num_slots < num_experts:
        raise ValueError(f"phys_to_log has {num_slots} slots per layer; allowed: >= num_experts "
                         f"({num_experts}), one slot per expert at least")
    bad = (p2l < 0) | (p2l >= num_experts)
    if bad.any():
        raise ValueError(f"phys_to_log holds {p2l[bad][0].item()}; allowed: logical ids 0..{num_experts - 1}")
    count = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=p2l.device)
    count.scatter_add_(1, p2l, torch.ones_like(p2l))
    missing = (count == 0).nonzero()
    if len(missing):
        layer, expert = missing[0].tolist()
        raise ValueError(f"phys_to_log: layer {layer} has no slot for logical expert {expert} "
                         f"({len(missing)} missing in all); allowed: every expert in >= 1 slot")
    # Group the slots by expert (stable: ascending slot order within an expert); a slot's column in
    # log_to_phys is its position in the sorted list minus where its expert's group starts.
    order = torch.sort(p2l, dim=1, stable=True).indices
    expert = p2l.gather(1, order)
    starts = count.cumsum(1) - count
    column = torch.arange(num_slots, device=p2l.device) - starts.gather(1, expert)
    width = num_slots - num_experts + 1
    log_to_phys = torch.full((num_layers, num_experts, width), -1, dtype=torch.int32, device=p2l.device)
    layer = torch.arange(num_layers, device=p2l.device)[:, None].expand_as(order)
    log_to_phys[layer, expert, column] = order.to(torch.int32)
    return p2l.to(torch.int32), log_to_phys, count.to(torch.int32)


def _validate(phys_to_log: torch.Tensor, log_to_phys: torch.Tensor, log_count: torch.Tensor) -> None:
    for name, t, dims in (("phys_to_log", phys_to_log, 2), ("log_to_phys", log_to_phys, 3),
                          ("log_count", log_count, 2)):
        _check_tensor(name, t, dims)
        if t.dtype != torch.int32:
            raise ValueError(f"{name} is {t.dtype}; allowed: torch.int32")
    num_layers, num_slots = phys_to_log.shape
    num_experts = log_count.shape[1]
    width = num_slots - num_experts + 1
    if (num_layers < 1 or num_experts < 1 or width < 1 or log_count.shape[0] != num_layers
            or tuple(log_to_phys.shape) != (num_layers, num_experts, width)):
        raise ValueError(f"log_count {tuple(log_count.shape)} and log_to_phys {tuple(log_to_phys.shape)} do not fit "
                         f"phys_to_log {tuple(phys_to_log.shape)}; allowed: [L, E] and [L, E, P - E + 1] for "
                         f"phys_to_log [L, P] with L >= 1 and P >= E >= 1")
    # The other two maps must be exactly what phys_to_log implies, up to the order of an expert's slots.
    _, canonical_log_to_phys, canonical_count = _maps_from_phys_to_log(phys_to_log, num_experts)
    if not torch.equal(log_count, canonical_count):
        raise ValueError("log_count disagrees with phys_to_log; allowed: the number of slots of each expert")
    valid = log_to_phys >= 0
    in_front = torch.arange(log_to_phys.shape[2], device=log_to_phys.device) < log_count[..., None]
    if not torch.equal(valid, in_front):
        raise ValueError("log_to_phys rows must hold log_count slot ids first, then -1 padding")
    if not torch.equal(log_to_phys.sort(dim=2).values, canonical_log_to_phys.sort(dim=2).values):
        raise ValueError("log_to_phys disagrees with phys_to_log; allowed: each expert's slots, each slot once")

