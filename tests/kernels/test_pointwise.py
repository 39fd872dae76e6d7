"""deepinfer_kernels.pointwise against the composed core references (RMSNorm / head_rms_norm,
RotaryTable.apply, fake_quant_fp8 / fake_quant_fp4 / hadamard_transform).

How exact, and why:
- cos/sin are the one thing the kernel cannot share with torch (libdevice on the GPU, numpy under the
  interpreter, vs torch's own; they differ by an ulp on ~13% of angles on CPU). So most tests first
  read the kernel's own table back (rotating the pair (1, 0) by a gives exactly (cos a, sin a)), check
  it against torch within 2 fp32 ulps (test_trig_matches_torch, positions up to 1e6), and then run
  the *unchanged* core composition with that table: everything else must be BITWISE equal (the
  roundings to x.dtype, the rotation products, the butterfly, the fp8/fp4 scales and grids).
- Against torch's own table (test_rope_vs_untouched_core) the rope channels get
  |diff| <= 2^-20 * (|even| + |odd|) + 1 ulp(dtype) of the result: a 1-ulp cos/sin difference moves
  the fp32 rotation by <= 2^-24 * (|even| + |odd|) plus product roundings, and the cast to bf16 can
  then straddle one rounding boundary. Non-rope channels stay bitwise.
- Norms: the sum of squares is reduced in another order than torch's, so on random data the output
  may move by a few fp32 ulps (bf16: one ulp of the cast rsqrt plus one of the product):
  |diff| <= rtol * (|even| + |odd|) of the output pair (a rotated channel itself may cancel to ~0),
  rtol 4 * eps(bf16) / 2^-18 (fp32: a sum-order bound for D <= 512). On data whose squares
  add exactly in any order (multiples of 1/16) every op is correctly rounded on both sides under the
  interpreter (torch's CPU rsqrt is 1/sqrt, like numpy), so there the CPU run is bitwise; on CUDA
  both rsqrts are the approximate hardware one and keep the tolerance. The quant stage is always
  bitwise given the kernel's own pre-quant values (quant="none").
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.config import YarnScaling
from deepinfer_core.model.layers import RMSNorm
from deepinfer_core.ops.portable_pointwise import head_rms_norm
from deepinfer_core.model.rope import RotaryTable
from deepinfer_core.ops.quant import fake_quant_fp4, fake_quant_fp8, hadamard_transform
from deepinfer_kernels.pointwise import norm_rope_quant, rms_norm, rope_inplace

EPS = 1e-6


def _table(rd: int, device: str, yarn: bool = False) -> RotaryTable:
    scaling = YarnScaling(factor=16.0, original_max_position_embeddings=4096) if yarn else None
    return RotaryTable(rd, 160000.0 if yarn else 10000.0, scaling, device)


def _positions(T: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 1_000_000, (T,), generator=g)
    p[0] = 999_999 if T > 1 else p[0]
    return p.to(device)


def _x(T: int, H: int, D: int, dtype, device: str, seed: int, exact: bool = False) -> torch.Tensor:
    """Random x [T, H, D] (H = 0: [T, D]) with an all-zero fp8 block (amax at the floor) and a tiny
    one (amax below the floor) in the first token, an all-zero head in the last. exact: multiples of
    1/16 in [-2, 2], whose squares sum exactly in any order."""
    g = torch.Generator().manual_seed(seed)
    shape = (T, H, D) if H else (T, D)
    x = (torch.randint(-32, 33, shape, generator=g) / 16.0) if exact else torch.randn(shape, generator=g)
    x3 = x.view(T, max(H, 1), D)
    x3[0, 0, : min(64, D // 2)] = 0
    if D >= 128 and not exact:
        x3[0, -1, 64:128] *= 1e-6
    if T > 1:
        x3[-1, 0] = 0
    return x.to(dtype).to(device)


def _trig(fn, table: RotaryTable, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's cos/sin table [T, rd/2]: it rotates the pair (1, 0) to exactly (cos a, sin a)."""
    rd = table.rope_dim
    D = 1 << max(rd - 1, 1).bit_length()
    x = torch.zeros(pos.shape[0], D, dtype=torch.float32, device=pos.device)
    x[:, D - rd::2] = 1.0
    y = fn(x)
    return y[:, D - rd::2].clone(), y[:, D - rd + 1::2].clone()


_TRIG_CACHE: dict = {}


