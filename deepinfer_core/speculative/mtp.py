"""V4's own MTP block as a drafter.

The block reads the target's final streams at position t (before hc_head) and the token at t + 1,
and predicts the token at t + 2. It has a sliding-window attention of its own, so it must see every
committed position, exactly like a main layer: `observe` runs it over the rows of each target
forward (a prefill chunk, or the verify rows; rows a verification then rejects are rolled back with
the main layers' state). `propose` draws k drafts per request from the MTP logits of its last
committed row; for k > 1 the block's own output streams stand in for the target's at the next
position, with the draft as the next token (EAGLE-style recursion, as SGLang runs V4's MTP).

Drafts are drawn with the request's own parameters: the argmax for greedy requests, else a sample
of the processed distribution q (temperature, top-k, top-p, min-p) with the counter-based uniform
of the "draft" namespace keyed by (seed, position), so a request's drafts, like its tokens, do not
depend on the batch. Verification needs q (ops/verify.py): greedy requests get one-hot rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..model.deepseek_v4 import DeepseekV4Model
from ..model.forward_batch import ForwardBatch
from ..ops.sampler import (
    GREEDY_EPS,
    counter_uniform_tensor,
    inverse_cdf,
    processed_probs,
)
from ..ops.transfer import to_device


@dataclass
class Drafts:
    ids: torch.Tensor               # [requests, k] int64
    probs: torch.Tensor | None      # [requests, k, V] the distributions they were drawn from (None: all greedy)
    confidence: torch.Tensor | None = None   # [requests, k] each draft's confidence (VARLEN), else None


def draft_confidence(logits: torch.Tensor) -> torch.Tensor:
    """The MTP block's confidence in its draft at a position: the top probability of its
    distribution there, a function of the drafts before it only (never of the draft it scores, which
    would break losslessness: varlen.py). V4's MTP block has no trained confidence head (DSpark's
    has), so this is a proxy: calibrated for greedy drafts at best, low for sampled ones."""
    return logits.float().softmax(-1).amax(-1)


class MTPDrafter:
    def __init__(self, model: DeepseekV4Model, num_drafts: int):
        if not len(model.mtp):
            raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={num_drafts} asks for MTP drafts, but the checkpoint "
                             "has no mtp.* tensors (set DEEPINFER_USE_NEXTN_DECODE=0 to decode without them)")
        if num_drafts < 1:
            raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={num_drafts}: an MTP drafter needs at least 1 draft")
        self.model, self.num_drafts = model, num_drafts

    def observe(self, batch: ForwardBatch, streams: torch.Tensor, next_ids: torch.Tensor,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block over every row of a target forward (`batch`, its final `streams`; `next_ids[t]`:
        the token after row t). Returns the MTP logits and output streams of `rows`."""
        logits, u = self.model.mtp_step(streams, next_ids, replace(batch, logits_rows=rows, backend_meta={}))
        return logits, u.index_select(0, rows)

    def propose(self, logits: torch.Tensor, streams: torch.Tensor, batch_states: list, last_positions: Sequence[int],
                params: Sequence[Any], seeds: Sequence[int], slot_ids: list[int] | None = None,
                slot_tables: Any = None, with_confidence: bool = False) -> Drafts:
        """k drafts per request. `logits`, `streams` [requests, ...]: the MTP outputs of each request's
        last committed row, at position `last_positions[i]` (its first draft goes to that + 2).
        `slot_ids`, `slot_tables`: the engine's per-slot tables, as in its target batches.
        `with_confidence`: also each draft's confidence (VARLEN)."""
        n, dev = logits.shape[0], logits.device
        ids, probs, conf = [], [], []
        greedy = all(p.temperature < GREEDY_EPS for p in params)
        for step in range(self.num_drafts):
            tok, q = draw(logits, params, [p + 2 + step for p in last_positions], seeds, greedy)
            ids.append(tok)
            probs.append(q)
            if with_confidence:
                conf.append(draft_confidence(logits))
            if step + 1 == self.num_drafts:
                break
            # one position on: the block's own streams as h, the draft as the next token
            pos = [p + 1 + step for p in last_positions]
            batch = ForwardBatch(tok, to_device(pos, torch.int64, dev), pos, [1] * n, batch_states,
                                 torch.arange(n, device=dev), slot_ids=slot_ids, slot_tables=slot_tables)
            logits, streams = self.model.mtp_step(streams, tok, batch)
        return Drafts(torch.stack(ids, 1), None if greedy else torch.stack(probs, 1),
                      torch.stack(conf, 1) if with_confidence else None)


def draw(logits: torch.Tensor, params: Sequence[Any], positions: list[int], seeds: Sequence[int],
          greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(draft ids [n], their distributions [n, V] or None when every request is greedy)."""
    top = logits.argmax(-1)
    if greedy:
        return top, None
    q = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    q[torch.arange(len(params), device=logits.device), top] = 1.0      # greedy rows: one-hot
    sampled = [i for i, p in enumerate(params) if p.temperature >= GREEDY_EPS]
    idx = to_device(sampled, torch.long, logits.device)
    p = processed_probs(logits.index_select(0, idx), [params[i] for i in sampled]).to(torch.float64)
    p = p / p.sum(-1, keepdim=True)
    q[idx] = p
    u = counter_uniform_tensor([seeds[i] for i in sampled], [positions[i] for i in sampled], logits.device,
                               namespace="draft")
    tok = top.clone()
    tok[idx] = inverse_cdf(p, u)
    return tok, q
