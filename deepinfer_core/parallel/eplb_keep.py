"""EPLB: a new placement laid over the current one so that as few expert weights as possible move.

The policies (eplb.py) decide which replicas share a rank (the rank's bin) without looking at where the
experts are now. Two freedoms leave a plan's balance exactly as it is and decide what must move:

* which rank gets which bin: rank loads are the bins' loads whatever the order, so the bins are given
  to the ranks that already hold most of their experts (a transfer is an expert a rank lacks);
* which slot of its rank an expert takes: an expert the rank keeps stays in the slot it had, so the
  slot is not rewritten (no local copy either).

Bins go to ranks greedily: the (bin, rank) pair with the largest overlap first, the lowest bin, then
the lowest rank on ties; the policy's own order (bin r on rank r) is kept instead when it overlaps
more, so this never moves more than the plan as it came. Deterministic, as every rank must reach the
same maps (eplb.py); O(R^2) set intersections per layer.
"""
from __future__ import annotations

from collections import Counter

import torch

from .expert_map import ExpertPlacement


def keep_in_place(old: ExpertPlacement, new: ExpertPlacement, ep_size: int) -> ExpertPlacement:
    """`new`'s bins over the ranks and slots where `old` already has their experts (same rank loads,
    same replica counts); layers are independent."""
    if old.phys_to_log.shape != new.phys_to_log.shape or old.num_experts != new.num_experts:
        raise ValueError(f"keep_in_place: placements of {tuple(old.phys_to_log.shape)} and "
                         f"{tuple(new.phys_to_log.shape)} slots; allowed: the same layers, slots and experts")
    if old.num_slots % ep_size:
        raise ValueError(f"keep_in_place: {old.num_slots} slots over ep_size={ep_size} ranks; allowed: a divisor")
    rows = [_layer(o, n, ep_size) for o, n in zip(old.phys_to_log.tolist(), new.phys_to_log.tolist())]
    return ExpertPlacement.from_phys_to_log(torch.tensor(rows, dtype=old.phys_to_log.dtype), old.num_experts)


def _layer(old: list[int], new: list[int], ep_size: int) -> list[int]:
    per = len(old) // ep_size
    old_slots = [old[r * per:(r + 1) * per] for r in range(ep_size)]
    bins = [Counter(new[b * per:(b + 1) * per]) for b in range(ep_size)]
    held = [Counter(s) for s in old_slots]
    overlap = [[sum((bins[b] & held[r]).values()) for r in range(ep_size)] for b in range(ep_size)]
    pairs = sorted(((overlap[b][r], b, r) for b in range(ep_size) for r in range(ep_size)),
                   key=lambda p: (-p[0], p[1], p[2]))
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, b, r in pairs:
        if b not in rank_of and r not in taken:
            rank_of[b] = r
            taken.add(r)
    if sum(overlap[b][r] for b, r in rank_of.items()) < sum(overlap[b][b] for b in range(ep_size)):
        rank_of = {b: b for b in range(ep_size)}
    out = [0] * len(old)
    for b, r in rank_of.items():
        out[r * per:(r + 1) * per] = _slots(old_slots[r], bins[b])
    return out


def _slots(current: list[int], wanted: Counter) -> list[int]:
    """The rank's slots holding `wanted`: kept experts where they are, the others in the freed slots in
    ascending expert order."""
    left = Counter(wanted)
    out: list[int | None] = [None] * len(current)
    for i, e in enumerate(current):
        if left[e] > 0:
            out[i] = e
            left[e] -= 1
    incoming = iter(sorted(left.elements()))
    return [e if e is not None else next(incoming) for e in out]
