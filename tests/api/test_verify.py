"""Lossless verification of draft tokens (deepinfer_core/ops/verify.py): the greedy rule, the
speculative-sampling rule's output distribution (chi-square against the target's, over 20k seeds),
and independence of the batch."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from deepinfer_core.ops.sampler import counter_uniform_tensor, inverse_cdf
from deepinfer_core.ops.verify import verify

GREEDY = SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
T1 = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
CHI2_DF5_P001 = 20.515          # chi-square critical value, 5 degrees of freedom, significance 0.001


def test_greedy_accepts_while_the_drafts_are_the_argmax():
    logits = torch.tensor([[0., 5, 1, 0], [3, 0, 3, 1], [0, 0, 0, 9], [1, 2, 3, 4]])  # rows predict x1, x2, x3, bonus
    for drafts, want_j, want_tok in (([1, 0, 3], 3, 3),      # all match (row 1 ties 0 and 2: lowest id wins)
                                     ([1, 2, 3], 1, 0),      # x2 = 2 is not the argmax 0: correction 0
                                     ([2, 0, 3], 0, 1)):     # x1 rejected at once: correction 1
        v = verify(logits, [3], torch.tensor(drafts), None, [GREEDY], [10], [0])
        assert v.accepted == [want_j] and v.tokens.tolist() == [want_tok]


def draft(q: torch.Tensor, seeds: list[int], pos: int) -> torch.Tensor:
    u = counter_uniform_tensor(seeds, [pos] * len(seeds), "cpu", namespace="draft")
    return inverse_cdf(q.expand(len(seeds), -1), u)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampling_emits_the_target_distribution():
    """Toy target rows p1, p2, p3 (context-free) and a different draft q1, q2; 20k seeds. The first
    emitted token follows p1; given x1 accepted, the second follows p2."""
    p = torch.tensor([[.30, .25, .20, .10, .10, .05], [.05, .10, .40, .15, .20, .10], [1 / 6] * 6])
    q = torch.tensor([[.05, .40, .05, .30, .10, .10], [.30, .10, .10, .10, .30, .10]])
    logits = p.log()
    n = 20000
    seeds = list(range(1, n + 1))
    x1, x2 = draft(q[0:1], seeds, 7), draft(q[1:2], seeds, 8)
    first = torch.zeros(6)
    second = torch.zeros(6)
    for s, a, b in zip(seeds, x1.tolist(), x2.tolist()):
        v = verify(logits, [2], torch.tensor([a, b]), q, [T1], [7], [s])
        emitted = [a, b][:v.accepted[0]] + v.tokens.tolist()
        first[emitted[0]] += 1
        if v.accepted[0] >= 1:
            second[emitted[1]] += 1
    assert chi2(first, p[0]) < CHI2_DF5_P001, first
    assert chi2(second, p[1]) < CHI2_DF5_P001, second
    # and the drafts were not simply the answer: q1 differs from p1 by far more than the noise
    assert chi2(torch.bincount(x1, minlength=6).float(), p[0]) > 1000


def test_a_request_verifies_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i, (l, params) in enumerate(((2, T1), (0, GREEDY), (3, T1), (1, GREEDY))):
        logits = torch.randn(l + 1, 50, generator=g) * 2
        q = torch.softmax(torch.randn(l, 50, generator=g), -1)
        drafts = torch.multinomial(q, 1, generator=g).squeeze(1) if l else torch.empty(0, dtype=torch.long)
        reqs.append((logits, l, drafts, q, params, 5 + i, 100 + i))
    alone = [verify(r[0], [r[1]], r[2], r[3], [r[4]], [r[5]], [r[6]]) for r in reqs]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        rs = [reqs[i] for i in order]
        v = verify(torch.cat([r[0] for r in rs]), [r[1] for r in rs], torch.cat([r[2] for r in rs]),
                   torch.cat([r[3] for r in rs]), [r[4] for r in rs], [r[5] for r in rs], [r[6] for r in rs])
        assert v.accepted == [alone[i].accepted[0] for i in order]
        assert v.tokens.tolist() == [alone[i].tokens.item() for i in order]
