"""`EPExperts` of the Ascend MoE method (`AscendMoE.ep_experts`): an expert-parallel rank's route,
shared expert and received pairs on torch_npu's grouped matmul, the core's `EPMoEMethod` around it
(deepinfer_core/parallel/ep_moe.py). Nothing here has run on Ascend hardware.

On an EP rank the layer holds this rank's S slots only (in slot order) when
`AscendMoE.process_weights` runs, so a stacked layer's `npu_w13` / `npu_w2` (and MX scales) have S
experts: slot j at index j. Per layer call:
* `route` = `AscendMoE`'s routing (the core's portable one), in route order (`sort_by_expert`
  False): the single-process layer sums each token's k rows in that order
  (`npu_moe_token_unpermute`), and so does ep_comm's combine, after the shared expert;
* `shared` = the shared expert through its own linear layers, in fp32 (as `AscendMoE.apply`);
* `pairs` = the received (row, local slot) pairs through `AscendMoE.expert_rows`. The exchange has
  done init_routing's work already: the pairs come expert-major with per-slot counts, which are the
  grouped matmul's `group_list` as they are; and combine does unpermute's (the weighted sum per
  token in fp32). No routing operator runs here: the two grouped matmuls and the SwiGLU only;
* `pairs_padded` (the fixed-size exchange that decode graphs hold; no host synchronisation) =
  `npu_moe_init_routing_v2` over every gathered (row, k) with `active_expert_range` [0, S): the
  pairs held elsewhere (local id -1, passed as S) are sorted last, the grouped matmuls run on all
  rows with those in the last group (computed, never read: the grouped matmul's counts must cover
  every row), and each (row, k) reads its output back through `expanded_row_idx`.
A layer the method left unstacked (its portable fallback) goes to the core's `PortableEPExperts`,
whose per-expert loop adds in ascending expert id: `route` sorts such a layer's top-k.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepinfer_core.parallel.ep_comm import DispatchResult
from deepinfer_core.parallel.ep_moe import PortableEPExperts
from deepinfer_core.parallel.ep_padded import PaddedDispatch

_SLOT_BUFFERS = ("npu_w13", "npu_w2", "npu_s13", "npu_s2")


class AscendEPExperts:
    """The EP seam of one `AscendMoE` (shared by its layers; per-layer state lives on the MoE)."""

    sort_by_expert = False      # stacked layers sum in route order; unstacked ones sort in `route`

    def __init__(self, method) -> None:
        self.method = method
        self.portable = PortableEPExperts(method)

    def route(self, moe: nn.Module, x: torch.Tensor,
              input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, idx = self.portable.route(moe, x, input_ids)
        if self.method.stacked(moe):
            return weights, idx
        idx, perm = torch.sort(idx, dim=1, stable=True)        # the portable loop's order
        return weights.gather(1, perm), idx

    def shared(self, moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.portable.shared(moe, x)

    def pairs(self, moe: nn.Module, res: DispatchResult) -> torch.Tensor:
        """[P, D] in the compute dtype, the pairs' order (expert-major, as the grouped matmul
        wants them). P is a shape: an empty receive launches nothing."""
        if not self.method.stacked(moe):
            return self.portable.pairs(moe, res)
        if res.row_index.shape[0] == 0:
            return res.x.new_empty(0, res.x.shape[1])
        return self.method.expert_rows(moe, res.x[res.row_index], res.weights.float(),
                                       res.slot_counts)

    def pairs_padded(self, moe: nn.Module, res: PaddedDispatch) -> torch.Tensor:
        """[W*B, K, D]: each (row, k) with a local slot gets its weighted expert output; the others
        hold whatever the last group computed for them (never read)."""
        if not self.method.stacked(moe):
            return self.portable.pairs_padded(moe, res)
        n, k = res.local_ids.shape
        slots, pairs = moe.npu_w13.shape[0], n * k
        ids = torch.where(res.local_ids >= 0, res.local_ids, slots).to(torch.int32)
        rows, row_idx, counts, _ = self.method._init_routing(
            res.x, ids, active_num=pairs, expert_num=slots + 1, active_expert_range=[0, slots],
            expert_tokens_num_type=1, expert_tokens_num_flag=True, row_idx_type=0)
        held = row_idx >= 0                     # row_idx: (row, k) -> its sorted row, -1 elsewhere
        counts = counts.clone()
        counts[-1] += pairs - counts.sum()      # the rows held elsewhere ride in the last group
        # each sorted row's routing weight (the rows held elsewhere: 0, from the extra entry)
        target = torch.where(held, row_idx.long(), pairs)
        w_rows = res.weights.new_zeros(pairs + 1, dtype=torch.float32).scatter_(
            0, target, res.weights.reshape(-1).float())[:pairs]
        y = self.method.expert_rows(moe, rows, w_rows, counts)
        return y[torch.where(held, row_idx.long(), 0)].view(n, k, -1)

    def slot_modules(self, moe: nn.Module) -> Sequence[nn.Module]:
        """Stacked: one fresh module per local slot whose buffers are views of slot j in the stacks
        (writing them writes the stacks; not registered on `moe`, so nothing is moved twice)."""
        if not self.method.stacked(moe):
            return self.portable.slot_modules(moe)
        return [_slot_view(moe, j) for j in range(moe.npu_w13.shape[0])]


def _slot_view(moe: nn.Module, j: int) -> nn.Module:
    view = nn.Module()
    for name in _SLOT_BUFFERS:
        stack = getattr(moe, name)
        if stack is not None:           # the plain form has no weight scales
            view.register_buffer(name[4:], stack[j], persistent=False)
    return view
