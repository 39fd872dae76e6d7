"""Lossless verification of draft tokens (greedy, or standard speculative sampling;
the groundwork of speculative decoding).

One verify step runs `[anchor, x_1..x_l]` per request through the target; its target rows 0..l give
the distributions p_1..p_{l+1} of the positions x_1..x_l and the token after them. Per request:
- greedy (temperature < GREEDY_EPS): accept x_k while it equals argmax p_k (lowest id on ties); the
  first mismatch row's argmax is the correction, and when every draft passes argmax p_{l+1} is the
  bonus token. Outputs equal non-speculative greedy decoding token for token.
- sampled: accept x_k when u * q_k(x_k) < p_k(x_k), u = U(seed, position, CASE_ACCEPT), i.e. with
  probability min(1, p/q); at the first rejection sample the correction from norm(max(p_k - q_k, 0))
  (p_k itself when that is empty) with U(seed, position, CASE_RESAMPLE); when every draft passes,
  the bonus token is drawn from p_{l+1} with U(seed, position, CASE_SAMPLE), the uniform the
  non-speculative sampler would use there. The emitted tokens are distributed exactly as the
  target's (standard speculative sampling). p and q are the processed distributions (temperature,
  top-k, top-p, min-p of the request's own parameters) the target would sample from and the drafts
  were sampled from.
Every uniform is keyed by (seed, position, purpose), so a request's result does not depend on the
other requests in the batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .sampler import (
    CASE_ACCEPT,
    CASE_RESAMPLE,
    CASE_SAMPLE,
    GREEDY_EPS,
    counter_uniform_tensor,
    inverse_cdf,
    processed_probs,
)
from .transfer import to_device

EMPTY_RESIDUAL = 1e-8       # a residual with less mass than this falls back to p (DeepSpec's rule)


@dataclass
class Verdict:
    accepted: list[int]          # drafts accepted per request (0..l)
    tokens: torch.Tensor         # [requests] int64: the correction or bonus token each request adds


def verify(target_logits: torch.Tensor, num_drafts: Sequence[int], draft_ids: torch.Tensor,
           draft_probs: torch.Tensor | None, params: Sequence[Any], positions: Sequence[int],
           seeds: Sequence[int]) -> Verdict:
    """`target_logits` [sum(l_i + 1), V]: request i's rows are its l_i + 1 verify rows, in request
    order. `draft_ids` [sum(l_i)] and `draft_probs` [sum(l_i), V] (normalised; None when every request
    is greedy): the drafts and the distributions they were sampled from. `positions[i]`: the position
    of x_1 (row k of request i predicts position positions[i] + k); `seeds[i]`: its 64-bit seed."""
    n = len(num_drafts)
    if not len(params) == len(positions) == len(seeds) == n:
        raise ValueError(f"verify: {n} requests but {len(params)} params, {len(positions)} positions, "
                         f"{len(seeds)} seeds")
    if target_logits.shape[0] != sum(num_drafts) + n or draft_ids.shape[0] != sum(num_drafts):
        raise ValueError(f"verify: {sum(num_drafts)} drafts of {n} requests need {sum(num_drafts) + n} target "
                         f"rows and {sum(num_drafts)} draft ids, got {target_logits.shape[0]} and "
                         f"{draft_ids.shape[0]}")
    dev = target_logits.device
    greedy = [p.temperature < GREEDY_EPS for p in params]
    if draft_probs is None and not all(greedy):
        raise ValueError("verify: sampled requests need the draft distributions (draft_probs)")
    # row bookkeeping on the host: target row of every draft, the request of every row
    target_row, row_request, row_pos, first = [], [], [], []
    off = 0
    for i, l in enumerate(num_drafts):
        first.append(off)
        target_row += range(off, off + l)
        row_request += [i] * (l + 1)
        row_pos += range(positions[i], positions[i] + l + 1)
        off += l + 1
    rows_t = to_device(target_row, torch.long, dev)
    if all(greedy):            # argmax rows only: no [rows, vocab] distributions
        top = target_logits.argmax(-1)
        flags = (top.index_select(0, rows_t) == draft_ids).tolist()
        accepted, end_rows, _ = _accepted_prefixes(flags, num_drafts, first)
        return Verdict(accepted, top.index_select(0, to_device(end_rows, torch.long, dev)))
    row_params = [params[r] for r in row_request]
    row_seeds = [seeds[r] for r in row_request]
    # p of every target row: argmax for greedy rows, processed distributions for sampled ones
    probs = _target_probs(target_logits, row_params, greedy, row_request)
    # accept flags of every draft (one host read: the scheduler needs the counts anyway); a greedy
    # request's q is one-hot at its draft, so u * 1 < p (1 or 0) accepts exactly the argmax
    p_x = probs.index_select(0, rows_t).gather(1, draft_ids[:, None]).squeeze(1)
    q_x = draft_probs.to(torch.float64).gather(1, draft_ids[:, None]).squeeze(1)
    u = counter_uniform_tensor([row_seeds[r] for r in target_row], [row_pos[r] for r in target_row], dev,
                               case=CASE_ACCEPT)
    ok = u * q_x < p_x
    accepted, end_rows, rejected_at = _accepted_prefixes(ok.tolist(), num_drafts, first)
    return Verdict(accepted, _extra_tokens(probs, draft_probs, end_rows, rejected_at, greedy, row_pos, seeds, dev))


class ExactVerifier:
    """The core's verifier (hook deepinfer_verifier): `verify` above, lossless."""

    exact_greedy = True

    def verify(self, target_logits: torch.Tensor, num_drafts: Sequence[int], draft_ids: torch.Tensor,
               draft_probs: torch.Tensor | None, params: Sequence[Any], positions: Sequence[int],
               seeds: Sequence[int]) -> Verdict:
        return verify(target_logits, num_drafts, draft_ids, draft_probs, params, positions, seeds)


