"""Expert-parallel dispatch and combine of fixed size: no host synchronisation, so a decode step's
forward, MoE exchanges included, can be captured in a CUDA graph (every send
segment is padded to a fixed size).

Every EP rank passes the same number of rows B (the decode graph's bucket, agreed by the ranks each
step: `step_vote.py`; the caller routes padding rows nowhere (ids -1: `EPMoEMethod.live_rows`) and drops
their outputs):

    res = dispatch_padded(x, topk_ids, topk_weights, slots_per_rank, group)
        one all-gather of every rank's rows with their slot ids and weights: res.x [W*B, D];
        res.local_ids [W*B, K] the local slot of each (row, k) this rank holds, -1 elsewhere
    expert_out [W*B, K, D] = each (row, k) with a local slot: its weighted expert output (other
        entries are never read, whatever they hold)
    routed = combine_padded(expert_out, res.handle, init=shared)
        one all-to-all gives every rank the [B, K, D] outputs of its own rows from every rank; each
        (token, k) takes the one from the rank that owns its slot, added in k order in fp32 after
        `init`: the additions of `ep_comm.combine`, so the same bits for the same expert outputs.

Bytes per layer and rank: W*B rows received by the all-gather, (W-1)*B*K output rows sent back, all
of them whatever the routing (the variable path sends a token once per rank that needs it and only
the pairs computed). At decode batch sizes that costs less than the variable path's host round trip.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ep_comm import EPCommError, _as_bytes, _check_dispatch_args, _from_bytes
from .groups import all_gather_rows, group_size_rank


@dataclass(frozen=True)
class PaddedHandle:
    """What `combine_padded` needs; opaque to callers."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    num_tokens: int           # B, the same on every rank
    topk: int
    owner: torch.Tensor       # [B, K] int64: rank holding each of this rank's (token, k); world = none


@dataclass(frozen=True)
class PaddedDispatch:
    x: torch.Tensor           # [W*B, D] every rank's rows, rank-major
    local_ids: torch.Tensor   # [W*B, K] int64 local slot of each (row, k) on this rank, -1 elsewhere
    weights: torch.Tensor     # [W*B, K] routing weights (topk_weights' dtype)
    slot_counts: torch.Tensor  # [S] int64 (row, k) pairs per local slot (EPLB receive counts)
    handle: PaddedHandle


def dispatch_padded(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, slots_per_rank: int,
                    group: dist.ProcessGroup | None = None) -> PaddedDispatch:
    """Every rank's B rows to every rank (one all-gather), with the local slot of each (row, k) here.
    Ids outside [-1, W*S) are not checked (that would need the host); they are treated as -1."""
    _check_dispatch_args(x, topk_ids, topk_weights, slots_per_rank)
    world, rank = group_size_rank(group)
    num_tokens, topk = topk_ids.shape
    hidden, dev = x.shape[1], x.device
    ids = topk_ids.to(device=dev, dtype=torch.int64)
    weights = topk_weights.to(dev)
    num_slots = world * slots_per_rank
    ids = torch.where((ids >= 0) & (ids < num_slots), ids, -1)
    payload = torch.cat([_as_bytes(x), _as_bytes(ids.to(torch.int32)), _as_bytes(weights)], dim=1)
    gathered = payload.new_empty(world * num_tokens, payload.shape[1])
    try:
        all_gather_rows(gathered, payload, group)
    except RuntimeError as exc:
        raise EPCommError(f"EP padded dispatch: all-gather failed on EP rank {rank} of {world}: {exc}") from exc
    x_bytes = hidden * x.element_size()
    all_x = _from_bytes(gathered[:, :x_bytes], x.dtype, (hidden,))
    all_ids = _from_bytes(gathered[:, x_bytes:x_bytes + 4 * topk], torch.int32, (topk,)).to(torch.int64)
    all_w = _from_bytes(gathered[:, x_bytes + 4 * topk:], weights.dtype, (topk,))
    local = all_ids - rank * slots_per_rank
    here = (all_ids >= 0) & (local >= 0) & (local < slots_per_rank)
    local_ids = torch.where(here, local, -1)
    slot_counts = torch.zeros(slots_per_rank + 1, dtype=torch.int64, device=dev).index_add_(
        0, (local_ids + 1).flatten(), torch.ones(local_ids.numel(), dtype=torch.int64, device=dev))[1:]
    owner = torch.where(ids >= 0, ids // slots_per_rank, world)
    handle = PaddedHandle(group, rank, world, num_tokens, topk, owner)
    return PaddedDispatch(all_x, local_ids, all_w, slot_counts, handle)


def combine_padded(expert_out: torch.Tensor, handle: PaddedHandle, init: torch.Tensor | None = None) -> torch.Tensor:
    """[W*B, K, D] outputs per (row, k) of the gathered rows -> [B, D] for this rank's rows: `init` (or
    zeros) plus each (token, k)'s output from the rank owning its slot, k = 0..K-1, in fp32 (fp64 for
    fp64 outputs)."""
    world, tokens, topk = handle.world, handle.num_tokens, handle.topk
    if expert_out.dim() != 3 or tuple(expert_out.shape[:2]) != (world * tokens, topk):
        raise ValueError(f"expert_out.shape={tuple(expert_out.shape)}: must be [W*B, K, D] = "
                         f"[{world * tokens}, {topk}, D]")
    hidden = expert_out.shape[2]
    if handle.group is None:
        back = expert_out.view(1, tokens, topk, hidden)
    else:
        wire = _as_bytes(expert_out)            # any dtype over any backend, bit for bit
        back_bytes = torch.empty_like(wire)
        try:
            dist.all_to_all_single(back_bytes, wire, group=handle.group)
        except RuntimeError as exc:
            raise EPCommError(f"EP padded combine: all_to_all_single failed on EP rank {handle.rank} of "
                              f"{world}: {exc}") from exc
        back = _from_bytes(back_bytes, expert_out.dtype, (topk, hidden)).view(world, tokens, topk, hidden)
    acc_dtype = torch.float64 if expert_out.dtype == torch.float64 else torch.float32
    if init is None:
        out = torch.zeros(tokens, hidden, dtype=acc_dtype, device=expert_out.device)
    elif tuple(init.shape) != (tokens, hidden):
        raise ValueError(f"init.shape={tuple(init.shape)}: must be [B, D] = [{tokens}, {hidden}]")
    else:
        out = init.to(dtype=acc_dtype, device=expert_out.device, copy=True)
    # (rank, token, k) -> one flat row of `back`; slots held nowhere read an appended zero row
    flat = back.reshape(-1, hidden)
    flat = torch.cat([flat, flat.new_zeros(1, hidden)])
    rows = torch.arange(tokens, device=out.device)
    for k in range(topk):                   # fixed order k = 0..K-1, as ep_comm.combine
        index = (handle.owner[:, k] * tokens + rows) * topk + k
        index = torch.where(handle.owner[:, k] < world, index, flat.shape[0] - 1)
        out += flat[index].to(acc_dtype)
    return out
