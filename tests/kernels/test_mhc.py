"""The fused mHC kernels (`deepinfer_kernels.mhc`, served as the NVIDIA backend's `NvidiaMHC`) against
the core's fp32 `PortableMHC` of the same numerics (`official`: the QAT numerics' order and
roundings): pre / post / head on fp32 and bf16 streams, one and several tokens, a hidden size that
is not a power of two (a partial K slice and partial D chunks), Sinkhorn with 1, 2 and 20
iterations, hc = 3 (padded tiles), saturated mixes, batch invariance (bitwise), and input
validation. With `official`, post is the portable op's bits (the same products and sums, in the
same order, none fused)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.ops.portable_mhc import PortableMHC

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
from deepinfer_nvidia.mhc import NvidiaMHC  # noqa: E402

EPS = 1e-6


def make_site(T: int, hc: int, D: int, dtype: torch.dtype, seed: int, head: bool = False, gain: float = 1.0):
    """Streams x [T, hc, D] and one site's fp32 parameters; `gain` scales fn (|mix| ~ gain)."""
    g = torch.Generator().manual_seed(seed)
    n = hc if head else (2 + hc) * hc
    x = (torch.randn(T, hc, D, generator=g) * torch.linspace(0.5, 3.0, hc)[None, :, None]).to(dtype)
    fn = torch.randn(n, hc * D, generator=g) * (gain / (hc * D) ** 0.5)
    scale = torch.tensor([0.8]) if head else torch.tensor([0.9, 0.7, 1.6])
    base = torch.randn(n, generator=g) * 0.5
    return x, fn, scale, base


def to(dev: str, *ts):
    return [t.to(dev) for t in ts]


