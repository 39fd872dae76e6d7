"""YOCO bounded replay, "compact" mode (V4.1; the swa_replay feature supplies the rectangle):
at the first consumer layer, keep only the prompt rows the consumer half must compute.

Per sequence the kept rows are those at positions >= its rectangle start (`rect_lo`), or only its
last row when the whole chunk lies before the rectangle (a placeholder whose window is empty). The
consumer-half compressors still see every row: the shared hidden is computed on the full batch
first and the full batch stays reachable (`shared["yoco_full"]`). Candidate blocks chosen by a
producer layer follow the kept rows. Logits rows are always kept: they are each sequence's last
row (prompt logprobs are refused in this mode; decode and verify rows lie inside the rectangle).
"""

from __future__ import annotations

import torch

from .forward_batch import ForwardBatch


def compact(batch: ForwardBatch, h: torch.Tensor, pre: torch.Tensor, shared_hidden) -> tuple:
    """(the batch of kept rows, their streams, their mHC `pre`), or the inputs unchanged when
    every row is kept. `shared_hidden()` computes the full batch's shared hidden."""
    _, rect = batch.truncation
    firsts = [
        min(max(start, lo), start + n - 1) for start, n, lo in zip(batch.starts, batch.lens, rect)
    ]
    if firsts == batch.starts:
        return batch, h, pre
    dev = h.device
    local = [
        torch.arange(f - s, n, device=dev) for f, s, n in zip(firsts, batch.starts, batch.lens)
    ]
    kept = torch.cat([loc + sl.start for loc, sl in zip(local, batch.seq_slices())])
    batch.shared["yoco_hidden"] = shared_hidden()
    batch.shared["yoco_full"] = batch
    where = torch.full((h.shape[0],), -1, dtype=torch.int64, device=dev)
    where[kept] = torch.arange(kept.shape[0], device=dev)
    out = ForwardBatch(
        batch.input_ids[kept],
        batch.positions[kept],
        firsts,
        [s + n - f for f, s, n in zip(firsts, batch.starts, batch.lens)],
        batch.states,
        where[batch.logits_rows],
        slot_ids=batch.slot_ids,
        slot_tables=batch.slot_tables,
        shared=batch.shared,
        truncation=batch.truncation,
    )
    cands = batch.shared.get(("candidates",))
    if cands is not None:
        batch.shared[("candidates",)] = [c[loc] for c, loc in zip(cands, local)]
    return out, h[kept], pre[kept]
