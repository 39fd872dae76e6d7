import math
import random

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.ops.sampler import (
    MASK64, Sampler, apply_penalties, compute_logprobs, counter_uniform, counter_uniform_tensor, filter_probs,
    inverse_cdf, mix_seed, processed_probs, seed_bits, sorted_prefix, splitmix64)

S = SamplingParams


def _probs(*p):
    return torch.tensor([list(p)], dtype=torch.float64)


def _kept(probs):
    return [i for i, v in enumerate(probs[0].tolist()) if v > 0]


# ---- counter-based RNG --------------------------------------------------------------------------
def test_splitmix64_reference_value():
    # First output of the reference splitmix64 generator seeded with 0.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert 0 <= splitmix64(MASK64) <= MASK64


def test_counter_uniform_is_pure_and_spread():
    u = [counter_uniform(123, p) for p in range(2000)]
    assert u == [counter_uniform(123, p) for p in range(2000)]
    assert all(0.0 <= x < 1.0 for x in u)
    assert len(set(u)) == len(u)
    assert abs(sum(u) / len(u) - 0.5) < 0.03
    assert counter_uniform(123, 5) != counter_uniform(124, 5)
    assert counter_uniform(123, 5) != counter_uniform(123, 5, case=1)
    assert counter_uniform(123, 5) != counter_uniform(123, 5, namespace="draft")
    assert mix_seed(1, 2) != mix_seed(1, 3) and mix_seed(1, 2) == mix_seed(1, 2)


# ---- greedy -------------------------------------------------------------------------------------
def test_greedy_lowest_index_tie_break():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -3.0, -1.0, -2.0]])
    params = [S(temperature=0)] * 3
    out = Sampler().sample(logits, params, [0, 1, 2], [7, 8, 9])
    assert out.tolist() == [1, 0, 0]
    assert out.dtype == torch.long


def test_greedy_ignores_seed_and_filters():
    logits = torch.tensor([[0.5, 3.0, 2.0]])
    for seed in range(5):
        assert Sampler().sample(logits, [S(temperature=0, top_k=1, top_p=0.1)], [seed], [seed]).item() == 1


# ---- filter masks -------------------------------------------------------------------------------
def test_top_k_exact_with_ties():
    assert _kept(filter_probs(_probs(0.1, 0.4, 0.3, 0.2), [2], [1.0], [0.0])) == [1, 2]
    # The two 0.25 ties straddle the boundary: the lower id stays.
    assert _kept(filter_probs(_probs(0.25, 0.1, 0.25, 0.4), [2], [1.0], [0.0])) == [0, 3]
    assert _kept(filter_probs(_probs(0.25, 0.25, 0.25, 0.25), [3], [1.0], [0.0])) == [0, 1, 2]
    for off in (0, -1, 4, 10):
        assert _kept(filter_probs(_probs(0.1, 0.4, 0.3, 0.2), [off], [1.0], [0.0])) == [0, 1, 2, 3]


def test_top_p_exact():
    p = _probs(0.1, 0.4, 0.3, 0.2)
    assert _kept(filter_probs(p, [0], [0.7], [0.0])) == [1, 2]          # 0.4 + 0.3 reaches 0.7
    assert _kept(filter_probs(p, [0], [0.71], [0.0])) == [1, 2, 3]
    assert _kept(filter_probs(p, [0], [0.4], [0.0])) == [1]
    assert _kept(filter_probs(p, [0], [1e-9], [0.0])) == [1]
    assert _kept(filter_probs(p, [0], [1.0], [0.0])) == [0, 1, 2, 3]
    # Ties in top-p: the lower id comes first in the sorted order.
    assert _kept(filter_probs(_probs(0.3, 0.3, 0.4), [0], [0.6], [0.0])) == [0, 2]
    # A tiny tail token is never dropped by rounding when top_p = 1.
    assert _kept(filter_probs(_probs(1.0, 1e-300), [0], [1.0], [0.0])) == [0, 1]


def test_top_p_after_top_k_is_renormalised():
    # top-k=3 keeps {1,2,3} with mass 0.9; top_p=0.5 of that is 0.45: 0.4 alone is not enough.
    p = _probs(0.1, 0.4, 0.3, 0.2)
    assert _kept(filter_probs(p, [3], [0.5], [0.0])) == [1, 2]
    assert _kept(filter_probs(p, [3], [0.44], [0.0])) == [1]


def test_min_p_exact():
    p = _probs(0.5, 0.3, 0.15, 0.05)
    assert _kept(filter_probs(p, [0], [1.0], [0.2])) == [0, 1, 2]       # threshold 0.1
    assert _kept(filter_probs(p, [0], [1.0], [0.3])) == [0, 1, 2]       # threshold 0.15 (kept: >=)
    assert _kept(filter_probs(p, [0], [1.0], [0.31])) == [0, 1]
    assert _kept(filter_probs(p, [0], [1.0], [1.0])) == [0]


