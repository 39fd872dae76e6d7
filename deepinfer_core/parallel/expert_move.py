"""EPLB weight moves: give every physical slot the weights of its logical expert under a new placement,
over the EP group, while the engine keeps its requests (DS-DeepInfer's P2P path).

Per MoE layer whose `phys_to_log` changed (every rank decides from the same two maps, so every rank
takes part in the same exchanges in the same order):
* a slot that keeps its expert is not touched;
* a slot whose expert this rank already holds (in another slot, before the move) is filled by a local
  copy;
* every other expert a rank needs is received once from a rank that holds it now (`plan_transfers`:
  senders = holders in rank order, receivers = the ranks that need it and lack it, receiver j served by
  sender j // n for j < n*s with n = m // s, the rest round-robin: both ends compute the same pairing),
  then copied into each of the slots that need it.
All of one layer's transfers travel in one `all_to_all_single` of raw bytes (the sizes are known to
every rank from the plan, so no size exchange). What moves is every parameter and buffer of the slot's
expert module, byte for byte in the dtype it is stored in: FP8/FP4 weights with their UE8M0 scales on
a backend that keeps them quantised, the dequantised weights of the portable CPU method. Bit-exact by
construction (a uint8 view both ways), so a moved expert computes the same bits as before.

Hazard this avoids: a slot's old weights may be the source of another slot's new ones (a swap), so all
of a layer's sources are read (received or copied out) before any slot is written; scratch is one
layer's moved experts. Writes are in place (`copy_`), so the modules and any reference to their
tensors stay valid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .ep_comm import _all_to_all
from .expert_map import ExpertPlacement
from .groups import group_size_rank


@dataclass(frozen=True, order=True)
class Transfer:
    """One expert's weights sent from EP rank `src` (a holder under the old placement) to `dst`."""

    expert: int
    src: int
    dst: int


