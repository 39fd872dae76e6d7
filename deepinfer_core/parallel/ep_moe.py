"""Expert-parallel MoE inside the model: the MoE method of an EP rank.

One MoE layer on EP rank r (every rank of the EP group, an idle one with T = 0 rows too):
    route locally (the wrapped method's gate: logical top-k, tid2eid on hash layers) ->
    (portable order: sort each token's top-k by logical expert id) -> physical slots (`choose_physical`) ->
    dispatch -> this rank's slots run on the pairs they received (the wrapped method's expert math) ->
    combine, starting the sum from the shared expert's output.

The seam to the wrapped single-process method is `EPExperts` (route, shared expert, the received pairs'
expert outputs, the slots' weights for EPLB): the method's own `ep_experts()` when it has one (the
NVIDIA backend's grouped FP8/FP4 GEMMs over the received pairs), else `PortableEPExperts`.

Invariants:
* Exactly one `dispatch` and one `combine` per layer call, whatever T is (0 included): the EP group's
  collectives stay in step as long as every rank calls the same layers in the same order.
* Order of additions per token = the wrapped method's: fp32 shared-expert output first, then the routed
  contributions in its order (`sort_by_expert`: the portable loop walks experts ascending, so the top-k
  is sorted by id first; a fused method that sums in route order keeps it). With a row-invariant expert
  GEMM (the batch-invariant feature) the result is bitwise that of the single-process method, for any EP
  size, placement or replica choice; with the plain GEMMs the expert rows see other batch shapes, so
  only the last bits may differ.
* The portable expert math is the wrapped method's: `moe.experts[slot](rows, route_weight, silu=inner.silu)`,
  i.e. the same `Expert.forward` (SwiGLU clamp, weight before w2, dtype casts) and the same bound linear
  method (QAT activation fake-quant included). Only the experts of this rank's slots are kept
  (`shard_experts`); replicas on one rank are copies of the same logical expert.
* Loading (`ExpertShard` passed to `load_model`): the graph is built on the meta device and
  `prune_remote_experts` empties the experts no slot of this rank holds, so the loader skips their
  tensors (a rank reads only `phys_to_log[own slots]`, each logical expert once) and the dummy load format
  gives memory to this rank's experts only. The EP method is bound before `process_weights`, so the
  wrapped method processes (packs, re-encodes) this rank's slots alone.
* MTP / drafter blocks keep the wrapped method and all their experts (local, no collective): only the
  main layers are expert-parallel so far.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from .ep_comm import DispatchResult, combine, dispatch
from .ep_padded import PaddedDispatch, combine_padded, dispatch_padded
from .expert_map import ExpertPlacement, choose_physical

_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")    # a main layer's routed expert


@dataclass(frozen=True)
class ExpertShard:
    """This rank's share of the routed experts: what the loader reads and the MoE method runs.
    `group` None = a world of one (then `ep_size` is 1). `graph_group`: the same ranks on a
    communicator of their own for the exchanges decode CUDA graphs hold (None: `group`)."""

    placement: ExpertPlacement
    ep_rank: int
    ep_size: int
    group: dist.ProcessGroup | None = None
    graph_group: dist.ProcessGroup | None = None


def local_slots_logical(placement: ExpertPlacement, layer: int, ep_rank: int, ep_size: int) -> list[int]:
    """Logical expert held by each of EP rank `ep_rank`'s slots in `layer`, in slot order."""
    slots = placement.slots_of_rank(ep_rank, ep_size)
    return placement.phys_to_log[layer, slots.start:slots.stop].tolist()


def shard_experts(experts: Sequence[nn.Module], placement: ExpertPlacement, layer: int, ep_rank: int,
                  ep_size: int) -> nn.ModuleList:
    """The experts of this rank's slots, in slot order, from a layer's full list of logical experts.

    The first slot of a logical expert takes the loaded module itself; a further replica on this rank
    gets a deep copy, so each slot owns its buffers (weight moves of EPLB rewrite one slot, not two)."""
    if len(experts) != placement.num_experts:
        raise ValueError(f"{len(experts)} experts in layer {layer}; the placement has {placement.num_experts} "
                         "logical experts per layer (shard a full, unsharded layer)")
    seen: set[int] = set()
    local = []
    for e in local_slots_logical(placement, layer, ep_rank, ep_size):
        local.append(experts[e] if e not in seen else copy.deepcopy(experts[e]))
        seen.add(e)
    return nn.ModuleList(local)