def test_rows_are_filtered_independently():
    p = torch.cat([_probs(0.1, 0.4, 0.3, 0.2), _probs(0.5, 0.3, 0.15, 0.05)])
    out = filter_probs(p, [2, 0], [1.0, 0.5], [0.0, 0.0])
    assert _kept(out[:1]) == [1, 2] and _kept(out[1:]) == [0]


def _full_sort_keep(row, k, p):
    """Reference top-k/top-p keep set from one full stable sort."""
    vals, ids = torch.sort(row, descending=True, stable=True)
    k = k if 0 < k < len(row) else len(row)
    vals, ids = vals[:k], ids[:k]
    total = vals.cumsum(0)[-1] if k < len(row) else row.sum()
    before = torch.cat([vals.new_zeros(1), vals.cumsum(0)[:-1]])
    return sorted(ids[before < p * total].tolist()) if p < 1 else sorted(ids.tolist())


@pytest.mark.parametrize("vocab", [500, 5000])     # batched full-sort path / per-row partial-sort path
def test_filter_paths_match_full_sort(vocab):
    g = torch.Generator().manual_seed(3)
    # Many exact ties (values from a small set) plus a smooth part; peaked and flat rows.
    tied = torch.randint(0, 6, (vocab,), generator=g).double()
    rows = [torch.softmax(tied, 0), torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 4, 0),
            torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1, 0)]
    for row in rows:
        ref_vals, ref_ids = torch.sort(row, descending=True, stable=True)
        for m in (1, 7, 100, vocab // 3, vocab - 1, vocab):
            vals, ids = sorted_prefix(row, m)
            assert torch.equal(ids, ref_ids[:m]) and torch.equal(vals, ref_vals[:m])
        for k, p in [(0, 0.3), (0, 0.95), (0, 0.999), (40, 1.0), (40, 0.5), (2000, 0.9), (1, 0.5)]:
            got = filter_probs(row[None], [k], [p], [0.0])[0]
            assert [i for i, v in enumerate(got.tolist()) if v > 0] == _full_sort_keep(row, k, p), (k, p)


def test_inverse_cdf():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8]], dtype=torch.float64)
    pick = lambda u: inverse_cdf(probs, torch.tensor([u])).item()  # noqa: E731
    assert pick(0.0) == 1 and pick(0.1999) == 1 and pick(0.2) == 3 and pick(0.9999999) == 3
    # Unnormalised rows: u scales with the row total.
    assert inverse_cdf(probs * 3, torch.tensor([0.19])).item() == 1


# ---- seeded sampling ----------------------------------------------------------------------------
@pytest.mark.parametrize("vocab,top_k,steps", [(50, 20, 40), (50, 0, 10), (6000, 0, 6), (6000, 300, 6)])
def test_seeded_sampling_independent_of_batch_composition(vocab, top_k, steps):
    g = torch.Generator().manual_seed(0)
    sampler = Sampler()
    target = torch.randn(1, vocab, generator=g)
    tp = S(temperature=0.9, top_k=top_k, top_p=0.95, seed=11)
    for pos in range(steps):
        alone = sampler.sample(target, [tp], [pos], [11]).item()
        for trial in range(3):
            n = 1 + trial * 3
            others = torch.randn(n, vocab, generator=g)
            op = [S(temperature=0), S(temperature=1.3), S(top_k=3, min_p=0.1)] * n
            where = trial % (n + 1)
            batch = torch.cat([others[:where], target, others[where:]])
            params = op[:where] + [tp] + op[where:n]
            positions = list(range(100, 100 + where)) + [pos] + list(range(200, 200 + n - where))
            seeds = [trial * 31 + i for i in range(where)] + [11] + [99 + i for i in range(n - where)]
            assert sampler.sample(batch, params, positions, seeds)[where].item() == alone


def test_seed_and_position_change_the_draw():
    logits = torch.zeros(1, 1000)
    s = Sampler()
    by_seed = {s.sample(logits, [S()], [0], [seed]).item() for seed in range(50)}
    by_pos = {s.sample(logits, [S()], [pos], [3]).item() for pos in range(50)}
    assert len(by_seed) > 40 and len(by_pos) > 40