def _kernel_trig(table: RotaryTable, pos: torch.Tensor, which: str = "nrq"):
    key = (which, tuple(table.inv_freq.tolist()), tuple(pos.tolist()), str(pos.device))
    if key not in _TRIG_CACHE:    # the interpreter is slow: probe each table once
        f = table.inv_freq.to(pos.device)
        fn = (lambda x: norm_rope_quant(x, pos, f)) if which == "nrq" else (lambda x: rope_inplace(x, pos, f))
        _TRIG_CACHE[key] = _trig(fn, table, pos)
    return _TRIG_CACHE[key]


def _with_trig(table: RotaryTable, trig) -> RotaryTable:
    """The core table, with its cos/sin replaced by `trig` (all of apply()'s other math unchanged)."""
    table.cos_sin = lambda positions: trig
    return table


def _ref(x, pos, table, *, norm="none", weight=None, inverse=False, quant="none", nope_dim=None):
    """The composition of Attention.forward / Compressor.finalize / Indexer.queries."""
    y = x
    if norm == "head":
        y = head_rms_norm(y, EPS)
    elif norm == "weighted":
        mod = RMSNorm(x.shape[-1], EPS, device=x.device)
        mod.weight = weight
        y = mod(y)
    y = table.apply(y, pos, inverse)
    return _ref_quant(y, quant, table.rope_dim if nope_dim is None else None, nope_dim)


def _ref_quant(y, quant, rd=None, nope_dim=None):
    if quant == "fp8_nope":
        n = y.shape[-1] - rd if nope_dim is None else nope_dim
        return torch.cat([fake_quant_fp8(y[..., :n], 64), y[..., n:]], -1)
    if quant == "hadamard_fp4":
        return fake_quant_fp4(hadamard_transform(y), 32)
    return y


def _pair_mag(b: torch.Tensor) -> torch.Tensor:
    """|b[2i]| + |b[2i+1]| on both channels of each pair: a rotation keeps a pair's length, so this
    bounds what a relative input error can do to a rotated channel (which itself may cancel to ~0)."""
    b = b.float()
    return (b[..., 0::2].abs() + b[..., 1::2].abs()).repeat_interleave(2, -1)


def _assert_close_rel(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str, pairs: bool = True) -> float:
    """|a - b| <= rtol * (pair magnitude of b if pairs else |b|), element-wise."""
    a, b = a.float(), b.float()
    bad = (a - b).abs() > rtol * (_pair_mag(b) if pairs else b.abs())
    assert not bad.any(), f"{what}: {int(bad.sum())} elements beyond rtol {rtol}, max diff {(a - b).abs().max():.3g}"
    return (a - b).abs().max().item()


# ---- trig ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("yarn", [False, True])
def test_trig_matches_torch(kdev, yarn):
    table = _table(64, kdev, yarn)
    pos = torch.cat([torch.tensor([0, 1, 999_999, 1_000_000]), _positions(12, "cpu", 1)]).to(kdev)
    c, s = _kernel_trig(table, pos)
    c2, s2 = _kernel_trig(table, pos, "inplace")
    assert torch.equal(c, c2) and torch.equal(s, s2)        # one helper for both kernels
    rc, rs = table.cos_sin(pos)
    # An absolute 2^-23 is 2 ulps of a value in [0.5, 1); a wrong angle (e.g. not one fp32 product
    # of positions.float() and inv_freq) at position 1e6 would be off by ~1.
    assert (c - rc).abs().max().item() <= 2 ** -23 and (s - rs).abs().max().item() <= 2 ** -23


# ---- norm_rope_quant: exact given the trig --------------------------------------------------------

F32, BF16 = torch.float32, torch.bfloat16
MODES = [("none", False), ("none", True), ("fp8_nope", False), ("hadamard_fp4", False)]
# (T, H (0 = x is [T, D]), D, rd, dtype, quant, inverse): decode-like T <= 3 with every mode and
# dtype; prefill-like T = 37 on a subset (the interpreter runs ~40 ms per program).
BITWISE_CASES = (
    [(1, 4, 128, 64, dt, q, inv) for dt in (F32, BF16) for q, inv in MODES]
    + [(3, 1, 64, 32, dt, q, inv) for dt in (F32, BF16) for q, inv in MODES]
    + [(2, 0, 512, 64, dt, q, inv) for dt in (F32, BF16) for q, inv in MODES[1:]]
    + [(2, 64, 32, 16, dt, q, False) for dt in (F32, BF16) for q in ("none", "fp8_nope", "hadamard_fp4")]
    + [(37, 2, 128, 64, BF16, "fp8_nope", False), (37, 4, 128, 64, F32, "none", True),
       (37, 0, 64, 32, BF16, "hadamard_fp4", False),
       (37, 0, 128, 64, F32, "hadamard_fp4", False)]
)