def _accepted_prefixes(flags: list[bool], num_drafts: Sequence[int], first: list[int]):
    """Per request: drafts accepted (up to the first rejection), its end row (the correction's or the
    bonus's target row), and the rejected draft's index among all drafts (requests that rejected one)."""
    accepted, end_rows, rejected_at = [], [], {}
    d = 0
    for i, l in enumerate(num_drafts):
        j = next((k for k in range(l) if not flags[d + k]), l)
        accepted.append(j)
        end_rows.append(first[i] + j)
        if j < l:
            rejected_at[i] = d + j
        d += l
    return accepted, end_rows, rejected_at


def _target_probs(logits: torch.Tensor, row_params, greedy: list[bool], row_request: list[int]) -> torch.Tensor:
    """[rows, V] float64: one-hot argmax rows (greedy requests) or normalised processed distributions."""
    out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    g_rows = [r for r, i in enumerate(row_request) if greedy[i]]
    s_rows = [r for r, i in enumerate(row_request) if not greedy[i]]
    if g_rows:
        g = to_device(g_rows, torch.long, logits.device)
        out[g, logits.index_select(0, g).argmax(-1)] = 1.0
    if s_rows:
        s = to_device(s_rows, torch.long, logits.device)
        p = processed_probs(logits.index_select(0, s), [row_params[r] for r in s_rows])
        out[s] = p / p.sum(-1, keepdim=True)
    return out


def _extra_tokens(probs, draft_probs, end_rows, rejected_at: dict[int, int], greedy, row_pos, seeds, dev):
    """The token each request adds: the correction at its first rejected draft, else the bonus."""
    rows = to_device(end_rows, torch.long, dev)
    p = probs.index_select(0, rows)
    out = p.argmax(-1)                                    # greedy rows are one-hot
    sampled = [i for i, g in enumerate(greedy) if not g]
    if not sampled:
        return out
    dist = p.clone()
    fix = [i for i in sampled if i in rejected_at]
    if fix:
        q = draft_probs.to(torch.float64).index_select(0, to_device([rejected_at[i] for i in fix], torch.long, dev))
        idx = to_device(fix, torch.long, dev)
        residual = (dist.index_select(0, idx) - q).clamp_min(0)
        empty = residual.sum(-1, keepdim=True) <= EMPTY_RESIDUAL
        dist[idx] = torch.where(empty, dist.index_select(0, idx), residual)
    for case, reqs in ((CASE_RESAMPLE, fix), (CASE_SAMPLE, [i for i in sampled if i not in rejected_at])):
        if reqs:
            idx = to_device(reqs, torch.long, dev)
            u = counter_uniform_tensor([seeds[i] for i in reqs], [row_pos[end_rows[i]] for i in reqs], dev, case=case)
            out[idx] = inverse_cdf(dist.index_select(0, idx), u)
    return out