def _reference_distribution(logits, temperature, top_k, top_p, min_p):
    """Independent pure-Python statement of the processed distribution."""
    z = [x / temperature for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep = set(order[:top_k] if top_k > 0 else order)
    mass = sum(p[i] for i in keep)
    acc, kp = 0.0, set()
    for i in order:
        if i in keep and acc < top_p * mass:
            kp.add(i)
            acc += p[i]
    pmax = max(p)
    kept = [i for i in kp if p[i] >= min_p * pmax]
    total = sum(p[i] for i in kept)
    return [p[i] / total if i in kept else 0.0 for i in range(len(p))]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 6, 0.9, 0.0), (1.3, 0, 0.8, 0.05), (1.0, 5, 1.0, 0.1),
])
def test_chi_square_matches_filtered_distribution(temperature, top_k, top_p, min_p):
    draws = 20_000
    logits = [0.3, -1.2, 1.5, 0.9, -0.4, 0.0, 1.1, -2.0]
    expected = _reference_distribution(logits, temperature, top_k, top_p, min_p)
    params = S(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=2024)
    got = processed_probs(torch.tensor([logits]), [params])[0]
    assert torch.allclose(got / got.sum(), torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    batch = torch.tensor([logits]).expand(draws, -1)
    tokens = Sampler().sample(batch, [params] * draws, list(range(draws)), [2024] * draws)
    counts = torch.bincount(tokens, minlength=len(logits)).tolist()
    support = [i for i, e in enumerate(expected) if e > 0]
    assert all(counts[i] == 0 for i in range(len(logits)) if expected[i] == 0)
    chi2 = sum((counts[i] - draws * expected[i]) ** 2 / (draws * expected[i]) for i in support)
    dof = len(support) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64)).item()
    assert p_value > 1e-3, (chi2, dof, counts, expected)


# ---- logprobs -----------------------------------------------------------------------------------
def test_compute_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 20, generator=g)
    logits[0, 4] = logits[0, 9] = 10.0            # a tie at the top: lower id first
    sampled = torch.tensor([9, 0, 5])
    res = compute_logprobs(logits, 4, sampled)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert res.top_ids[0, :2].tolist() == [4, 9]
    for r in range(3):
        assert torch.equal(res.top_logprobs[r], ref[r, res.top_ids[r]])
        assert res.top_logprobs[r].tolist() == sorted(res.top_logprobs[r].tolist(), reverse=True)
        assert res.top_ids[r].tolist() == ref[r].argsort(descending=True, stable=True)[:4].tolist()
        s = sampled[r].item()
        assert res.sampled_logprobs[r].item() == ref[r, s].item()
        assert res.sampled_ranks[r].item() == 1 + int((ref[r] > ref[r, s]).sum())
    assert res.sampled_ranks[0].item() == 1        # tied best token has rank 1
    empty = compute_logprobs(logits, 0)
    assert empty.top_ids.shape == (3, 0) and empty.sampled_logprobs is None


# ---- penalties ----------------------------------------------------------------------------------
def test_penalties_exact():
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5, 4.0]])
    out = apply_penalties(logits, [S(repetition_penalty=2.0)], [[1, 2]], [[4]])
    assert out.tolist() == [[1.0, 1.5, -4.0, 0.5, 2.0]]
    out = apply_penalties(logits, [S(presence_penalty=0.5, frequency_penalty=0.25)], [[1, 1, 3]])
    assert out.tolist() == [[1.0, 3.0 - 0.5 - 0.5, -2.0, 0.5 - 0.5 - 0.25, 4.0]]
    assert torch.equal(logits, torch.tensor([[1.0, 3.0, -2.0, 0.5, 4.0]]))   # input untouched
    assert apply_penalties(logits, [S()], [[1]]) is logits                      # no-op fast path


def test_penalties_per_row():
    logits = torch.zeros(2, 4)
    out = apply_penalties(logits, [S(), S(frequency_penalty=1.0)], [[0], [0, 0, 2]])
    assert out.tolist() == [[0.0] * 4, [-2.0, 0.0, -1.0, 0.0]]


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(torch.zeros(2, 4), [S()], [0], [0])


def test_device_counter_uniform_is_bit_identical_to_the_host_one():
    from deepinfer_core.ops.sampler import counter_uniform_tensor
    import random
    rng = random.Random(0)
    seeds = [0, 1, MASK64, (1 << 63), (1 << 63) - 1] + [rng.getrandbits(64) for _ in range(200)]
    positions = [0, 1, 2**31, 2**40, 7] + [rng.randrange(1 << 20) for _ in range(200)]
    for case, ns in [(0, "main"), (1, "main"), (2, "draft")]:
        got = counter_uniform_tensor(seeds, positions, "cpu", case=case, namespace=ns).tolist()
        assert got == [counter_uniform(s, p, case, ns) for s, p in zip(seeds, positions)]