def check_collapsed(y: torch.Tensor, pre: torch.Tensor, x: torch.Tensor) -> None:
    """y = sum_j pre[j] x[j] in fp32, rounded to x.dtype: fp32 to summation order; bf16 to within half
    a bf16 unit of the fp32 value (the fp32 sums may round to the other neighbour)."""
    want = (pre[..., None] * x.float()).sum(dim=1)
    assert y.dtype == x.dtype and y.shape == want.shape
    got = y.cpu().float()
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert ((got - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()
        assert (got == want.to(x.dtype).float()).float().mean() > 0.9


def ref_pre(x, fn, scale, base, hc, iters, official=False):
    """The core's (y, post, comb) and the pre weights it collapsed with (for checking bf16 y)."""
    mhc = PortableMHC(hc, iters, EPS, EPS, official)
    y, post, comb = mhc.pre(x, fn, scale, base)
    pre = torch.sigmoid(mhc._mix(x, fn)[:, :hc] * scale[0] + base[:hc]) + EPS
    return y, post, comb, pre


@pytest.mark.parametrize("T,hc,D,dtype,iters", [
    (1, 4, 64, torch.float32, 20),
    (5, 4, 200, torch.bfloat16, 20),     # hc*D = 800: a partial second K slice, partial D chunks
    (7, 4, 128, torch.float32, 1),
    (3, 4, 96, torch.bfloat16, 2),
    (4, 3, 40, torch.float32, 20),       # hc not a power of two: padded [4, 4] tiles
])
@pytest.mark.parametrize("official", [False, True])
def test_pre_matches_portable(kdev, T, hc, D, dtype, iters, official):
    x, fn, scale, base = make_site(T, hc, D, dtype, seed=T * 100 + D + iters)
    y_ref, post_ref, comb_ref, pre_ref = ref_pre(x, fn, scale, base, hc, iters, official)
    y, post, comb = NvidiaMHC(hc, iters, EPS, EPS, official).pre(*to(kdev, x, fn, scale, base))
    assert post.dtype == comb.dtype == torch.float32
    assert post.shape == (T, hc) and comb.shape == (T, hc, hc)
    torch.testing.assert_close(post.cpu(), post_ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(comb.cpu(), comb_ref, rtol=1e-5, atol=2e-6)
    check_collapsed(y, pre_ref, x)
    if dtype == torch.float32:
        torch.testing.assert_close(y.cpu(), y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,D,dtype", [(1, 64, torch.float32), (5, 200, torch.bfloat16)])
@pytest.mark.parametrize("official", [False, True])
def test_pre_shifted_matches_portable(kdev, T, D, dtype, official):
    """Shifted mHC (V4.1): x collapsed with the previous site's pre, this site's pre / post / comb."""
    x, fn, scale, base = make_site(T, 4, D, dtype, seed=T + D)
    pre_prev = torch.rand(T, 4, generator=torch.Generator().manual_seed(3)) + 0.1
    y_ref, pre_ref, post_ref, comb_ref = PortableMHC(4, 20, EPS, EPS, official).pre_shifted(
        x, pre_prev, fn, scale, base)
    y, pre, post, comb = NvidiaMHC(4, 20, EPS, EPS, official).pre_shifted(*to(kdev, x, pre_prev, fn, scale, base))
    for got, want in ((pre, pre_ref), (post, post_ref), (comb, comb_ref)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=2e-6)
    check_collapsed(y, pre_prev, x)
    with pytest.raises(ValueError, match=r"pre_prev must be a float32 \[T=%d, hc=4\]" % T):
        NvidiaMHC(4, 20, EPS, EPS).pre_shifted(*to(kdev, x, pre_prev[:, :3], fn, scale, base))


def test_pre_reads_strided_streams(kdev):
    """A view whose streams are not back to back (stride(1) != D) gives the same result."""
    x, fn, scale, base = make_site(3, 4, 48, torch.float32, seed=7)
    wide = torch.zeros(3, 4, 64)
    wide[:, :, :48] = x
    got = NvidiaMHC(4, 20, EPS, EPS).pre(*to(kdev, wide[:, :, :48], fn, scale, base))
    want = PortableMHC(4, 20, EPS, EPS).pre(x, fn, scale, base)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # interpreter's sigmoid
def test_pre_with_saturated_mixes(kdev):
    """|mix| in the hundreds: sigmoids at exactly 0 / 1 (post 0 / 2), near one-hot softmax rows that
    Sinkhorn must still balance, and no inf / nan anywhere."""
    x, fn, scale, base = make_site(6, 4, 64, torch.float32, seed=3, gain=100.0)
    scale, base = scale * 3, base * 40
    y_ref, post_ref, comb_ref, pre_ref = ref_pre(x, fn, scale, base, 4, 20)
    assert post_ref.abs().max() > 1.99 and post_ref.min() < 1e-6      # the test really saturates
    y, post, comb = NvidiaMHC(4, 20, EPS, EPS).pre(*to(kdev, x, fn, scale, base))
    for t in (y, post, comb):
        assert torch.isfinite(t).all()
    # logits ~1e3: fp32 summation order alone (either side) moves a logit by ~1e-4
    torch.testing.assert_close(post.cpu(), post_ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(comb.cpu(), comb_ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(comb.cpu().sum(dim=1), torch.ones(6, 4), rtol=0, atol=1e-4)
    torch.testing.assert_close(y.cpu(), y_ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("T,D,dtype", [(1, 64, torch.float32), (6, 200, torch.bfloat16), (9, 130, torch.float32)])
@pytest.mark.parametrize("official", [False, True])
def test_post_matches_portable(kdev, T, D, dtype, official):
    g = torch.Generator().manual_seed(T + D)
    res = torch.randn(T, 4, D, generator=g).to(dtype)
    f = torch.randn(T, D, generator=g).to(dtype)
    post = torch.rand(T, 4, generator=g) * 2
    comb = torch.rand(T, 4, 4, generator=g)            # not symmetric: the direction is checked
    want32 = post[..., None] * f.float()[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, res.float())
    want = PortableMHC(4, 20, EPS, EPS, official).post(f, res, post, comb)
    out = NvidiaMHC(4, 20, EPS, EPS, official).post(*to(kdev, f, res, post, comb))
    assert out.dtype == dtype and out.shape == (T, 4, D)
    got = out.cpu().float()
    if official:        # post * f + (comb[0] res[0] + comb[1] res[1] + ...), each op rounded
        assert torch.equal(out.cpu(), want), f"max diff {(got - want.float()).abs().max():.3g}"
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert ((got - want32).abs() <= want32.abs() * 2.0 ** -8 + 1e-6).all()
        assert (got == want.float()).float().mean() > 0.9


@pytest.mark.parametrize("T,D,dtype", [(1, 64, torch.bfloat16), (5, 200, torch.float32)])
@pytest.mark.parametrize("official", [False, True])
def test_head_matches_portable(kdev, T, D, dtype, official):
    x, fn, scale, base = make_site(T, 4, D, dtype, seed=T * 7 + D, head=True)
    mhc = PortableMHC(4, 20, EPS, EPS, official)
    pre_ref = torch.sigmoid(mhc._mix(x, fn) * scale + base) + EPS
    y = NvidiaMHC(4, 20, EPS, EPS, official).head(*to(kdev, x, fn, scale, base))
    check_collapsed(y, pre_ref, x)
    if dtype == torch.float32:
        torch.testing.assert_close(y.cpu(), mhc.head(x, fn, scale, base), rtol=1e-5, atol=1e-5)


# official: other compiled kernels (no fp contraction) on a GPU; the same sums when interpreted
@pytest.mark.parametrize("official", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_a_token_is_the_same_alone_and_in_a_batch(kdev, rows_match, official):
    T, D = 37, 200
    x, fn, scale, base = to(kdev, *make_site(T, 4, D, torch.bfloat16, seed=11))
    _, hfn, hscale, hbase = to(kdev, *make_site(1, 4, D, torch.float32, seed=12, head=True))
    f = torch.randn(T, D, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).to(kdev)
    mhc = NvidiaMHC(4, 20, EPS, EPS, official)
    y, post, comb = mhc.pre(x, fn, scale, base)
    out = mhc.post(f, x, post, comb)
    head = mhc.head(x, hfn, hscale, hbase)
    for i in (20, 36):
        xi, fi = x[i:i + 1].clone(), f[i:i + 1].clone()
        yi, pi, ci = mhc.pre(xi, fn, scale, base)
        for alone, inside in ((yi[0], y[i]), (pi[0], post[i]), (ci[0], comb[i]),
                              (mhc.post(fi, xi, pi, ci)[0], out[i]), (mhc.head(xi, hfn, hscale, hbase)[0], head[i])):
            rows_match(alone, inside)
    # a second 64-token projection tile, a third coefficient block
    big = torch.cat([x, x, x[:2]])                      # 76 tokens; row 74 == row 0
    yb, pb, cb = mhc.pre(big, fn, scale, base)
    for inside, first in ((yb[74], y[0]), (pb[74], post[0]), (cb[74], comb[0])):
        rows_match(inside, first)


def test_empty_batch(kdev):
    x, fn, scale, base = to(kdev, *make_site(0, 4, 32, torch.bfloat16, seed=1))
    mhc = NvidiaMHC(4, 20, EPS, EPS)
    y, post, comb = mhc.pre(x, fn, scale, base)
    assert y.shape == (0, 32) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert mhc.post(y, x, post, comb).shape == (0, 4, 32)


def test_invalid_inputs_raise_value_errors_naming_the_argument():
    x, fn, scale, base = make_site(2, 4, 32, torch.float32, seed=2)
    mhc = NvidiaMHC(4, 20, EPS, EPS)
    bad_pre = {
        "x": (x[0], fn, scale, base),                                  # not [T, hc, D]
        "hc=4": (x[:, :3], fn[:, :96], scale, base),                  # 3 streams for hc = 4
        "bfloat16": (x.int(), fn, scale, base),
        r"fn must be \[24": (x, fn[:, :64], scale, base),
        "fn must be a float32": (x, fn.bfloat16(), scale, base),
        "scale must have 3": (x, fn, scale[:1], base),
        "base must have 24": (x, fn, scale, base[:4]),
        "fn is on meta": (x, fn.to("meta"), scale, base),
    }
    for msg, args in bad_pre.items():
        with pytest.raises(ValueError, match=msg):
            mhc.pre(*args)
    _, hfn, hscale, hbase = make_site(2, 4, 32, torch.float32, seed=2, head=True)
    with pytest.raises(ValueError, match="scale must have 1"):
        mhc.head(x, hfn, scale, hbase)
    with pytest.raises(ValueError, match="fn must be \\[4"):
        mhc.head(x, fn, hscale, hbase)
    f, post, comb = torch.zeros(2, 32), torch.zeros(2, 4), torch.zeros(2, 4, 4)
    bad_post = {
        "f must be": (f[:, :16], x, post, comb),
        "res must": (f, x[0], post, comb),
        "hc=4 streams": (f, x[:, :2], post[:, :2], comb[:, :2, :2]),
        "post must be": (f, x, post[:1], comb),
        "comb must be": (f, x, post, comb[:, :, :2]),
        "comb is on meta": (f, x, post, comb.to("meta")),
    }
    for msg, args in bad_post.items():
        with pytest.raises(ValueError, match=msg):
            mhc.post(*args)


def test_every_tile_setting_the_tuner_tries_gives_the_same_result(kdev, monkeypatch):
    """benchmarks/tune_mhc.py times the kernels under other tile constants: each must run and give the
    shipped constants' result up to the summation order (fp32 streams)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import tune_mhc
    from deepinfer_kernels import mhc as kmhc

    x, fn, scale, base = to(kdev, *make_site(9, 4, 200, torch.float32, seed=21))
    f = torch.randn(9, 200, generator=torch.Generator().manual_seed(22)).to(kdev)
    y0, post0, comb0 = kmhc.mhc_pre(x, fn, scale, base, 4, 20, EPS, EPS)
    out0 = kmhc.mhc_post(f, x, post0, comb0)
    assert tune_mhc.VARIANTS[0] == {} and len(tune_mhc.VARIANTS) > 1
    for change in tune_mhc.VARIANTS[1:]:
        with monkeypatch.context() as m:
            for name, value in change.items():
                assert name in tune_mhc.KNOBS and hasattr(kmhc, name), name
                m.setattr(kmhc, name, value)
            y, post, comb = kmhc.mhc_pre(x, fn, scale, base, 4, 20, EPS, EPS)
            out = kmhc.mhc_post(f, x, post, comb)
        for got, want in ((y, y0), (post, post0), (comb, comb0), (out, out0)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, c=change: f"{c}: {m}")