@pytest.mark.parametrize("T,H,D,rd,dtype,quant,inverse", BITWISE_CASES)
def test_rope_quant_bitwise(kdev, T, H, D, rd, dtype, quant, inverse):
    table = _table(rd, kdev, yarn=D == 64)
    pos = _positions(T, "cpu", T).to(kdev)
    x = _x(T, H, D, dtype, kdev, seed=D + T)
    y = norm_rope_quant(x, pos, table.inv_freq, inverse=inverse, quant=quant)
    ref = _ref(x, pos, _with_trig(table, _kernel_trig(table, pos)), inverse=inverse, quant=quant)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert torch.equal(y, ref), f"max diff {(y.float() - ref.float()).abs().max():.3g}"


@pytest.mark.parametrize("dtype,nope_dim", [(F32, 64), (BF16, 100)])
def test_fp8_explicit_nope_dim(kdev, dtype, nope_dim):
    table = _table(32, kdev)
    pos = _positions(5, "cpu", 3).to(kdev)
    x = _x(5, 2, 128, dtype, kdev, seed=9)
    y = norm_rope_quant(x, pos, table.inv_freq, quant="fp8_nope", nope_dim=nope_dim)
    ref = _ref(x, pos, _with_trig(table, _kernel_trig(table, pos)), quant="fp8_nope", nope_dim=nope_dim)
    assert torch.equal(y, ref)
    for quant in ("none", "hadamard_fp4"):    # other modes ignore nope_dim (like the portable op)
        assert torch.equal(norm_rope_quant(x, pos, table.inv_freq, quant=quant, nope_dim=nope_dim),
                           norm_rope_quant(x, pos, table.inv_freq, quant=quant))
    if nope_dim < 96:     # channels between nope_dim and the rope part pass through untouched
        assert torch.equal(y[..., nope_dim:96], x[..., nope_dim:96])
        assert not torch.equal(y[..., :nope_dim], x[..., :nope_dim])


# ---- norm_rope_quant with a norm ------------------------------------------------------------------

NORM_CASES = [  # norm, quant, T, H, D, rd, dtype, scale of the random data (1e-3: eps matters)
    ("head", "none", 3, 4, 128, 64, F32, 1.0), ("head", "none", 3, 4, 128, 64, BF16, 1e-3),   # q
    ("head", "none", 37, 4, 128, 64, F32, 1e-3),
    ("weighted", "fp8_nope", 7, 0, 128, 64, BF16, 1.0), ("weighted", "fp8_nope", 2, 0, 512, 64, F32, 1e-3),  # kv
    ("weighted", "hadamard_fp4", 3, 0, 128, 64, BF16, 1.0),                                  # indexer rows
    ("weighted", "hadamard_fp4", 2, 0, 64, 32, F32, 1e-3),
    ("head", "hadamard_fp4", 2, 4, 64, 32, BF16, 1.0), ("head", "fp8_nope", 1, 1, 512, 64, BF16, 1e-3),
    ("head", "fp8_nope", 1, 4, 128, 64, F32, 1.0),
]


@pytest.mark.parametrize("norm,quant,T,H,D,rd,dtype,scale", NORM_CASES)
def test_norm_modes(kdev, norm, quant, T, H, D, rd, dtype, scale):
    pos = _positions(T, "cpu", 5).to(kdev)
    table = _table(rd, kdev)
    table = _with_trig(table, _kernel_trig(table, pos))
    g = torch.Generator().manual_seed(D)
    w = (0.25 + 1.5 * torch.rand(D, generator=g)).to(dtype).to(kdev) if norm == "weighted" else None
    rtol = 4 * torch.finfo(dtype).eps if dtype == BF16 else 2 ** -18
    for exact in (True, False):
        x = (_x(T, H, D, F32, kdev, seed=T + D, exact=exact) * (1.0 if exact else scale)).to(dtype)
        kw = dict(norm=norm, weight=w, inverse=exact)
        pre = norm_rope_quant(x, pos, table.inv_freq, **kw)
        ref = _ref(x, pos, table, **kw)
        if exact and kdev == "cpu":
            assert torch.equal(pre, ref), f"{(pre.float() - ref.float()).abs().max():.3g}"
        else:
            _assert_close_rel(pre, ref, rtol, f"{norm} pre-quant")
        if quant != "none":   # the quant stage is bitwise given the kernel's own pre-quant values
            y = norm_rope_quant(x, pos, table.inv_freq, quant=quant, **kw)
            assert torch.equal(y, _ref_quant(pre, quant, rd)), f"{quant} after {norm}"