# ---- fast paths: whole-batch greedy / random, tensor positions and seeds -------------------------
def _mixed_batch(rows, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, 5] = logits[:, 9] = logits.max() + 1          # greedy ties: the lower id must win
    kinds = [S(temperature=0), S(temperature=1.0), S(temperature=0.7, top_k=5), S(top_p=0.9),
             S(temperature=1.3, min_p=0.05), S(temperature=0.8, top_k=20, top_p=0.95, min_p=0.01)]
    params = [kinds[(i * 5) % len(kinds)] for i in range(rows)]
    positions = [7 + 3 * i for i in range(rows)]
    seeds = [MASK64 - i if i % 3 == 0 else 1000 + 13 * i for i in range(rows)]   # some >= 2^63
    return logits, params, positions, seeds


def _one_by_one(logits, params, positions, seeds):
    return torch.cat([Sampler().sample(logits[i:i + 1], [params[i]], [positions[i]], [seeds[i]])
                      for i in range(len(params))])


@pytest.mark.parametrize("vocab", [300, 5000])
def test_batch_paths_equal_row_by_row(vocab):
    logits, params, positions, seeds = _mixed_batch(18, vocab)
    alone = _one_by_one(logits, params, positions, seeds)
    s = Sampler()
    assert torch.equal(s.sample(logits, params, positions, seeds), alone)          # mixed
    pos_t = torch.tensor(positions)
    seed_t = torch.tensor([seed_bits(x) for x in seeds])
    assert torch.equal(s.sample(logits, params, pos_t, seed_t), alone)              # tensors
    assert torch.equal(s.sample(logits, params, tuple(positions), seed_t), alone)   # one of each
    rand = [i for i, p in enumerate(params) if p.temperature > 0]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]

    def sub(xs, rows):
        return [xs[i] for i in rows]
    got = s.sample(logits[rand], sub(params, rand), sub(positions, rand), sub(seeds, rand))  # all random
    assert torch.equal(got, alone[rand])
    got = s.sample(logits[rand], sub(params, rand), pos_t[rand], seed_t[rand])
    assert torch.equal(got, alone[rand])
    got = s.sample(logits[greedy], sub(params, greedy), pos_t[greedy], seed_t[greedy])   # all greedy
    assert torch.equal(got, alone[greedy]) and got.dtype == torch.long
    assert set(got.tolist()) == {5}


def test_counter_uniform_tensor_accepts_tensors():
    rng = random.Random(1)
    seeds = [0, MASK64, (1 << 63), (1 << 63) - 1, MASK64 - 5] + [rng.getrandbits(64) for _ in range(100)]
    positions = [0, 2**40, 1, 3, 9] + [rng.randrange(1 << 20) for _ in range(100)]
    st, pt = torch.tensor([seed_bits(s) for s in seeds]), torch.tensor(positions)
    for case, ns in [(0, "main"), (1, "main"), (2, "draft")]:
        want = counter_uniform_tensor(seeds, positions, "cpu", case=case, namespace=ns)
        got = counter_uniform_tensor(st, pt, "cpu", case=case, namespace=ns)
        assert torch.equal(got, want)
        assert got.tolist() == [counter_uniform(s, p, case, ns) for s, p in zip(seeds, positions)]
        assert torch.equal(counter_uniform_tensor(st, positions, "cpu", case=case, namespace=ns), want)


@pytest.mark.parametrize("vocab", [300, 5000])     # batched full-sort path / per-row partial-sort path
def test_logprobs_at_max_k_truncate_to_each_rows_k(vocab):
    # The engine computes one call at the largest k of the batch and cuts each row to its own k.
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 5, (6, vocab), generator=g).float()       # masses of exact ties
    logits[1] = torch.randn(vocab, generator=g)
    logits[2, 100:] = float("-inf")                                       # fewer finite than k
    sampled = torch.randint(0, vocab, (6,), generator=g)
    kmax = 64
    big = compute_logprobs(logits, kmax, sampled)
    for k in (1, 2, 7, 20, 63, kmax):
        small = compute_logprobs(logits, k, sampled)
        assert torch.equal(big.top_ids[:, :k], small.top_ids)
        assert torch.equal(big.top_logprobs[:, :k], small.top_logprobs)
        assert torch.equal(big.sampled_ranks, small.sampled_ranks)
        assert torch.equal(big.sampled_logprobs, small.sampled_logprobs)
    ref = torch.log_softmax(logits, -1).sort(dim=-1, descending=True, stable=True)
    assert torch.equal(big.top_ids, ref.indices[:, :kmax])
    assert torch.equal(big.top_logprobs, ref.values[:, :kmax])
    for r in range(6):                     # ties in id order
        vals, ids = big.top_logprobs[r].tolist(), big.top_ids[r].tolist()
        assert all(vals[j] > vals[j + 1] or ids[j] < ids[j + 1] for j in range(kmax - 1))
