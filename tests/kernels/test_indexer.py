"""Lightning-indexer scoring and deterministic top-k (`deepinfer_kernels.indexer`) against the core's
`PortableAttentionBackend.index_select` and its formula, on ragged batches whose key rows live in
shuffled physical blocks. Selections are compared exactly with a stable sort of the kernel's own
scores (so float summation order cannot make a test flaky), and end to end with the reference on
inputs that are exact (integer-valued) or have no near-ties. The head weights w carry the
1/sqrt(Di) score scale (the model's `Indexer.head_weights`). `official=True` (the QAT numerics):
bf16 scores rounded step by step as DeepSeek's inference code rounds them."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.ops.portable_attention import PortableAttentionBackend
from deepinfer_kernels.indexer import indexer_scores, indexer_topk


def make_case(lengths, n_new, *, heads=4, dim=16, ratio=4, maxb=None, dtype=torch.float32, ints=False,
              seed=0, device="cpu") -> dict:
    """Sequences of `lengths` tokens whose last n_new[s] tokens are the queries; every complete key row
    of a sequence sits in the paged pool behind a random permutation of physical blocks."""
    g = torch.Generator().manual_seed(seed)
    rpb = 128 // ratio
    n_rows = [L // ratio for L in lengths]
    nblk = [-(-n // rpb) for n in n_rows]
    maxb = maxb or max(1, *nblk)
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()

    def draw(*shape):
        if ints:     # small integers: exact products and sums, hence many exact ties
            return torch.randint(-2, 3, shape, generator=g).float()
        return torch.randn(shape, generator=g)

    pool = draw(num_blocks, rpb, dim)          # unused blocks hold values too: a wrong gather shows
    table = torch.zeros(len(lengths), maxb, dtype=torch.int32)
    klog, nxt = [], 0
    for s, n in enumerate(n_rows):
        k = draw(n, dim).to(dtype).float()
        klog.append(k)
        for j in range(nblk[s]):
            table[s, j] = perm[nxt]
            pool[perm[nxt], :min(rpb, n - j * rpb)] = k[j * rpb:(j + 1) * rpb]
            nxt += 1
    pos = torch.cat([torch.arange(L - m, L) for L, m in zip(lengths, n_new)])
    seq = torch.cat([torch.full((m,), s, dtype=torch.int32) for s, m in enumerate(n_new)])
    T = pos.numel()
    q = draw(T, heads, dim).to(dtype)
    w = torch.randint(-1, 3, (T, heads), generator=g).float() if ints else torch.randn(T, heads, generator=g)
    return dict(q=q.to(device), w=w.to(device), keys=pool.to(dtype).to(device), block_table=table.to(device),
                token_seq=seq.to(device), positions=pos.to(device), klog=klog, ratio=ratio, dim=dim)


def args(c: dict) -> tuple:
    return c["q"], c["w"], c["keys"], c["block_table"], c["token_seq"], c["positions"]


def n_visible(c: dict, max_rows: int | None = None) -> list[int]:
    cap = c["block_table"].shape[1] * (128 // c["ratio"]) if max_rows is None else max_rows
    return [min(max(0, (p + 1) // c["ratio"]), cap) for p in c["positions"].cpu().tolist()]


def ref_scores(c: dict, max_rows: int) -> torch.Tensor:
    """The reference formula in float64, -inf past each query's visible rows."""
    q, w = c["q"].cpu().double(), c["w"].cpu().double()
    out = torch.full((q.shape[0], max_rows), float("-inf"), dtype=torch.float64)
    for t, (s, n) in enumerate(zip(c["token_seq"].cpu().tolist(), n_visible(c, max_rows))):
        k = c["klog"][s][:n].double()
        out[t, :n] = (torch.relu(q[t] @ k.T) * w[t][:, None]).sum(0)
    return out


def stable_select(scores: torch.Tensor, nvis: list[int], topk: int) -> torch.Tensor:
    """Top min(topk, n) rows of each query, equal scores to the lowest row id, ascending, -1 padded."""
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32)
    for t, n in enumerate(nvis):
        k = min(topk, n)
        top = torch.sort(scores[t, :n].cpu(), descending=True, stable=True).indices[:k]
        out[t, :k] = top.sort().values.int()
    return out


