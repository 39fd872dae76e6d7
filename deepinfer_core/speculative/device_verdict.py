"""Verification and drafting without the host: the verdict stays on the device until the engine
has launched the next step.

A step of greedy verify chunks of one shape (n sequences x q = L + 1 rows, every draft acceptable,
no grammar, penalty or logprobs) needs nothing from the host to be verified and drafted on: the
accepted count of each sequence is the length of the prefix of drafts equal to the target's argmax,
the token it adds is the argmax after that prefix, and its next verify chunk starts one position
past it. `verify_on_device` writes those into the runner's slot tables (`last_token`, `next_start`)
and the drafter writes the next drafts there (`drafts`), so the engine can launch the next step
with device positions (runner/cuda_graphs.py `device_starts`) before reading this step's verdict;
the host copies complete on the step's event and the engine commits them one step later.

The rules are the host path's (ops/verify.py, engine_step.py `_draft_graphed`, replay.py), in
tensor form; tests/speculative/test_device_verdict.py holds the two paths to the same tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..runner.slot_tables import SlotTables
from .mtp import draft_confidence
from .mtp_graphs import MTPGraphs


class DeviceVerdict(NamedTuple):
    accepted: torch.Tensor      # [n] drafts accepted per sequence (int64, device)
    tokens: torch.Tensor        # [n] the token each verification adds
    last: torch.Tensor          # [n] the position of the last committed row (the new token's input)


def verify_on_device(logits: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
                     tables: SlotTables) -> DeviceVerdict:
    """Greedy verification of n chunks of q rows: `logits` [n*q, V] (row r of a chunk predicts the
    token after its r-th input), `ids` [n*q] the resolved inputs (last token, then the drafts),
    `starts` [n] each chunk's first position. Writes last_token and next_start of `slots`."""
    n = slots.numel()
    top = logits.argmax(-1).view(n, -1)
    ids = ids.view(n, -1)
    accepted = (top[:, :-1] == ids[:, 1:]).cumprod(1).sum(1)
    tokens = top.gather(1, accepted[:, None]).squeeze(1)
    last = starts + accepted
    tables.last_token.index_copy_(0, slots, tokens)
    tables.next_start.index_copy_(0, slots, last + 1)
    return DeviceVerdict(accepted, tokens, last)


def mtp_drafts_on_device(graphs: MTPGraphs, streams: torch.Tensor, ids: torch.Tensor, verdict: DeviceVerdict,
                         starts: torch.Tensor, slots: list[int], num_drafts: int,
                         with_confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy MTP drafts [n, k] (and their confidences) from a verify step's streams: the block
    observes every row (row r's next token: draft r + 1, or the verified token at the accepted row;
    rows past it are rolled back), then drafts from each sequence's last committed row, one graph
    replay per draft, as `Speculator._draft_graphed` does with host positions."""
    n = len(slots)
    q = ids.numel() // n
    nxt = torch.cat([ids.view(n, q)[:, 1:], ids.new_zeros(n, 1)], 1)
    nxt.scatter_(1, verdict.accepted[:, None], verdict.tokens[:, None])
    rows = torch.arange(n, device=ids.device) * q + verdict.accepted
    out = graphs.observe(streams, nxt.flatten(), [], slots, q, rows, starts=starts)
    drafted, conf = [], []
    for step in range(num_drafts):
        if out is None:
            raise RuntimeError("MTP drafter: a CUDA graph of a device-verified step could not be captured")
        logits, mtp_streams = out
        drafted.append(logits.argmax(-1))
        if with_confidence:
            conf.append(draft_confidence(logits))
        if step + 1 < num_drafts:
            out = graphs.draft_step(mtp_streams, drafted[-1], [], slots, starts=verdict.last + 1 + step)
    return torch.stack(drafted, 1), torch.stack(conf, 1) if with_confidence else None