@dataclass
class MoveStats:
    """What one rank did in one or more rearrangements (plain ints: logs, tests)."""

    layers_changed: int = 0  # layers whose phys_to_log changed (the same count on every rank)
    experts_sent: int = 0  # expert copies this rank sent to other ranks
    experts_received: int = 0  # expert copies this rank received from other ranks
    bytes_sent: int = 0
    bytes_received: int = 0
    local_copies: int = 0  # slots filled from another slot of this rank
    slots_changed: int = 0  # this rank's slots that got another expert

    def add(self, other: MoveStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def plan_transfers(old_p2l: Sequence[int], new_p2l: Sequence[int], ep_size: int) -> list[Transfer]:
    """The transfers of one layer, sorted by (expert, src, dst): each rank receives each expert it needs
    and lacks exactly once, from a rank that holds it under `old_p2l` (DS-DeepInfer's pairing)."""
    if len(old_p2l) != len(new_p2l) or len(old_p2l) % ep_size:
        raise ValueError(
            f"maps of {len(old_p2l)} and {len(new_p2l)} slots; allowed: equal lengths divisible by ep_size={ep_size}"
        )
    per_rank = len(old_p2l) // ep_size
    old_sets = [set(old_p2l[r * per_rank : (r + 1) * per_rank]) for r in range(ep_size)]
    new_sets = [set(new_p2l[r * per_rank : (r + 1) * per_rank]) for r in range(ep_size)]
    out = []
    for e in sorted(set(new_p2l)):
        receivers = [r for r in range(ep_size) if e in new_sets[r] and e not in old_sets[r]]
        if not receivers:
            continue
        senders = [r for r in range(ep_size) if e in old_sets[r]]
        if not senders:
            raise ValueError(
                f"logical expert {e} has no slot in the old placement; allowed: maps where every expert has a slot"
            )
        n, s = len(receivers) // len(senders), len(senders)
        for j, dst in enumerate(receivers):
            src = senders[j // n] if j < n * s else senders[(j - n * s) % s]
            out.append(Transfer(e, src, dst))
    return out


def expert_tensors(expert: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors that make an expert (parameters and buffers), by name: the order both ends of a
    transfer pack them in."""
    named = dict(expert.named_parameters())
    named.update(expert.named_buffers())
    return sorted(named.items())


def _layout(experts: Sequence[nn.Module], layer: int) -> tuple[list[tuple[str, torch.dtype, tuple]], int]:
    """(name, dtype, shape) of each tensor, shared by every slot of the layer, and the bytes per expert."""
    layouts = [[(n, t.dtype, tuple(t.shape)) for n, t in expert_tensors(m)] for m in experts]
    if any(lay != layouts[0] for lay in layouts):
        raise ValueError(
            f"layer {layer}: the slots' experts hold different tensors; EPLB moves need one layout "
            "per layer (names, dtypes, shapes)"
        )
    for name, t in expert_tensors(experts[0]):
        if not t.is_contiguous():
            raise ValueError(f"layer {layer}: expert tensor {name} is not contiguous; moves write it in place")
    nbytes = sum(t.numel() * t.element_size() for _, t in expert_tensors(experts[0]))
    return layouts[0], nbytes


def pack_expert(expert: nn.Module) -> torch.Tensor:
    """The expert's tensors as one uint8 vector (a copy), in `expert_tensors` order."""
    parts = [t.detach().reshape(-1).view(torch.uint8) for _, t in expert_tensors(expert)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


@torch.no_grad()
def unpack_expert(expert: nn.Module, data: torch.Tensor) -> None:
    """Writes `pack_expert`'s bytes into the expert's tensors, in place."""
    offset = 0
    for _, t in expert_tensors(expert):
        n = t.numel() * t.element_size()
        t.detach().view(-1).view(torch.uint8).copy_(data[offset : offset + n])
        offset += n
    if offset != data.numel():
        raise ValueError(f"{data.numel()} bytes for an expert of {offset} bytes")


@torch.no_grad()
def move_experts(
    layers: Sequence[nn.Module],
    old: ExpertPlacement,
    new: ExpertPlacement,
    ep_rank: int,
    ep_size: int,
    group: dist.ProcessGroup | None,
    slot_modules: Callable[[nn.Module], Sequence[nn.Module]] = lambda moe: moe.experts,
) -> MoveStats:
    """Rewrites this rank's slots of every layer (`slot_modules(moe)`: one module per slot, in order,
    holding that slot's tensors; `moe.experts` by default; index by `moe.layer_id`) from `old` to `new`.
    Every rank of `group` must call it with the same maps."""
    world, rank = group_size_rank(group)
    if (world, rank) != (ep_size, ep_rank):
        raise ValueError(f"EP rank {ep_rank} of {ep_size}, but the group says rank {rank} of {world}")
    if (old.num_layers, old.num_slots) != (new.num_layers, new.num_slots):
        raise ValueError("old and new placements differ in layers or slots; allowed: one shape")
    mine = old.slots_of_rank(ep_rank, ep_size)
    stats = MoveStats()
    for moe in layers:
        layer = moe.layer_id
        o, n = old.phys_to_log[layer].tolist(), new.phys_to_log[layer].tolist()
        if o == n:
            continue
        stats.layers_changed += 1
        experts = slot_modules(moe)
        if len(experts) != len(mine):
            raise ValueError(f"layer {layer} holds {len(experts)} experts; allowed: this rank's {len(mine)} slots")
        _, nbytes = _layout(experts, layer)
        o_loc, n_loc = o[mine.start : mine.stop], n[mine.start : mine.stop]
        transfers = plan_transfers(o, n, ep_size)
        sends = sorted((t.dst, t.expert) for t in transfers if t.src == ep_rank)
        recvs = sorted((t.src, t.expert) for t in transfers if t.dst == ep_rank)
        device = next(iter(experts[0].buffers()), torch.empty(0)).device
        payload = (
            torch.cat([pack_expert(experts[o_loc.index(e)]) for _, e in sends])
            if sends
            else torch.empty(0, dtype=torch.uint8, device=device)
        )
        in_sizes = [nbytes * sum(1 for d, _ in sends if d == r) for r in range(ep_size)]
        out_sizes = [nbytes * sum(1 for s, _ in recvs if s == r) for r in range(ep_size)]
        recv = _all_to_all(payload, out_sizes, in_sizes, group, "EPLB expert move", ep_rank, ep_size)
        received = {e: recv[i * nbytes : (i + 1) * nbytes] for i, (_, e) in enumerate(recvs)}
        # every source is read before any slot is written (a slot may be another slot's source)
        fills = []
        for j, e in enumerate(n_loc):
            if o_loc[j] == e:
                continue
            if e in o_loc:
                fills.append((j, pack_expert(experts[o_loc.index(e)])))
                stats.local_copies += 1
            else:
                fills.append((j, received[e]))
        for j, data in fills:
            unpack_expert(experts[j], data)
        stats.slots_changed += len(fills)
        stats.experts_sent += len(sends)
        stats.experts_received += len(recvs)
        stats.bytes_sent += sum(in_sizes)
        stats.bytes_received += sum(out_sizes)
    return stats
