"""Expert-parallel dispatch and combine over torch.distributed: the portable all-to-all (the
torch fallback for hosts without DeepEP), gloo on CPU and NCCL on GPUs with the same code.

Flow of one MoE layer on every EP rank:
    res = dispatch(x, topk_ids, topk_weights, slots_per_rank, group)
    expert_out[i] = expert_{res.local_slot[i]}(res.x[res.row_index[i]]) weighted by res.weights[i]
    routed = combine(expert_out, res.handle)          # [T, D] fp32; the caller adds the shared expert

Contract:
* `topk_ids` are physical slot ids (−1 = no expert: placeholder/padding rows, skipped k); rank r owns
  slots [r·S, (r+1)·S). Dispatch sends each token once per destination rank (deduplicated over its
  slots there) together with, per top-k position, its local slot (or −1) and routing weight.
* The receiver sees the (token, slot) pairs grouped by local slot ascending, and within a slot by
  (source rank, source token): the layout a grouped GEMM wants; `slot_counts` are its sizes and the
  EPLB receive counts.
* Combine returns every (token, slot) contribution to its source rank separately (no per-rank partial
  sums) and the source adds them in top-k order k = 0..K−1 in fp32 (fp64 for fp64 input). The result
  therefore does not depend on the number of EP ranks nor on which rank holds which expert,
  and a world of one (`group=None`, the local path: no collective) gives the same bits as any EP size.
* Every rank of the group must call dispatch and combine the same number of times in the same order.
  An idle DP rank calls them with T = 0: it sends nothing but still receives and returns others' rows.
  A peer that died or skipped a call surfaces as `EPCommError` (closed connection, or the group's
  timeout) instead of a hang.
* Sizes are exchanged first and read on the host (one device-to-host copy per dispatch, which also
  carries the id check; combine has none), so this path is not CUDA-graph safe; decode graphs use the
  fixed-size exchange of ep_padded.py.

Seam for faster transports (DeepEP V2/V1, a fused mega-MoE kernel, Ascend): `dispatch` and `combine`
are the whole interface. A plugin provides the same two functions with the same `DispatchResult`
fields (received rows, expert-major pair index, local slots, weights, per-slot counts) and an opaque
handle of its own; the MoE method never looks inside the handle. To stay bit-identical with this path
it must not pre-reduce per rank (DeepEP: allow_multiple_reduction off).

Byte counters (`CommBytes`, per call, plain ints): payload bytes this rank sends to other ranks
("remote") and to itself ("local"), for dispatch (token rows + per-row slot/weight metadata) and for
combine (contributions). The size exchange (8 bytes per rank and call) is not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .groups import group_size_rank


class EPCommError(RuntimeError):
    """A dispatch/combine collective failed: a peer died, fell out of step, or the group timed out."""


@dataclass
class CommBytes:
    """Payload bytes this rank sent in one dispatch/combine pair (filled by each call)."""

    dispatch_remote: int = 0
    dispatch_local: int = 0
    combine_remote: int = 0
    combine_local: int = 0


@dataclass(frozen=True)
class CombineHandle:
    """What combine needs from dispatch; opaque to callers (a DeepEP plugin keeps its own)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    num_tokens: int           # T on this (source) rank
    topk: int                 # K
    expert_order: torch.Tensor     # [P] wire position of each expert-major pair
    pairs_from: list[int]     # pairs this rank computed for each source rank (combine send sizes)
    pairs_to: list[int]       # pairs of this rank's tokens computed by each rank (combine receive sizes)
    gather_index: torch.Tensor     # [T, K] row of the returned contributions per (token, k); P_sent = none
    comm_bytes: CommBytes


@dataclass(frozen=True)
class DispatchResult:
    """Rows received by this rank and their (token, slot) pairs in expert-major order."""

    x: torch.Tensor            # [M, D] received token rows, ordered by (source rank, source token)
    row_index: torch.Tensor    # [P] int64: row of `x` of each pair
    local_slot: torch.Tensor   # [P] int64: local slot of each pair, ascending
    weights: torch.Tensor      # [P] routing weight of each pair (topk_weights' dtype)
    slot_counts: torch.Tensor  # [S] int64: pairs per local slot (grouped-GEMM sizes; EPLB counts)
    handle: CombineHandle


