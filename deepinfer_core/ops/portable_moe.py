"""Portable MoE method: route, run each expert on the tokens it received, combine in fp32."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PortableMoE:
    def process_weights(self, moe) -> None:
        gate = moe.gate
        gate.register_buffer("weight", gate.weight.float(), persistent=False)

    @staticmethod
    def route(gate, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) — the bias picks experts but never weights them."""
        scores = torch.sqrt(F.softplus(x.float() @ gate.weight.t()))
        if gate.hash_routed:
            idx = gate.tid2eid[input_ids]
        else:
            # stable sort: ties go to the lowest expert id, whatever the batch
            idx = torch.sort(scores + gate.bias, dim=-1, descending=True, stable=True).indices[:, : gate.topk]
        w = scores.gather(1, idx)
        if gate.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w * gate.routed_scale, idx

    def apply(self, moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, idx = self.route(moe.gate, x, input_ids)
        out = moe.shared_experts(x).float()
        flat_idx = idx.flatten()
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=len(moe.experts)).tolist()
        token_of = order // idx.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start:start + n]
            toks = token_of[start:start + n]
            y = moe.experts[e](x[toks], weights.flatten()[rows])
            out.index_add_(0, toks, y.float())
            start += n
        return out.to(x.dtype)