class EPExperts(Protocol):
    """What an EP rank needs from the single-process MoE method it wraps (the method's `ep_experts()`,
    else `PortableEPExperts`). Resolved once when the EP method is built; called per layer."""

    sort_by_expert: bool    # combine adds a token's experts in ascending logical id (else in route order)

    def route(self, moe: nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, K] fp32, logical expert ids [T, K] int) of this rank's tokens."""

    def shared(self, moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output [T, D] in fp32: where each token's sum starts."""

    def pairs(self, moe: nn.Module, res: DispatchResult) -> torch.Tensor:
        """[P, D] the weighted output of each received (row, local slot) pair, in `res`'s order."""

    def pairs_padded(self, moe: nn.Module, res: PaddedDispatch) -> torch.Tensor:
        """[W*B, K, D]: for each (row, k) of `res.x` with `res.local_ids >= 0`, its weighted output;
        the other entries are never read. No host synchronisation (it runs inside CUDA graphs)."""

    def slot_modules(self, moe: nn.Module) -> Sequence[nn.Module]:
        """One module per local slot whose tensors (parameters and buffers) are that slot's weights, in
        place: EPLB rewrites them byte for byte (`expert_move`)."""


@dataclass
class EPMoEMethod:
    """MoE method of one EP rank; wraps the single-process method chosen by `deepinfer_moe_method`
    (PortableMoE or a subclass) for its gate, elementwise functions and expert math.

    `group` None = a world of one (no collective; the local path of ep_comm), then `ep_size` must be 1.
    `placement` covers the model's main MoE layers (index = `moe.layer_id`)."""

    inner: object
    placement: ExpertPlacement
    ep_rank: int
    ep_size: int
    group: dist.ProcessGroup | None = None
    # the padded exchanges' communicator (decode graphs): a PG whose host-side bookkeeping sees the
    # capture only, never the replays, must not also carry eager collectives; None: `group`
    graph_group: dist.ProcessGroup | None = None
    # EPLB load recording (None = off): [L, S] int64, pairs received per local slot since the last take
    load_counts: torch.Tensor | None = field(default=None, repr=False)
    padded: bool = False           # exchange with ep_padded (fixed sizes, CUDA-graph safe): `padded_exchange`
    # with `padded`: a 0-d int64 device tensor, the batch's real rows; the rest (a decode graph's padding)
    # route nowhere: no expert computes them and EPLB does not count them
    live_rows: torch.Tensor | None = field(default=None, repr=False)
    ops: EPExperts = field(init=False, repr=False)

    def __post_init__(self) -> None:
        make = getattr(self.inner, "ep_experts", None)
        self.ops = make() if make is not None else PortableEPExperts(self.inner)
        if self.placement.num_slots % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size}: must divide the placement's {self.placement.num_slots} "
                             "physical slots per layer")
        if self.group is not None and dist.get_world_size(self.group) != self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} but the EP group has {dist.get_world_size(self.group)} ranks")
        if self.group is None and self.ep_size != 1:
            raise ValueError(f"ep_size={self.ep_size} needs an EP process group (group=None is a world of one)")

    @property
    def batch_invariant(self) -> bool:
        return bool(getattr(self.inner, "batch_invariant", False))

    @property
    def slots_per_rank(self) -> int:
        return self.placement.num_slots // self.ep_size

    def start_load_recording(self, device: torch.device | str) -> None:
        """EPLB: from now on every layer call adds the (token, slot) pairs this rank received per local
        slot (dispatch's `slot_counts`, hash-routed layers included) to `load_counts`: one tensor add per
        layer on the experts' device, no host sync and no per-token work. Started twice, it keeps its
        tensor (zeroed): decode graphs captured after the first start add into that one."""
        if self.load_counts is not None:
            self.load_counts.zero_()
            return
        self.load_counts = torch.zeros(self.placement.num_layers, self.slots_per_rank, dtype=torch.int64,
                                       device=device)

    def take_load_counts(self) -> torch.Tensor:
        """[L, S] the counts recorded since the last take (then zeroed); recording must be on."""
        if self.load_counts is None:
            raise RuntimeError("take_load_counts: load recording is off (start_load_recording first)")
        out = self.load_counts.clone()
        self.load_counts.zero_()
        return out

    def process_weights(self, moe: nn.Module) -> None:
        """Keep only this rank's slots, then the wrapped method's runtime form (so a method that packs
        the experts packs this rank's slots, in slot order)."""
        self.shard(moe)
        self.inner.process_weights(moe)

    def shard(self, moe: nn.Module) -> None:
        """`moe.experts` becomes the list of this rank's slots; a layer already sharded (its
        `ep_sharded` flag) is left alone."""
        if getattr(moe, "ep_sharded", False):
            return
        moe.experts = shard_experts(moe.experts, self.placement, moe.layer_id, self.ep_rank, self.ep_size)
        moe.ep_sharded = True

    def apply(self, moe: nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ops, num_tokens = self.ops, x.shape[0]
        if num_tokens:
            weights, idx = ops.route(moe, x, input_ids)
            shared = ops.shared(moe, x)
        else:       # an idle rank: nothing to route, but it must still serve the others' rows
            topk = moe.gate.topk
            weights = torch.empty(0, topk, dtype=torch.float32, device=x.device)
            idx = torch.empty(0, topk, dtype=torch.int64, device=x.device)
            shared = torch.empty(0, x.shape[1], dtype=torch.float32, device=x.device)
        if ops.sort_by_expert:
            # ascending logical id per token: combine's k order is then the portable loop's expert order
            idx, perm = torch.sort(idx, dim=1, stable=True)
            weights = weights.gather(1, perm)
        rows = torch.arange(num_tokens, device=x.device)
        phys = choose_physical(idx, rows, self.ep_rank, self.placement, moe.layer_id).to(x.device)
        if self.padded:
            if self.live_rows is not None:
                phys = torch.where(rows[:, None] < self.live_rows, phys, -1)
            res = dispatch_padded(x, phys, weights, self.slots_per_rank, self.graph_group or self.group)
            out = combine_padded(ops.pairs_padded(moe, res), res.handle, init=shared)
        else:
            res = dispatch(x, phys, weights, self.slots_per_rank, self.group)
            out = combine(ops.pairs(moe, res), res.handle, init=shared)
        if self.load_counts is not None:
            self.load_counts[moe.layer_id] += res.slot_counts.to(self.load_counts.device)
        return out.to(x.dtype)

    @contextmanager
    def padded_exchange(self, live_rows: torch.Tensor | None = None):
        """Inside: every layer exchanges with `ep_padded` (fixed sizes, no host sync: what a CUDA graph
        records). Every rank of the group must be inside for the same calls, with the same row count.
        `live_rows` (0-d int64 on the device, read when the graph replays): the first rows are real,
        the others padding, routed nowhere."""
        self.padded, self.live_rows = True, live_rows
        try:
            yield
        finally:
            self.padded, self.live_rows = False, None

    def slot_modules(self, moe: nn.Module) -> Sequence[nn.Module]:
        """What EPLB moves, one module per local slot (`expert_move.move_experts`)."""
        return self.ops.slot_modules(moe)


class PortableEPExperts:
    """`EPExperts` of the core's PortableMoE (and of any method that keeps the experts a per-expert list
    and routes like it): the wrapped method's gate and elementwise functions, each slot's `Expert.forward`
    on the rows it received (SwiGLU clamp, routing weight before w2, the bound linear method)."""

    sort_by_expert = True       # the portable loop adds the experts in ascending id order

    def __init__(self, inner) -> None:
        self.inner = inner

    def route(self, moe: nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inner = self.inner
        return inner.route(moe.gate, x, input_ids, inner.gate_logits(moe.gate, x), inner.softplus)

    def shared(self, moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return moe.shared_experts(x, silu=self.inner.silu).float()

    def pairs(self, moe: nn.Module, res: DispatchResult) -> torch.Tensor:
        """One call per local slot with rows (its pairs are contiguous: dispatch orders them by slot)."""
        out = res.x.new_empty(res.row_index.shape[0], res.x.shape[1])
        start = 0
        for slot, n in enumerate(res.slot_counts.tolist()):
            if n == 0:
                continue
            seg = slice(start, start + n)
            out[seg] = moe.experts[slot](res.x[res.row_index[seg]], res.weights[seg], silu=self.inner.silu)
            start += n
        return out

    def pairs_padded(self, moe: nn.Module, res: PaddedDispatch) -> torch.Tensor:
        """Per local slot, its (row, k) pairs in row-major order: the rows (source rank, token) and k
        order `pairs` sees, so each expert call gets the same batch as on the variable path."""
        x, local_ids = res.x, res.local_ids
        out = x.new_zeros(*local_ids.shape, x.shape[1])
        for slot in range(len(moe.experts)):
            rows, ks = (local_ids == slot).nonzero(as_tuple=True)
            if rows.numel():
                out[rows, ks] = moe.experts[slot](x[rows], res.weights[rows, ks], silu=self.inner.silu)
        return out

    def slot_modules(self, moe: nn.Module) -> Sequence[nn.Module]:
        return moe.experts


def prune_remote_experts(model: nn.Module, shard: ExpertShard) -> Callable[[str], bool]:
    """Before loading (model on the meta device): replace each main layer's logical experts that no slot
    of this rank holds by an empty module (no buffers, so the loader expects none of their tensors).
    Returns the loader's `skip` predicate: exactly the checkpoint names of the removed experts."""
    removed: set[tuple[int, int]] = set()
    for i, moe in enumerate(moe_layers(model)):
        keep = set(local_slots_logical(shard.placement, moe.layer_id, shard.ep_rank, shard.ep_size))
        for e in range(len(moe.experts)):
            if e not in keep:
                moe.experts[e] = nn.Module()
                removed.add((i, e))

    def skip(name: str) -> bool:
        m = _EXPERT_NAME.match(name)
        return m is not None and (int(m[1]), int(m[2])) in removed
    return skip


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The main MoE layers in forward order (MTP / drafter blocks are not expert-parallel yet)."""
    return [layer.ffn for layer in model.layers]


@torch.no_grad()
def bind_expert_parallel(model: nn.Module, placement: ExpertPlacement, ep_rank: int, ep_size: int,
                         group: dist.ProcessGroup | None,
                         graph_group: dist.ProcessGroup | None = None) -> EPMoEMethod:
    """After `bind_ops`, before `process_weights`: wrap every main MoE layer's method in one EPMoEMethod
    and keep only the experts of this rank's slots (in slot order), so that `process_weights` gives the
    wrapped method this rank's slots. Returns the method (shared by the layers)."""
    layers = moe_layers(model)
    if placement.num_layers != len(layers):
        raise ValueError(f"placement has {placement.num_layers} layers; the model has {len(layers)} MoE layers")
    inners = {type(m.method) for m in layers}
    if len(inners) != 1:
        raise ValueError(f"MoE layers use different methods {sorted(t.__name__ for t in inners)}; one expected")
    method = EPMoEMethod(layers[0].method, placement, ep_rank, ep_size, group, graph_group)
    for moe in layers:
        moe.method = method
        method.shard(moe)
    return method


@torch.no_grad()
def idle_forward(model: nn.Module, dtype: torch.dtype) -> None:
    """The MoE half of a placeholder forward: a rank with no tokens this step joins every main MoE
    layer's dispatch and combine, in forward order, with T = 0 (it computes the others' rows)."""
    hidden = model.cfg.hidden_size
    device = model.embed.weight.device
    x = torch.empty(0, hidden, dtype=dtype, device=device)
    ids = torch.empty(0, dtype=torch.int64, device=device)
    for moe in moe_layers(model):
        if not isinstance(moe.method, EPMoEMethod):
            raise TypeError("idle_forward needs expert-parallel MoE layers (bind_expert_parallel first)")
        moe.method.apply(moe, x, ids)
