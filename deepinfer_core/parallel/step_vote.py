"""The ranks' per-step agreement on how the expert-parallel exchanges run (DS-DeepInfer's
step-type vote, in the form this engine needs).

DS-DeepInfer's engines alternate prefill and decode steps and vote on the next step's kind. This
engine's scheduler mixes prefill chunks and decodes in one step, and in eager mode any forward pairs
with any other (the variable exchange of `ep_comm` sizes itself per call), so no vote is needed
there. It is needed once decode steps replay CUDA graphs (`enable_ep_cuda_graphs`): a graph holds
the fixed-size exchange of `ep_padded` for its batch bucket, and every rank must then replay a graph
of the SAME bucket in the same iteration, or every rank must run eagerly.

One vote per lockstep iteration and rank, a MAX all-reduce of one integer on the gloo group:
    a rank whose step is a decode that fits a captured bucket B votes B;
    a rank whose step must run eagerly (prefill chunks, a mixed or too large batch) votes EAGER;
    a rank without a forward this iteration votes 0 (no preference).
Result: EAGER -> every forward runs eagerly (an idle rank joins with `idle_forward`); B > 0 -> every
rank replays bucket B (its own batch padded up to B; an idle rank replays it with padding rows only);
0 -> no rank has a forward, nobody exchanges.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .ep_comm import EPCommError

EAGER = 1 << 30            # above every bucket
NOTHING = 0


class StepVote:
    """Callable `vote(bucket_or_None, has_forward) -> agreed` of one rank (see the module doc):
    `bucket` None with `has_forward` means this rank must run eagerly; the result is None for eager,
    0 when no rank has a forward, else the bucket every rank replays."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int) -> None:
        self.group, self.rank = group, rank
        self.votes = 0              # how many this rank cast (equal on every rank: tests, logs)
        self.graph_steps = 0        # of them, agreed graph replays

    def __call__(self, bucket: int | None, has_forward: bool) -> int | None:
        code = (EAGER if bucket is None else bucket) if has_forward else NOTHING
        if not 0 <= code <= EAGER:
            raise ValueError(f"bucket={bucket!r}: allowed: None (eager) or a bucket size >= 1")
        agreed = code
        if self.group is not None:
            t = torch.tensor([code], dtype=torch.int64)
            try:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            except RuntimeError as exc:      # DistBackendError and gloo errors are RuntimeErrors
                raise EPCommError(f"step vote failed on rank {self.rank}: {exc}") from exc
            agreed = int(t.item())
        self.votes += 1
        if agreed >= EAGER:
            return None
        self.graph_steps += agreed != NOTHING
        return agreed