def _all_to_all(inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: dist.ProcessGroup | None,
                what: str, rank: int, world: int) -> torch.Tensor:
    """all_to_all_single along dim 0 with uneven sizes; the local world of one is the identity."""
    if group is None:
        return inp
    out = inp.new_empty((sum(out_sizes), *inp.shape[1:]))
    try:
        dist.all_to_all_single(out, inp.contiguous(), out_sizes, in_sizes, group=group)
    except RuntimeError as exc:          # DistBackendError and gloo/NCCL errors are RuntimeErrors
        raise EPCommError(
            f"EP {what}: all_to_all_single failed on EP rank {rank} of {world}: {exc}\n"
            "Every EP rank must call dispatch and combine the same number of times (an idle rank with T = 0 "
            "too); a peer that died or skipped a call shows up as a closed connection or the group timeout."
        ) from exc
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N, row bytes] uint8 view: one payload for any dtype (fp8, bf16, fp64), bit-exact."""
    per_row = math.prod(t.shape[1:])     # explicit: view(N, -1) is ambiguous when N == 0
    return t.contiguous().view(t.shape[0], per_row).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return b.contiguous().view(dtype).view(b.shape[0], *shape)


def _true_at(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat positions (row-major) of `mask`'s True entries, of which the caller knows there are `count`:
    boolean indexing would read that number back from the device (a host sync)."""
    return torch.nonzero_static(mask.flatten(), size=count).squeeze(1)


