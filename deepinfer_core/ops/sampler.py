"""Portable sampler: penalties, greedy / temperature / top-k / top-p / min-p, and the counter-based RNG
of deterministic sampling.

No RNG state exists anywhere: the uniform that drives a row is a pure function of
(seed, namespace, position, case), so a seeded request samples the same tokens whatever else is in
the batch, and whichever order rows come in. Every step below is per row.

Our `combine` (our own choice; bit-compatibility with DS-DeepInfer is not a goal):
    key     = seed + (DRAFT_OFFSET if namespace == "draft" else 0)        (mod 2^64)
    counter = (3 * position + case) * GOLDEN                             (mod 2^64)
    x       = splitmix64(splitmix64(key) XOR counter)
    u       = (x >> 11) * 2^-53                                          (53-bit uniform in [0, 1))
The key is pre-mixed so that seeds differing in a few bits do not give related streams.

Processing order of a sampled row: logits / temperature -> softmax (float64) -> top-k -> top-p (over
the top-k survivors) -> min-p (relative to the most likely token) -> inverse CDF: cumsum in float64
in vocabulary order, first index with cdf > u * cdf[-1]. Ties in top-k/top-p go to the lower token id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .penalties import apply_penalties  # noqa: F401  (re-exported: its home used to be here)
from .transfer import to_device

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
DRAFT_OFFSET = 1_000_000_007            # DS-DeepInfer's offset of the draft namespace
CASE_SAMPLE, CASE_RESAMPLE, CASE_ACCEPT = 0, 1, 2
GREEDY_EPS = 1e-5                       # temperature below this = greedy (as SamplingParams.greedy)


def splitmix64(x: int) -> int:
    """One splitmix64 step: advance by GOLDEN, then the finaliser (all mod 2^64)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix_seed(seed: int, value: int) -> int:
    """A 64-bit seed derived from `seed` and `value` (request counter, completion index, ...)."""
    return splitmix64(splitmix64(seed & MASK64) ^ (value & MASK64))


def counter_uniform(seed: int, position: int, case: int = CASE_SAMPLE, namespace: str = "main") -> float:
    """The uniform in [0, 1) for token `position` of a sequence seeded with `seed` (see module doc)."""
    key = (seed + (DRAFT_OFFSET if namespace == "draft" else 0)) & MASK64
    counter = ((3 * position + case) * GOLDEN) & MASK64
    x = splitmix64(splitmix64(key) ^ counter)
    return (x >> 11) * 2.0 ** -53


