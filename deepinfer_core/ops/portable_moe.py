"""Portable MoE method: route, run each expert on the tokens it received, combine in fp32."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PortableMoE:
    batch_invariant = False

    def process_weights(self, moe) -> None:
        gate = moe.gate
        gate.register_buffer("weight", gate.weight.float(), persistent=False)

    # elementwise functions (a subclass may choose their implementation)
    softplus = staticmethod(F.softplus)
    silu = staticmethod(F.silu)

    @staticmethod
    def gate_logits(gate, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] in fp32 (a subclass may choose the GEMM)."""
        return x.float() @ gate.weight.t()

    @staticmethod
    def route(gate, x: torch.Tensor, input_ids: torch.Tensor, logits: torch.Tensor | None = None,
              softplus=F.softplus) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) — the bias picks experts but never weights them.
        `logits`: the router logits when the caller computed them (default x.float() @ gate.weight^T)."""
        if logits is None:
            logits = PortableMoE.gate_logits(gate, x)
        scores = torch.sqrt(softplus(logits))
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
        weights, idx = self.route(moe.gate, x, input_ids, self.gate_logits(moe.gate, x), self.softplus)
        out = moe.shared_experts(x, silu=self.silu).float()
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
            y = moe.experts[e](x[toks], weights.flatten()[rows], silu=self.silu)
            out.index_add_(0, toks, y.float())
            start += n
        return out.to(x.dtype)