def official_head_norm(x: torch.Tensor) -> torch.Tensor:
    """`official_head_rms_norm` with each step rounded once to x.dtype, as torch rounds it on CUDA.
    (torch's CPU bf16 rsqrt rounds differently outside its vectorised loop, e.g. a lone 8.3125
    gives 0.345703125, not the nearest 0.34765625: the portable op on the CPU is no bitwise
    reference.)"""
    ms = x.square().mean(-1, keepdim=True)
    return x * torch.rsqrt((ms + EPS).float()).to(x.dtype)


@pytest.mark.parametrize("H,D,rd,quant", [(4, 128, 64, "none"), (2, 64, 32, "hadamard_fp4")])
def test_official_head_norm(kdev, H, D, rd, quant):
    """The QAT numerics' head norm (NvidiaPointwise(official=True)): square, mean, + eps and rsqrt
    each rounded to bf16, then RoPE and the quant as before. Bitwise on the CPU given the kernel's
    trig; the clean kernel rounds elsewhere, so it is further from this reference."""
    T = 9
    pos = _positions(T, "cpu", 6).to(kdev)
    table = _with_trig(_table(rd, kdev), _kernel_trig(_table(rd, kdev), pos))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "nvidia_sm100"))
    from deepinfer_nvidia.pointwise import NvidiaPointwise
    op = NvidiaPointwise(official=True)
    for exact in (True, False):
        x = (_x(T, H, D, F32, kdev, seed=D, exact=exact) * (1.0 if exact else 3.0)).to(BF16)
        pre = op.norm_rope_quant(x, pos, table, norm="head", eps=EPS)
        want = table.apply(official_head_norm(x), pos)
        if kdev == "cpu":
            assert torch.equal(pre, want), f"{(pre.float() - want.float()).abs().max():.3g}"
        else:                     # CUDA: both rsqrts are the approximate hardware one
            _assert_close_rel(pre, want, 4 * torch.finfo(BF16).eps, "official head norm")
        if quant != "none":
            y = op.norm_rope_quant(x, pos, table, norm="head", eps=EPS, quant=quant)
            assert torch.equal(y, _ref_quant(pre, quant, rd))
        clean = norm_rope_quant(x, pos, table.inv_freq, norm="head", eps=EPS)
        if not exact:             # fp32 statistics: another function, further from the reference
            assert (clean != want).any() and (pre == want).sum() > (clean == want).sum()


def test_weighted_norm_uses_the_weight(kdev):
    table = _table(32, kdev)
    pos = _positions(2, "cpu", 0).to(kdev)
    x = _x(2, 0, 64, torch.float32, kdev, seed=1, exact=True)
    w = torch.linspace(0.5, 2.0, 64, device=kdev)
    y1 = norm_rope_quant(x, pos, table.inv_freq, norm="weighted", weight=w)
    y2 = norm_rope_quant(x, pos, table.inv_freq, norm="weighted", weight=torch.ones_like(w))
    assert torch.equal(y1[..., :32], y2[..., :32] * w[:32])   # fl(w * fl(x * r)) on the nope channels
    assert torch.equal(y2, norm_rope_quant(x, pos, table.inv_freq, norm="head"))


# ---- against the untouched core (torch's own cos/sin) ---------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_vs_untouched_core(kdev, dtype):
    T, H, D, rd = 37, 2, 128, 64
    table = _table(rd, kdev)
    pos = _positions(T, "cpu", 11).to(kdev)
    x = _x(T, H, D, dtype, kdev, seed=2)
    ref = table.apply(x, pos, inverse=True)
    tol = 2 ** -20 * _pair_mag(x[..., D - rd:]) + torch.finfo(dtype).eps * ref.float()[..., D - rd:].abs()
    for y in (norm_rope_quant(x, pos, table.inv_freq, inverse=True), rope_inplace(x.clone(), pos, table.inv_freq, True)):
        assert torch.equal(y[..., : D - rd], ref[..., : D - rd])
        diff = (y.float() - ref.float())[..., D - rd:].abs()
        assert (diff <= tol).all(), f"max diff {diff.max():.3g}"