def portable_select(c: dict, topk: int) -> torch.Tensor:
    """`PortableAttentionBackend.index_select` (clean numerics) per sequence, turned into ascending
    -1-padded ids."""
    seq, pos = c["token_seq"].cpu(), c["positions"].cpu()
    q, w = c["q"].cpu(), c["w"].cpu()
    out = torch.full((seq.numel(), topk), -1, dtype=torch.int32)
    for s, keys in enumerate(c["klog"]):
        rows = (seq == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        mask = PortableAttentionBackend().index_select(q[rows], w[rows], keys, pos[rows],
                                                       c["ratio"], topk)
        for i, t in enumerate(rows.tolist()):
            ids = mask[i].nonzero().flatten().int()
            out[t, :ids.numel()] = ids
    return out


def assert_no_near_ties(c: dict, topk: int, gap: float = 1e-4) -> None:
    """Precondition of an end-to-end comparison on random data: at every query's cut the k-th and
    (k+1)-th reference scores are more than `gap` apart, or both exactly 0 (every head relu'd away,
    exact in any summation order) with no other score within `gap` of 0."""
    for t, (row, n) in enumerate(zip(ref_scores(c, max(n_visible(c)) or 1), n_visible(c))):
        if n > topk:
            srt = row[:n].sort(descending=True).values
            a, b = srt[topk - 1].item(), srt[topk].item()
            if a == b == 0:
                assert ((srt == 0) | (srt.abs() > gap)).all(), t
            else:
                assert a - b > gap, (t, a, b)


RAGGED = dict(lengths=[300, 45, 7, 260], n_new=[4, 2, 2, 3])     # 4 sequences, up to 75 rows, T = 11


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_match_the_formula(kdev, dtype):
    c = make_case(**RAGGED, dtype=dtype, maxb=3, device=kdev)
    got = indexer_scores(*args(c), ratio=4).cpu()
    want = ref_scores(c, 96)
    assert got.shape == (11, 96) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(want))          # exactly the invisible rows
    fin = torch.isfinite(want)
    assert fin.sum() > 150
    torch.testing.assert_close(got[fin].double(), want[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("topk,select_block", [(1, 32), (8, None), (40, 16)])
def test_selection_is_the_stable_top_k_of_the_kernel_scores(kdev, topk, select_block):
    c = make_case(**RAGGED, maxb=3, seed=1, device=kdev)
    scores = indexer_scores(*args(c), ratio=4)
    got = indexer_topk(*args(c), topk=topk, ratio=4, select_block=select_block).cpu()
    assert got.shape == (11, topk) and got.dtype == torch.int32
    assert torch.equal(got, stable_select(scores, n_visible(c), topk))


def test_ties_go_to_the_lowest_row(kdev):
    """Integer-valued q, k, w: many scores tie exactly (also at the k-th value), the arithmetic is
    exact, so the kernel must equal both the stable sort and the portable reference bit for bit."""
    c = make_case(lengths=[400, 200, 130], n_new=[4, 3, 3], ints=True, maxb=4, seed=2, device=kdev)
    topk = 10
    scores = indexer_scores(*args(c), ratio=4).cpu()
    nvis = n_visible(c)
    tied = 0
    for t, n in enumerate(nvis):
        if n > topk:
            srt = scores[t, :n].sort(descending=True).values
            tied += int(srt[topk - 1] == srt[topk])
    assert tied >= 5                         # the k-th value is shared across the cut in most queries
    got = indexer_topk(*args(c), topk=topk, ratio=4, select_block=32).cpu()     # several steps a row
    assert torch.equal(got, stable_select(scores, nvis, topk))
    assert torch.equal(got, portable_select(c, topk))


def test_end_to_end_matches_the_portable_backend(kdev):
    c = make_case(**RAGGED, maxb=3, seed=3, device=kdev)
    topk = 12
    assert_no_near_ties(c, topk)
    got = indexer_topk(*args(c), topk=topk, ratio=4).cpu()
    assert torch.equal(got, portable_select(c, topk))


def test_visible_counts_around_topk(kdev):
    """n_visible 0, < topk, == topk, == topk + 1 and > topk in one batch; -1 padding at the end."""
    topk = 6
    lengths = [3, 17, 24, 28, 200]            # (L-1+1)//4 = 0, 4, 6, 7, 50 rows for the last token
    c = make_case(lengths=lengths, n_new=[1] * 5, maxb=2, seed=4, device=kdev)
    assert n_visible(c) == [0, 4, 6, 7, 50]
    got = indexer_topk(*args(c), topk=topk, ratio=4).cpu()
    assert got[0].tolist() == [-1] * 6
    assert got[1].tolist() == [0, 1, 2, 3, -1, -1]
    assert got[2].tolist() == [0, 1, 2, 3, 4, 5]
    assert (got[3:] >= 0).all() and (got[3:].diff(dim=1) > 0).all()
    assert torch.equal(got, stable_select(indexer_scores(*args(c), ratio=4), n_visible(c), topk))
    assert_no_near_ties(c, topk)
    assert torch.equal(got, portable_select(c, topk))


def test_newest_row_appears_exactly_when_visible(kdev):
    """Queries around (pos+1)//4 changing, including the 32-row physical block edge: the newest
    complete row is given the highest score, so it is picked exactly when it is visible."""
    c = make_case(lengths=[160], n_new=[40], maxb=2, seed=5, device=kdev)   # positions 120..159
    pick = torch.tensor([2, 3, 7, 8, 11, 12, 23, 27, 28], device=kdev)
    for name in ("q", "w", "token_seq", "positions"):
        c[name] = c[name][pick]
    assert n_visible(c) == [30, 31, 32, 32, 33, 33, 36, 37, 37]
    keys = c["klog"][0]
    keys[:] = keys.abs() * 0.01
    keys[31] = keys[32] = keys[36] = 1.0      # rows at the block edge and after it stand out
    rpb = 32
    for j in range(2):
        blk = int(c["block_table"][0, j])
        part = keys[j * rpb:(j + 1) * rpb]
        c["keys"][blk, :part.shape[0]] = part.to(c["keys"].device)
    c["q"] = c["q"].abs()
    c["w"] = c["w"].abs() + 0.1
    got = indexer_topk(*args(c), topk=4, ratio=4).cpu()
    for pos, row in zip(c["positions"].tolist(), got.tolist()):
        n = (pos + 1) // 4
        assert [r in row for r in (31, 32, 36)] == [n > 31, n > 32, n > 36], (pos, row)
        assert sorted(x for x in row if x >= 0) == row and max(row) < n
    assert_no_near_ties(c, 4)
    assert torch.equal(got, portable_select(c, 4))


def test_max_rows_bounds_the_candidates(kdev):
    c = make_case(**RAGGED, maxb=3, seed=6, device=kdev)
    got = indexer_topk(*args(c), topk=8, ratio=4, max_rows=40).cpu()
    scores = indexer_scores(*args(c), ratio=4, max_rows=40)
    assert scores.shape == (11, 40)
    assert torch.equal(got, stable_select(scores, n_visible(c, 40), 8))
    assert got.max() < 40
    assert (indexer_topk(*args(c), topk=8, ratio=4, max_rows=0) == -1).all()


@pytest.mark.parametrize("ratio", [16, 128])
def test_other_ratios(kdev, ratio):
    c = make_case(lengths=[3000, 900], n_new=[3, 2], ratio=ratio, seed=7, device=kdev)
    got = indexer_topk(*args(c), topk=5, ratio=ratio).cpu()
    assert_no_near_ties(c, 5)
    assert torch.equal(got, portable_select(c, 5))


def test_a_query_does_not_depend_on_its_batch(kdev, rows_match):
    """Scores (hence ties) of a query are the same bits alone or in a batch, and so is its pick."""
    c = make_case(**RAGGED, maxb=3, seed=8, device=kdev)
    full = indexer_scores(*args(c), ratio=4)
    part = [x[7:10] for x in (c["q"], c["w"], c["token_seq"], c["positions"])]
    alone = indexer_scores(part[0], part[1], c["keys"], c["block_table"], part[2], part[3], ratio=4)
    rows_match(alone, full[7:10])
    got = indexer_topk(part[0], part[1], c["keys"], c["block_table"], part[2], part[3], topk=8, ratio=4).cpu()
    assert torch.equal(got, stable_select(alone, n_visible(c)[7:10], 8))    # = full's pick where bitwise


def test_results_follow_device_metadata_without_host_reads(kdev):
    """The call reads positions only on the device: captured in a CUDA graph (on a GPU) and replayed
    after the positions change in place, it gives the fresh answer."""
    c = make_case(**RAGGED, maxb=3, seed=9, device=kdev)
    run = lambda: indexer_topk(*args(c), topk=8, ratio=4, max_rows=96)     # noqa: E731
    if kdev == "cuda":
        run()                                  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        c["positions"].sub_(40).clamp_(min=0)
        graph.replay()
        torch.cuda.synchronize()
        got = out.cpu()
    else:
        c["positions"].sub_(40).clamp_(min=0)
        got = run().cpu()
    assert_no_near_ties(c, 8)
    assert torch.equal(got, portable_select(c, 8))


def official_scores(c: dict, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`official=True`'s formula on the CPU (the portable op's): q.k, relu(.) * w and the head sum
    each rounded to q's dtype, -inf past each query's visible rows; fp32. Also each score's largest
    |head term| (0 past the visible rows)."""
    q, w = c["q"].cpu(), c["w"].cpu().to(c["q"].dtype)
    out = torch.full((q.shape[0], max_rows), float("-inf"))
    term = torch.zeros(q.shape[0], max_rows)
    for t, (s, n) in enumerate(zip(c["token_seq"].cpu().tolist(), n_visible(c, max_rows))):
        heads = torch.einsum("hd,bd->hb", q[t], c["klog"][s][:n].to(q.dtype)).relu() * w[t][:, None]
        out[t, :n], term[t, :n] = heads.sum(0).float(), heads.abs().amax(0).float()
    return out, term


def test_official_scores_round_like_the_official_code(kdev):
    c = make_case(**RAGGED, dtype=torch.bfloat16, maxb=3, seed=10, device=kdev)
    c["w"] = (c["w"] * 0.3).to(torch.bfloat16)            # the model's bf16 head weights
    want, term = official_scores(c, 96)
    got = indexer_scores(*args(c), ratio=4, official=True).cpu()
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), ~fin) and fin.sum() > 150
    assert torch.equal(got[fin], got[fin].bfloat16().float())                 # bf16 values
    # the same bits but where an fp32 dot or head sum, added in another order, rounds the other
    # way: one bf16 unit of the score, or of its largest head term where the heads cancel
    assert ((got - want)[fin].abs() <= (want[fin].abs() + term[fin]) * 2.0 ** -7).all()
    same = (got[fin] == want[fin]).float().mean().item()
    clean = indexer_scores(*args(c), ratio=4).cpu()[fin]
    assert same > 0.97 and (clean == want[fin]).float().mean().item() < 0.5, same


def test_official_selection_is_a_top_k_of_the_official_scores(kdev):
    """bf16 scores tie often: the kernel keeps the lowest row ids among equal scores (the stable
    top-k of its own scores), and its rows are a top-k of the CPU formula's scores."""
    c = make_case(lengths=[400, 200, 130], n_new=[4, 3, 3], dtype=torch.bfloat16, maxb=4, seed=11,
                  device=kdev)
    c["w"] = (c["w"] * 0.3).to(torch.bfloat16)
    topk = 10
    scores = indexer_scores(*args(c), ratio=4, official=True).cpu()
    got = indexer_topk(*args(c), topk=topk, ratio=4, official=True, select_block=32).cpu()
    nvis = n_visible(c)
    assert torch.equal(got, stable_select(scores, nvis, topk))
    want = official_scores(c, scores.shape[1])[0]
    ties = checked = 0
    for t, n in enumerate(nvis):
        row = want[t, :n]
        ties += int(len(row.unique()) < n)
        if n <= topk or not torch.equal(scores[t, :n], row):
            continue
        picked = torch.zeros(n, dtype=torch.bool)
        picked[got[t, :topk].long()] = True
        assert row[picked].min() >= row[~picked].max(), t
        checked += 1
    assert ties >= 5 and checked >= 6, (ties, checked)


def test_empty_batch(kdev):
    c = make_case(lengths=[40], n_new=[0], device=kdev)
    assert indexer_topk(*args(c), topk=4).shape == (0, 4)
    assert indexer_scores(*args(c)).shape == (0, 32)


def test_input_validation():
    c = make_case(lengths=[100, 50], n_new=[2, 2], maxb=2)
    q, w, keys, bt, seq, pos = args(c)
    bad = [
        (dict(ratio=3), "ratio"),
        (dict(topk=0), "topk"),
        (dict(max_rows=65), "max_rows"),
        (dict(select_block=24), "select_block"),
        (dict(q=q[0]), "q must"),
        (dict(q=q.to(torch.int32)), "q must"),
        (dict(w=w[:, :2]), "w must"),
        (dict(keys=keys[:, :16]), "keys must"),
        (dict(keys=keys[..., :8]), "keys must"),
        (dict(block_table=bt.long()), "block_table"),
        (dict(token_seq=seq[:3]), "token_seq"),
        (dict(positions=pos.float()), "positions"),
    ]
    base = dict(q=q, w=w, keys=keys, block_table=bt, token_seq=seq, positions=pos, topk=4, ratio=4)
    for change, word in bad:
        kw = {**base, **change}
        with pytest.raises(ValueError, match=word):
            indexer_topk(kw.pop("q"), kw.pop("w"), kw.pop("keys"), kw.pop("block_table"), kw.pop("token_seq"),
                         kw.pop("positions"), **kw)
    with pytest.raises(ValueError, match="ratio"):
        indexer_scores(q, w, keys, bt, seq, pos, ratio=256)