def _signed64(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def seed_bits(seed: int) -> int:
    """How a 64-bit seed is staged in an int64 tensor for `Sampler.sample` / `counter_uniform_tensor`:
    the int64 with the same bits (seeds >= 2^63 come out negative)."""
    return _signed64(seed)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """`splitmix64` on int64 tensors: multiplication wraps mod 2^64 like the uint64 original."""
    z = x + _signed64(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


IntsOrTensor = Sequence[int] | torch.Tensor


def counter_uniform_tensor(seeds: IntsOrTensor, positions: IntsOrTensor, device, case: int = CASE_SAMPLE,
                           namespace: str = "main") -> torch.Tensor:
    """`counter_uniform` for many rows at once, computed on `device` (float64, bit-identical): the
    host only copies the seeds and positions, so sampling needs no per-row host work or sync.

    `seeds` and `positions` are Python ints or int64 tensors already on `device` (a caller that
    stages them itself, with `seed_bits` applied to the seeds): then the host does nothing per row.
    """
    offset = DRAFT_OFFSET if namespace == "draft" else 0
    if isinstance(seeds, torch.Tensor):
        key = seeds.to(device=device, dtype=torch.int64) + offset      # wraps mod 2^64 like the ints
    else:
        key = to_device([_signed64(sd + offset) for sd in seeds], torch.int64, device)
    if isinstance(positions, torch.Tensor):
        pos = positions.to(device=device, dtype=torch.int64)
    else:
        pos = to_device(list(positions), torch.int64, device)
    counter = (3 * pos + case) * _signed64(GOLDEN)
    x = _splitmix64_t(_splitmix64_t(key) ^ counter)
    return _shr(x, 11).to(torch.float64) * 2.0 ** -53


# ---- filtering ----------------------------------------------------------------------------------
TOP_P_PROBE = 1024   # top-p first looks at this many best tokens; a full sort only if they are not enough
SMALL_VOCAB = 4096   # up to this vocabulary size one batched full sort is cheaper than per-row work


def batched_sort_pays(probs: torch.Tensor) -> bool:
    """One batched full sort of every row: always on an accelerator (fast there, and the per-row path
    reads values back to the host), on the CPU only for small vocabularies."""
    return probs.device.type != "cpu" or probs.shape[-1] <= SMALL_VOCAB


def sorted_prefix(row: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `m` (value, id) of one row in (value descending, id ascending) order.

    A full CPU sort of a 129k vocabulary costs ~0.2 s, so for m < V take the m-th largest value with
    topk and stable-sort only the candidates >= it (all ties at the boundary included), which gives
    exactly the prefix of the full stable sort.
    """
    vocab = row.shape[-1]
    if m >= vocab:
        vals, ids = torch.sort(row, descending=True, stable=True)
        return vals, ids
    kth = torch.topk(row, m).values[-1]
    cand = (row >= kth).nonzero().squeeze(1)                # ascending ids
    vals, order = torch.sort(row[cand], descending=True, stable=True)
    return vals[:m], cand[order[:m]]


def _top_k_top_p_keep(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Ids of one row kept by top-k then top-p (over the top-k mass); row: float64 probabilities."""
    vocab = row.shape[-1]
    if p >= 1:
        return sorted_prefix(row, k)[1]
    # Without top-k the threshold is relative to the whole row (summed in vocabulary order).
    vals, ids = sorted_prefix(row, k if k < vocab else min(vocab, TOP_P_PROBE))
    csum = vals.cumsum(0)
    total = csum[-1] if k < vocab else row.sum()
    if len(ids) < k and csum[-1] < p * total:
        vals, ids = sorted_prefix(row, vocab)    # the probe did not reach top_p: sort everything
        csum = vals.cumsum(0)
    before = torch.cat([csum.new_zeros(1), csum[:-1]])
    return ids[before < p * total]       # smallest prefix whose mass reaches top_p


def _top_k_top_p_batched(probs: torch.Tensor, top_k: Sequence[int],
                             top_p: Sequence[float]) -> torch.Tensor:
    """Same rule as `_top_k_top_p_keep`, for every row at once from one full sort (no host sync)."""
    vocab = probs.shape[-1]
    dev = probs.device
    k = to_device([kk if 0 < kk < vocab else vocab for kk in top_k], torch.int64, dev)
    p = to_device([float(pp) for pp in top_p], torch.float64, dev)
    vals, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = torch.arange(vocab, device=dev)[None, :] < k[:, None]
    csum = (vals * keep).cumsum(-1)
    total = torch.where(k < vocab, csum.gather(-1, (k - 1)[:, None]).squeeze(1), probs.sum(-1))
    before = torch.cat([csum.new_zeros(csum.shape[0], 1), csum[:, :-1]], dim=-1)
    keep &= (before < (p * total)[:, None]) | (p[:, None] >= 1)
    mask = torch.zeros_like(keep).scatter_(-1, order, keep)
    return probs.masked_fill(~mask, 0.0)


def filter_probs(probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float],
                 min_p: Sequence[float]) -> torch.Tensor:
    """Zero out what top-k, then top-p, then min-p remove; rows stay unnormalised.

    probs: [R, V] float64 (each row a distribution). top_k <= 0 or >= V, top_p >= 1, min_p <= 0 = off.
    Ties go to the lower token id. The top-p threshold is top_p times the top-k mass (summed in sorted
    order), or times the whole row (summed in vocabulary order) when top-k is off.
    """
    vocab = probs.shape[-1]
    rows = [r for r in range(probs.shape[0]) if 0 < top_k[r] < vocab or top_p[r] < 1]
    out = probs
    if rows and batched_sort_pays(probs):
        out = _top_k_top_p_batched(probs, top_k, top_p)
    elif rows:
        out = probs.clone()
        for r in rows:
            k = top_k[r] if 0 < top_k[r] < vocab else vocab
            keep = _top_k_top_p_keep(probs[r], k, float(top_p[r]))
            out[r] = 0.0
            out[r, keep] = probs[r, keep]
    if any(mp > 0 for mp in min_p):      # decided on the host: no device sync
        m = to_device([float(mp) for mp in min_p], torch.float64, probs.device)
        pmax = out.max(dim=-1, keepdim=True).values
        out = out.masked_fill(out < m[:, None] * pmax, 0.0)
    return out


def processed_probs(logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
    """The exact (unnormalised) distribution that `Sampler.sample` draws from, [R, V] float64."""
    temps = to_device([float(p.temperature) for p in params], torch.float64, logits.device)
    probs = torch.softmax(logits.to(torch.float64) / temps[:, None], dim=-1)
    return filter_probs(probs, [p.top_k for p in params], [p.top_p for p in params],
                        [p.min_p for p in params])


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index i with cdf[i] > u * cdf[-1], per row (cdf in float64, vocabulary order)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    target = (u.to(torch.float64) * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u < 1 keeps target < cdf[-1]; the clamp only guards a row with no mass (all -inf logits).
    return idx.clamp_max(probs.shape[-1] - 1)


def _pick(values: IntsOrTensor, rows: list[int], index: torch.Tensor) -> IntsOrTensor:
    """The entries of `rows` (host list) / `index` (the same rows, staged) of a list or a tensor."""
    if isinstance(values, torch.Tensor):
        return values.index_select(0, index.to(values.device))
    return [values[i] for i in rows]


class Sampler:
    """Turns processed logits into token ids. Stateless; one instance serves every request."""

    batch_invariant = True      # per-row softmax, fp64 CDF and a counter RNG keyed by (seed, position)

    def sample(self, logits: torch.Tensor, params: Sequence[Any], positions: IntsOrTensor,
               seeds: IntsOrTensor) -> torch.Tensor:
        """logits [B, V]; per row its SamplingParams, the position of the token being sampled and
        its 64-bit seed (Python ints, or int64 tensors on logits.device with `seed_bits` seeds).
        Returns token ids [B] (int64, on logits.device).

        Every row is computed on its own, so an all-greedy or all-random batch is done in one go
        over the whole tensor (no index tensors, no scatter) with the same bits per row as a mixed
        batch, which splits the rows into the two groups.
        """
        batch = logits.shape[0]
        if not len(params) == len(positions) == len(seeds) == batch:
            raise ValueError(f"sample: logits has {batch} rows but got {len(params)} params, "
                             f"{len(positions)} positions, {len(seeds)} seeds")
        is_greedy = [p.temperature < GREEDY_EPS for p in params]
        n_greedy = sum(is_greedy)
        # torch.argmax returns the first maximal index: the lowest id wins ties.
        if n_greedy == batch:
            return logits.argmax(dim=-1)
        if n_greedy == 0:
            return self._draw(logits, params, positions, seeds)
        greedy = [i for i, g in enumerate(is_greedy) if g]
        rand = [i for i, g in enumerate(is_greedy) if not g]
        idx = to_device(greedy + rand, torch.int64, logits.device)       # one copy for both groups
        g, r = idx[:n_greedy], idx[n_greedy:]
        out = torch.empty(batch, dtype=torch.long, device=logits.device)
        out.index_copy_(0, g, logits.index_select(0, g).argmax(dim=-1))
        out.index_copy_(0, r, self._draw(logits.index_select(0, r), [params[i] for i in rand],
                                         _pick(positions, rand, r), _pick(seeds, rand, r)))
        return out

    @staticmethod
    def _draw(logits: torch.Tensor, params: Sequence[Any], positions: IntsOrTensor,
              seeds: IntsOrTensor) -> torch.Tensor:
        """Sampled (non-greedy) rows: processed distribution, counter uniform, inverse CDF."""
        probs = processed_probs(logits, params)
        u = counter_uniform_tensor(seeds, positions, logits.device)
        return inverse_cdf(probs, u)


# ---- logprobs -----------------------------------------------------------------------------------
@dataclass
class LogprobsResult:
    top_logprobs: torch.Tensor                 # [B, k] float32, descending
    top_ids: torch.Tensor                      # [B, k] int64 (ties: lower id first)
    sampled_logprobs: torch.Tensor | None      # [B] float32
    sampled_ranks: torch.Tensor | None         # [B] int64, 1 = most likely


def compute_logprobs(logits: torch.Tensor, k: int, sampled_ids: torch.Tensor | None = None) -> LogprobsResult:
    """Top-k logprobs and the sampled tokens' logprob and rank, from log_softmax (float32) of the
    raw logits (vLLM's default: before penalties, temperature and filtering).

    The top-k of a row is the first k entries of its stable descending sort (value descending, then
    id ascending): a prefix of one total order, so a batch can be computed once at the largest k any
    row asks for and each row's entries cut to its own k afterwards, with the same ids, values and
    tie order as asking for that k. Nothing here reads a value back on an accelerator (one batched
    sort there; the per-row partial sort is the CPU path for large vocabularies).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = max(0, min(k, lp.shape[-1]))
    if k and batched_sort_pays(lp):
        vals, ids = (t[:, :k] for t in torch.sort(lp, dim=-1, descending=True, stable=True))
    else:
        vals = lp.new_empty(lp.shape[0], k)
        ids = torch.empty(lp.shape[0], k, dtype=torch.long, device=lp.device)
        for r in range(lp.shape[0] if k else 0):
            vals[r], ids[r] = sorted_prefix(lp[r], k)
    slp = ranks = None
    if sampled_ids is not None:
        slp = lp.gather(-1, sampled_ids.view(-1, 1).to(lp.device)).squeeze(1)
        ranks = (lp > slp[:, None]).sum(-1) + 1   # rank = 1 + number of strictly better tokens
    return LogprobsResult(vals, ids, slp, ranks)