def _check_dispatch_args(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         slots_per_rank: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"x.shape={tuple(x.shape)}: must be [T, D]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids.shape={tuple(topk_ids.shape)}: must be [T, K] with T={x.shape[0]} (x's rows)")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights.shape={tuple(topk_weights.shape)}: must equal topk_ids.shape "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids.dtype={topk_ids.dtype}: must be an integer dtype")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights.dtype={topk_weights.dtype}: must be a floating dtype")
    if isinstance(slots_per_rank, bool) or not isinstance(slots_per_rank, int) or slots_per_rank < 1:
        raise ValueError(f"slots_per_rank={slots_per_rank!r}: must be an int >= 1")


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, slots_per_rank: int,
             group: dist.ProcessGroup | None = None) -> DispatchResult:
    """Send each token row to the EP ranks owning its slots. `x` [T, D] (T may be 0), `topk_ids` [T, K]
    physical slot ids (−1 = none), `topk_weights` [T, K]; `group` None = world of one, no collective."""
    _check_dispatch_args(x, topk_ids, topk_weights, slots_per_rank)
    world, rank = group_size_rank(group)
    num_tokens, topk = topk_ids.shape
    hidden = x.shape[1]
    dev = x.device
    ids = topk_ids.to(device=dev, dtype=torch.int64)
    weights = topk_weights.to(dev)
    num_slots = world * slots_per_rank
    bad = ((ids < -1) | (ids >= num_slots)).any().view(1)      # reported after the sizes' host copy
    dest = torch.where((ids >= 0) & (ids < num_slots), ids // slots_per_rank, -1)    # [T, K]

    # Sizes first: rows (a token once per destination rank) and (token, slot) pairs to each rank, in
    # one all-to-all; the receiver learns both from each rank. Everything the host needs (sizes both
    # ways and the id check) then comes over in ONE device-to-host copy, the only host sync of a
    # dispatch/combine pair; the index lists below are built with those sizes (`nonzero_static`).
    sends = torch.zeros(num_tokens, world + 1, dtype=torch.bool, device=dev)
    sends.scatter_(1, dest + 1, True)             # column 0 collects the −1 entries and is dropped
    counts_to = torch.stack([sends[:, 1:].sum(0), torch.zeros(world + 1, dtype=torch.int64, device=dev).index_add_(
        0, (dest + 1).flatten(), torch.ones(dest.numel(), dtype=torch.int64, device=dev))[1:]], dim=1)
    counts_from = _all_to_all(counts_to, [1] * world, [1] * world, group, "dispatch sizes", rank, world)
    host = torch.cat([counts_to.flatten(), counts_from.flatten(), bad.to(torch.int64)]).tolist()
    if host[-1]:
        bad_id = ids[(ids < -1) | (ids >= num_slots)][0].item()
        raise ValueError(f"topk_ids contains {bad_id}: allowed values: -1 (none) or a physical slot in "
                         f"[0, {num_slots}) = {world} ranks × slots_per_rank={slots_per_rank}")
    send_sizes, pairs_to = host[0:2 * world:2], host[1:2 * world:2]
    recv_sizes, pairs_from = host[2 * world:4 * world:2], host[2 * world + 1:4 * world:2]

    # one row per (token, destination rank), listed rank-major then by token: that is the send layout
    row_rank, row_token = torch.nonzero_static(sends[:, 1:].t(), size=sum(send_sizes)).unbind(1)
    here = dest[row_token] == row_rank[:, None]   # [N, K]: top-k positions this row carries
    row_slots = torch.where(here, ids[row_token] - row_rank[:, None] * slots_per_rank, -1).to(torch.int32)
    row_weights = torch.where(here, weights[row_token], torch.zeros((), dtype=weights.dtype, device=dev))
    payload = torch.cat([_as_bytes(x[row_token]), _as_bytes(row_slots), _as_bytes(row_weights)], dim=1)

    # combine receives this rank's pairs in (destination rank, token, k) order: rows are rank-major,
    # and `here` is walked row-major
    positions = (row_token[:, None] * topk + torch.arange(topk, device=dev)).flatten()
    pair_pos = positions[_true_at(here, sum(pairs_to))]
    gather_index = torch.full((num_tokens * topk,), pair_pos.numel(), dtype=torch.int64, device=dev)
    gather_index[pair_pos] = torch.arange(pair_pos.numel(), device=dev)

    recv = _all_to_all(payload, recv_sizes, send_sizes, group, "dispatch rows", rank, world)
    row_bytes = payload.shape[1]
    x_bytes = hidden * x.element_size()
    rx = _from_bytes(recv[:, :x_bytes], x.dtype, (hidden,))
    rslots = _from_bytes(recv[:, x_bytes:x_bytes + 4 * topk], torch.int32, (topk,))
    rweights = _from_bytes(recv[:, x_bytes + 4 * topk:], weights.dtype, (topk,))

    # pairs in wire order (source rank, source token, k), then stably by local slot: expert-major
    flat = _true_at(rslots >= 0, sum(pairs_from))
    wire_row = flat // topk
    wire_slot = rslots.flatten()[flat].to(torch.int64)
    order = torch.argsort(wire_slot, stable=True)
    slot_counts = torch.zeros(slots_per_rank, dtype=torch.int64, device=dev).index_add_(
        0, wire_slot, torch.ones_like(wire_slot))

    sent = CommBytes(dispatch_remote=(row_rank.numel() - send_sizes[rank]) * row_bytes,
                     dispatch_local=send_sizes[rank] * row_bytes)
    handle = CombineHandle(group=group, rank=rank, world=world, num_tokens=num_tokens, topk=topk,
                           expert_order=order, pairs_from=pairs_from, pairs_to=pairs_to,
                           gather_index=gather_index.view(num_tokens, topk), comm_bytes=sent)
    return DispatchResult(x=rx, row_index=wire_row[order], local_slot=wire_slot[order],
                          weights=rweights.flatten()[flat][order], slot_counts=slot_counts, handle=handle)


def combine(expert_out: torch.Tensor, handle: CombineHandle, init: torch.Tensor | None = None) -> torch.Tensor:
    """Return each pair's output to its source rank and sum per token in top-k order.

    `expert_out` [P, D]: one row per pair of the DispatchResult, in its (expert-major) order, already
    weighted. Returns [T, D] in fp32 (fp64 when `expert_out` is fp64); tokens with no expert get 0.
    `init` [T, D]: where the sum starts instead of zeros (cast to the accumulation dtype), so a caller
    can add the shared expert first, as the single-process MoE does (same bits, same order).
    """
    num_pairs = handle.expert_order.numel()
    if expert_out.dim() != 2 or expert_out.shape[0] != num_pairs:
        raise ValueError(f"expert_out.shape={tuple(expert_out.shape)}: must be [P, D] with P={num_pairs} "
                         "(one row per dispatched pair)")
    hidden = expert_out.shape[1]
    wire = torch.empty_like(expert_out)
    wire[handle.expert_order] = expert_out                   # back to (source rank, token, k) order
    back_bytes = _all_to_all(_as_bytes(wire), handle.pairs_to, handle.pairs_from, handle.group, "combine",
                             handle.rank, handle.world)
    acc_dtype = torch.float64 if expert_out.dtype == torch.float64 else torch.float32
    back = _from_bytes(back_bytes, expert_out.dtype, (hidden,)).to(acc_dtype)
    back = torch.cat([back, back.new_zeros(1, hidden)])     # the row that skipped (token, k) gather
    if init is None:
        out = torch.zeros(handle.num_tokens, hidden, dtype=acc_dtype, device=expert_out.device)
    elif tuple(init.shape) != (handle.num_tokens, hidden):
        raise ValueError(f"init.shape={tuple(init.shape)}: must be [T, D] = [{handle.num_tokens}, {hidden}]")
    else:
        out = init.to(dtype=acc_dtype, device=expert_out.device, copy=True)
    for k in range(handle.topk):             # fixed order k = 0..K−1: one add per position
        out += back[handle.gather_index[:, k]]

    row_bytes = hidden * expert_out.element_size()
    local = handle.pairs_from[handle.rank] * row_bytes
    handle.comm_bytes.combine_local = local
    handle.comm_bytes.combine_remote = num_pairs * row_bytes - local
    return out