# ---- rope_inplace ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["padded", "transposed", "2d"])
def test_rope_inplace(kdev, dtype, layout):
    T, H, D, rd = 11, 4, 128, 64
    table = _table(rd, kdev)
    pos = _positions(T, "cpu", 4).to(kdev)
    src = _x(T, H, D, dtype, kdev, seed=4)
    if layout == "padded":        # row and head strides with a gap after each head
        big = torch.full((T, H, D + 16), 7.0, dtype=dtype, device=kdev)
        big[..., :D] = src
        x = big[..., :D]
    elif layout == "transposed":  # [H, T, D] storage viewed as [T, H, D]
        big = src.transpose(0, 1).contiguous()
        x = big.transpose(0, 1)
    else:
        big = src[:, 0].clone()
        x, src = big, src[:, 0]
    ref = _ref(src, pos, _with_trig(table, _kernel_trig(table, pos, "inplace")), inverse=True)
    out = rope_inplace(x, pos, table.inv_freq, inverse=True)
    assert out is x
    assert torch.equal(x, ref)
    if layout == "padded":
        assert (big[..., D:] == 7.0).all()


# ---- rms_norm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,wdtype", [(100, torch.float32), (512, torch.bfloat16), (1536, torch.bfloat16)])
def test_rms_norm(kdev, dtype, D, wdtype):
    g = torch.Generator().manual_seed(D)
    w = (0.5 + torch.rand(D, generator=g)).to(wdtype).to(kdev)
    mod = RMSNorm(D, EPS, device=kdev)
    mod.weight = w
    rtol = 4 * torch.finfo(dtype).eps if dtype == torch.bfloat16 else 2 ** -17
    for exact in (True, False):
        x = _x(3, 2, D, torch.float32, kdev, seed=D, exact=exact).to(dtype)
        y = rms_norm(x, w, EPS)
        assert y.shape == x.shape and y.dtype == dtype
        if exact and kdev == "cpu" and D & (D - 1) == 0:   # exact sum and exact 1/D: bitwise
            assert torch.equal(y, mod(x))
        else:
            _assert_close_rel(y, mod(x), rtol, "rms_norm", pairs=False)
    wide = torch.randn(5, D + 8, generator=g).to(dtype).to(kdev)   # strided rows
    _assert_close_rel(rms_norm(wide[:, :D], w, EPS), mod(wide[:, :D]), rtol, "strided rows", pairs=False)


@pytest.mark.parametrize("D", [100, 1024])
def test_rms_norm_batch_invariant(kdev, rows_match, D):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, D, generator=g).to(torch.bfloat16).to(kdev)
    w = torch.randn(D, generator=g).to(kdev)
    full = rms_norm(x, w, EPS)
    for r in (0, 17, 32):
        rows_match(rms_norm(x[r:r + 1], w, EPS)[0], full[r])


# ---- validation -----------------------------------------------------------------------------------

def test_invalid_arguments(kdev):
    f = _table(64, kdev).inv_freq
    x = torch.randn(3, 2, 128, device=kdev)
    pos = torch.arange(3, device=kdev)
    bad = [
        ("x", lambda: norm_rope_quant(x.half(), pos, f)),
        ("x", lambda: norm_rope_quant(torch.randn(3, 2, 96, device=kdev), pos, f)),
        ("x", lambda: norm_rope_quant(x[..., ::2], pos, f)),
        ("x", lambda: norm_rope_quant(x[0, 0], pos, f)),
        ("positions", lambda: norm_rope_quant(x, pos[:2], f)),
        ("positions", lambda: norm_rope_quant(x, pos.float(), f)),
        ("inv_freq", lambda: norm_rope_quant(x, pos, f.double())),
        ("inv_freq", lambda: norm_rope_quant(x, pos, torch.ones(65, device=kdev))),
        ("norm", lambda: norm_rope_quant(x, pos, f, norm="layer")),
        ("quant", lambda: norm_rope_quant(x, pos, f, quant="fp4")),
        ("weight", lambda: norm_rope_quant(x, pos, f, norm="weighted")),
        ("weight", lambda: norm_rope_quant(x, pos, f, norm="weighted", weight=torch.ones(64, device=kdev))),
        ("weight", lambda: norm_rope_quant(x, pos, f, weight=torch.ones(128, device=kdev))),
        ("nope_dim", lambda: norm_rope_quant(x, pos, f, quant="fp8_nope", nope_dim=129)),
        ("block_h", lambda: norm_rope_quant(x, pos, f, block_h=3)),
        ("x", lambda: rope_inplace(x.to(torch.int32), pos, f)),
        ("positions", lambda: rope_inplace(x, pos[None], f)),
        ("x", lambda: rms_norm(torch.randn(2, 8193, device=kdev), torch.ones(8193, device=kdev), EPS)),
        ("weight", lambda: rms_norm(x, torch.ones(64, device=kdev), EPS)),
        ("x", lambda: rms_norm(x.transpose(1, 2), torch.ones(2, device=kdev), EPS)),
    ]
    for name, call in bad:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            call()
