"""`EPExperts` of the NVIDIA MoE method (`NvidiaMoEMethod.ep_experts`): an expert-parallel rank's route,
shared expert and received pairs on the grouped FP8/FP4 GEMMs of `deepinfer_kernels.moe`.

On an EP rank the wrapped method's `process_weights` saw only this rank's S slots (in slot order), so
a fused layer's stacks hold the slots at 0..S-1 and the shared expert at S (`nv_fused.n_routed`
= S), unless it runs beside them (`nv_fused.shared_stacked`: V4.1's 32x32 FP8 blocks).
Per layer call:
* `route` = the fused method's routing (`route_topk`) minus its shared column, in route order
  (`sort_by_expert` False): the single-process combine adds slots 0..k-1 in that order, and so does
  ep_comm's combine;
* `shared` = `expert_outputs` of the shared expert alone (ids S, weight 1.0, as the fused call gives
  it), or, not stacked, its own linear layers (as `NvidiaMoEMethod.apply` runs it then);
* `pairs` = `expert_outputs` of the received (row, local slot) pairs, one slot per row (K1 = 1), already
  expert-major (dispatch orders them by slot), with the routing weight in w13's epilogue as always;
  `pairs_padded` (the fixed-size exchange of decode graphs) = one call over all gathered rows with their
  K local ids, -1 (held elsewhere) falling in no slot's tiles.
Same numerics flags and tile choice (override, batch-invariant set) as `NvidiaMoEMethod.apply`, and no
host synchronisation (P is a shape). The combine then sums shared first, then k = 0..K-1 in fp32 and
casts to x's dtype, exactly as `moe_combine`. So a world of one without replicas is bitwise
`NvidiaMoEMethod.apply` whenever both pick the same tile set (a fixed `config`, or the batch-invariant
sets): every expert tile then holds the same rows in the same order. The plain heuristic picks tiles by
rows per expert, which differ here (the pairs and the shared expert are separate calls), and a 64-row
(wgmma) tile may round a row unlike a 16/32-row one: last bits only.

A layer the method left unfused (its portable fallback) goes to the core's `PortableEPExperts` over
`method.portable`; since `sort_by_expert` is one flag for every layer, its top-k is sorted by expert id
here in `route`, which gives the portable loop's ascending-id order of additions.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from deepinfer_kernels.fp4_experts import Fp4Experts
from deepinfer_kernels.moe import expert_outputs, moe_tile_config
from torch import nn

from deepinfer_core.parallel.ep_comm import DispatchResult
from deepinfer_core.parallel.ep_moe import PortableEPExperts
from deepinfer_core.parallel.ep_padded import PaddedDispatch

from .fused_spec import FusedSpec, FusingMoEMethod


class NvidiaEPExperts:
    """The EP seam of one `NvidiaMoEMethod` (shared by all its layers; per-layer state lives on the MoE)."""

    sort_by_expert = False      # fused layers sum in route order; unfused ones are sorted in `route`

    def __init__(self, method: FusingMoEMethod) -> None:
        self.method = method
        self.portable = PortableEPExperts(method.portable)

    def route(self, moe: nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.method.fused(moe):
            weights, idx = self.portable.route(moe, x, input_ids)
            idx, perm = torch.sort(idx, dim=1, stable=True)        # the portable loop's ascending-id order
            return weights.gather(1, perm), idx
        ids, weights = self.method.route(moe, x, input_ids)
        topk = moe.gate.topk            # the last column is the shared expert: `shared` computes it
        return weights[:, :topk], ids[:, :topk].to(torch.int64)

    def shared(self, moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        spec = getattr(moe, "nv_fused", None)
        if spec is None or not spec.shared_stacked:
            return self.portable.shared(moe, x)
        num_tokens = x.shape[0]
        ids = torch.full((num_tokens, 1), spec.n_routed, dtype=torch.int32, device=x.device)
        ones = torch.ones((num_tokens, 1), dtype=torch.float32, device=x.device)
        y = self._outputs(moe, spec, x, ids, ones, self._config(spec, num_tokens, 1, x.device))
        return y.view(num_tokens, x.shape[1]).float()

    def pairs(self, moe: nn.Module, res: DispatchResult) -> torch.Tensor:
        spec = getattr(moe, "nv_fused", None)
        if spec is None:
            return self.portable.pairs(moe, res)
        num_pairs, hidden = res.row_index.shape[0], res.x.shape[1]
        rows = res.x[res.row_index]     # the GEMM gathers by pair; act_quant is per row, so the same bits
        ids = res.local_slot.to(torch.int32).view(num_pairs, 1)
        weights = res.weights.to(torch.float32).view(num_pairs, 1)
        y = self._outputs(moe, spec, rows, ids, weights, self._config(spec, num_pairs, spec.n_routed, rows.device))
        return y.view(num_pairs, hidden)

    def pairs_padded(self, moe: nn.Module, res: PaddedDispatch) -> torch.Tensor:
        """[W*B, K, D] in the compute dtype: one `expert_outputs` call over every gathered (row, k), the
        pairs held elsewhere (local id -1) sorted ahead of slot 0 and so in no slot's tiles (left
        unwritten). Each slot's rows are then the variable path's, in its order (source rank, token, k)."""
        spec = getattr(moe, "nv_fused", None)
        if spec is None:
            return self.portable.pairs_padded(moe, res)
        rows, topk = res.local_ids.shape
        ids = res.local_ids.to(torch.int32)
        weights = res.weights.to(torch.float32)
        # tiles by the pairs this rank holds on average (its share of the W*B*K), not all of them
        config = self._config(spec, rows * topk // res.handle.world, spec.n_routed, res.x.device)
        return self._outputs(moe, spec, res.x, ids, weights, config)

    def slot_modules(self, moe: nn.Module) -> Sequence[nn.Module]:
        """Fused: one fresh module per local slot whose buffers are views of slot j in the stacked tensors
        (writing them writes the stacks; not registered on `moe`, so nothing is saved or moved twice)."""
        spec = getattr(moe, "nv_fused", None)
        if spec is None:
            return self.portable.slot_modules(moe)
        return [_slot_view(moe, spec, j) for j in range(spec.n_routed)]

    def _outputs(self, moe: nn.Module, spec: FusedSpec, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 config: dict) -> torch.Tensor:
        """[rows, K1, D] in the compute dtype: `expert_outputs` with `NvidiaMoEMethod.apply`'s flags."""
        w13, w2 = moe.nv_w13, moe.nv_w2
        if spec.n_fp4:
            w13 = Fp4Experts(moe.nv_w13_codes, moe.nv_w13_groups, w13)
            w2 = Fp4Experts(moe.nv_w2_codes, moe.nv_w2_groups, w2)
        return expert_outputs(x, ids, weights, w13, moe.nv_s13, w2, moe.nv_s2, n_clamped=spec.n_clamped,
                              swiglu_limit=spec.swiglu_limit, quant_in=spec.quant_in, quant_mid=spec.quant_mid,
                              compute_dtype=spec.compute_dtype, config=config)

    def _config(self, spec: FusedSpec, rows: int, experts: int, device: torch.device) -> dict:
        """Tiles for `rows` rows over `experts` experts: the method's override or batch-invariant set
        (`NvidiaMoEMethod._config`), else the heuristic by mean rows per expert (the shared expert: one
        expert with every row, not the stack's S + 1)."""
        config = self.method._config(spec, rows, 1, experts, device)
        if config is not None:
            return config
        wide = spec.compute_dtype == torch.float32 and not (spec.quant_in and spec.quant_mid)
        return moe_tile_config(rows, 1, experts, wide_fp32=wide, fp4=spec.n_fp4 > 0,
                               fp8_activations=spec.quant_in and spec.quant_mid)


def _slot_view(moe: nn.Module, spec: FusedSpec, j: int) -> nn.Module:
    """Slot j's weights as views: FP4-kept slots (j < n_fp4) their codes and scale bytes, the others
    their e4m3 rows (the FP8 stacks start at expert n_fp4), each with its FP8 block scales."""
    view = nn.Module()
    if j < spec.n_fp4:
        names = ("nv_w13_codes", "nv_w13_groups", "nv_w2_codes", "nv_w2_groups")
        tensors = {name[3:]: getattr(moe, name)[j] for name in names}
    else:
        tensors = dict(w13=moe.nv_w13[j - spec.n_fp4], w2=moe.nv_w2[j - spec.n_fp4])
    tensors.update(s13=moe.nv_s13[j], s2=moe.nv_s2[j])
    for name, t in tensors.items():
        view.register_buffer(name, t, persistent=False)
    return view
