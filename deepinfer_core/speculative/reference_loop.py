"""A plain speculative decoding loop over a `ModelRunner`: all requests together, one eager target
forward per step, MTP drafts, lossless verification, rollback of what was rejected.

The engine's own speculative steps are `engine_step.py`; this loop is the independent reference the
tests compare them with (the engine's seeded outputs equal it) and that
`benchmarks/spec_distribution.py` checks against the target's exact distribution. Per step and request: the target runs
[anchor, x_1..x_k], `verify` accepts j drafts and adds one token, the state rolls back to the
anchor + j drafts, and the MTP block runs over the same rows (next token of row t: the emitted token
at t + 1) to draft the next step's k tokens from the last committed row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..api.outputs import SpecMetrics
from ..api.sampling_params import SamplingParams
from ..model.forward_batch import ForwardBatch
from ..ops.transfer import to_device
from ..ops.verify import verify
from .mtp import Drafts, MTPDrafter


@dataclass
class SpecResult:
    token_ids: list[list[int]]
    stats: SpecMetrics


@torch.no_grad()
def speculative_generate(runner, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                         num_drafts: int, seeds: Sequence[int] | None = None,
                         eos_token_id: int | None = None) -> SpecResult:
    """Generate `params[i].max_tokens` tokens for each prompt (stopping at `eos_token_id` unless
    ignore_eos) with k = `num_drafts` MTP drafts per step. The runner's cache must hold k + 1
    backtracking tokens (DEEPINFER_MAX_BACKTRACKING_TOKENS / `max_backtracking_tokens`)."""
    if runner.backtrack < num_drafts + 1:
        raise ValueError(f"{num_drafts} drafts per step need max_backtracking_tokens >= {num_drafts + 1} "
                         f"(DEEPINFER_MAX_BACKTRACKING_TOKENS), the runner has {runner.backtrack}")
    model, dev = runner.model, torch.device(runner.device)
    drafter = MTPDrafter(model, num_drafts)
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    states = [runner.new_sequence() for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    stats = SpecMetrics(accepted_per_position=[0] * num_drafts)
    try:
        # prefill: the first token from the target, then the MTP block over every prompt row
        for st, p in zip(states, prompts):
            st.reserve(len(p))
        batch = ForwardBatch.build([list(p) for p in prompts], states, dev)
        res = model(batch)
        batch.commit()
        first = runner.sampler.sample(res.logits, list(params), [len(p) for p in prompts], seeds)
        next_ids = torch.cat([torch.cat([to_device(list(p[1:]), torch.int64, dev), first[i:i + 1]])
                              for i, p in enumerate(prompts)])
        logits, streams = drafter.observe(batch, res.streams, next_ids, batch.logits_rows)
        anchors = first
        for i, t in enumerate(first.tolist()):
            out[i].append(t)
        drafts = drafter.propose(logits, streams, states, [len(p) - 1 for p in prompts], params, seeds)
        live = [i for i in range(len(prompts)) if not _done(out[i], params[i], eos_token_id)]
        anchors, drafts = _select(anchors, drafts, live)
        while live:
            anchors, drafts, live = _verify_step(runner, drafter, live, states, anchors, drafts, params, seeds,
                                                 out, stats, eos_token_id)
    finally:
        for st in states:
            runner.release(st)
    return SpecResult([_trim(t, p, eos_token_id) for t, p in zip(out, params)], stats)


def _verify_step(runner, drafter: MTPDrafter, live: list[int], states, anchors: torch.Tensor, drafts: Drafts,
                 params, seeds, out, stats: SpecMetrics, eos_token_id):
    """One verify step of the `live` requests (indices into the full request list; `anchors`,
    `drafts` hold one row per live request). Returns the next step's (anchors, drafts, live)."""
    k, dev = drafter.num_drafts, anchors.device
    sts = [states[i] for i in live]
    starts = [st.num_tokens for st in sts]
    ids = torch.cat([anchors[:, None], drafts.ids], 1)                    # [n, k + 1]
    token_ids = ids.tolist()
    for st in sts:
        st.reserve(k + 1)
    batch = ForwardBatch.build(token_ids, sts, dev, all_logits=True)
    res = runner.model(batch)
    batch.commit()
    pr = [params[i] for i in live]
    sd = [seeds[i] for i in live]
    verdict = verify(res.logits, [k] * len(live), drafts.ids.reshape(-1),
                     None if drafts.probs is None else drafts.probs.flatten(0, 1), pr,
                     [s + 1 for s in starts], sd)
    extra = verdict.tokens.tolist()
    # the MTP rows: row t's next token is the emitted token at t + 1 (the added token after the
    # accepted drafts; rows past it are rolled back below)
    acc = torch.tensor(verdict.accepted, device=dev)
    next_ids = torch.cat([drafts.ids, verdict.tokens[:, None]], 1)
    next_ids[torch.arange(len(live), device=dev), acc] = verdict.tokens
    last_rows = torch.arange(len(live), device=dev) * (k + 1) + acc
    logits, streams = drafter.observe(batch, res.streams, next_ids.reshape(-1), last_rows)
    for n, (i, st, s, j) in enumerate(zip(live, sts, starts, verdict.accepted)):
        st.rollback(s + 1 + j)                                           # the anchor and j drafts stay
        out[i].extend(token_ids[n][1:1 + j] + [extra[n]])
        stats.record(k, j)
    new_drafts = drafter.propose(logits, streams, sts, [s + j for s, j in zip(starts, verdict.accepted)], pr, sd)
    keep = [n for n, i in enumerate(live) if not _done(out[i], params[i], eos_token_id)]
    return *_select(verdict.tokens, new_drafts, keep), [live[n] for n in keep]


def _select(anchors: torch.Tensor, drafts: Drafts, rows: list[int]) -> tuple[torch.Tensor, Drafts]:
    """The anchors and drafts of the requests still generating (`rows` of the current ones)."""
    idx = torch.tensor(rows, dtype=torch.long, device=anchors.device)
    probs = None if drafts.probs is None else drafts.probs.index_select(0, idx)
    return anchors.index_select(0, idx), Drafts(drafts.ids.index_select(0, idx), probs)


def _done(tokens: list[int], p: SamplingParams, eos_token_id: int | None) -> bool:
    return len(tokens) >= p.max_tokens or (not p.ignore_eos and eos_token_id in tokens)


def _trim(tokens: list[int], p: SamplingParams, eos_token_id: int | None) -> list[int]:
    """A step may emit past max_tokens or an EOS: cut where non-speculative decoding would stop."""
    if not p.ignore_eos and eos_token_id in tokens:
        tokens = tokens[:tokens.index(eos_token_id) + 1]
    return tokens[:p.max_tokens]
