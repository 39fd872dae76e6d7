"""V4.1's compressed-KV precision in the QAT simulation (`use_fp4_sparse_kv`, spec deepseek_v41.md
§4, §15): FP4 E2M1 with one E4M3 scale per 16 over all channels, else MXFP8 (E4M3, UE8M0 per 32);
V4 keeps FP8 on the nope channels per 64. The fake-quants against a direct re-implementation (grid
search with ties to the even code), then the Compressor's choice of mode, then the rows the tiny
V4.1 and V4 actually cache, checked on their grids without reusing the code under test."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.attention import Compressor
from deepinfer_core.model.rope import RotaryTable
from deepinfer_core.ops.portable_pointwise import (
    PORTABLE,
    QUANTS,
    fake_quant_kv_row,
    rms_norm,
)
from deepinfer_core.ops.quant import fake_quant_fp4_e4m3, fake_quant_fp8
from deepinfer_core.tools.tiny_config import tiny_config_dict
from deepinfer_core.tools.tiny_config_v41 import tiny_v41_config_dict

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])         # index = magnitude code
E4M3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # codes 0..126


# ---- independent helpers -----------------------------------------------------------------------

def nearest_even(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """The grid value nearest to each a >= 0 (grid sorted by code), ties to the even code."""
    d = (a[..., None] - grid).abs()
    tied = d == d.amin(-1, keepdim=True)
    even = (torch.arange(grid.numel()) % 2 == 0)
    return grid[(tied * (2 + even.to(torch.int64))).argmax(-1)]


def on_grid(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return (v.abs()[..., None] == grid).any(-1)


def blocks(y: torch.Tensor, block: int) -> torch.Tensor:
    return y.float().reshape(-1, block)


def fp4_e4m3_ok(y: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Per block: some E4M3 scale s > 0 puts every y/s on the E2M1 grid (or the block is zero).
    The largest |y| is one of the E2M1 values times s, so s is amax / (that value)."""
    yb = blocks(y, block)
    amax = yb.abs().amax(-1, keepdim=True)
    ok = amax == 0
    for top in E2M1[1:].tolist():
        s = amax / top
        on = on_grid(yb / s.clamp_min(1e-30), E2M1).all(-1, keepdim=True)
        ok |= on_grid(s, E4M3) & (s > 0) & on
    return ok.squeeze(-1)


def e2m1_pow2_ok(y: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per block: some power-of-two scale puts every y/s on the E2M1 grid (index keys)."""
    yb = blocks(y, block)
    amax = yb.abs().amax(-1, keepdim=True)
    ok = amax == 0
    for top in E2M1[1:].tolist():
        s = amax / top
        pow2 = torch.frexp(s).mantissa == 0.5
        ok |= pow2 & on_grid(yb / s.clamp_min(1e-30), E2M1).all(-1, keepdim=True)
    return ok.squeeze(-1)


def e4m3_pow2_ok(y: torch.Tensor, block: int) -> torch.Tensor:
    """Per block: a power-of-two scale 2^(e-8) or 2^(e-7) (e = floor(log2 amax)) puts every y/s on
    the E4M3 grid -- MXFP8, and V4's FP8 nope tiles (amax/s lands in (224, 448])."""
    yb = blocks(y, block)
    amax = yb.abs().amax(-1, keepdim=True)
    e = torch.frexp(amax).exponent - 1
    ok = amax == 0
    for k in (7, 8):
        ok |= on_grid(yb * torch.exp2((k - e).float()), E4M3).all(-1, keepdim=True)
    return ok.squeeze(-1)


def ref_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """The recipe, written out: s = nearest E4M3 to min(amax/6, 448); e2m1(clamp(x/s, +-6)) * s."""
    xb = blocks(x, block)
    s = nearest_even((xb.abs().amax(-1, keepdim=True) / 6).clamp_max(448.0), E4M3)
    v = torch.where(s > 0, xb / s, torch.zeros_like(xb)).clamp(-6.0, 6.0)
    q = torch.copysign(nearest_even(v.abs(), E2M1), v)
    return (q * s).reshape(x.shape).to(x.dtype)


def ref_mxfp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """s = 2^ceil(log2(max(amax, 1e-4) / 448)); nearest E4M3 of x/s, times s."""
    xb = blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2((amax / 448).double()))).float()
    v = xb / s
    return (torch.copysign(nearest_even(v.abs(), E4M3), v) * s).reshape(x.shape).to(x.dtype)


TIES = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 0.125, 4.5,
                     5.5, 1.0, -6.0])
TIES_ROUNDED = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0, 0.0, 4.0,
                             6.0, 1.0, -6.0])


def mixed_blocks(n_blocks: int, block: int, seed: int) -> torch.Tensor:
    """Random blocks over 2^-24 .. 2^15 (scales that underflow E4M3, subnormal, normal and
    saturated), all-zero blocks, and blocks of exact E2M1 ties (x/s = 0.25, 2.5, 5 ...)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, block, generator=g)
    x *= torch.exp2(torch.randint(-24, 16, (n_blocks, 1), generator=g).float())
    x[::7] = 0.0
    x[5::13] *= 2.0 ** -100                            # amax/6 far below E4M3's smallest value
    x[3::11] = 0.0
    x[3::11, :16] = TIES                               # amax 6: s = 1, the ties stay exact ties
    return x.reshape(-1)


# ---- the fake-quants ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp4_e4m3_matches_the_recipe_written_out(dtype):
    x = mixed_blocks(400, 16, seed=1)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype)
    got = fake_quant_fp4_e4m3(x)
    assert got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got, ref_fp4_e4m3(x))
    # the product e2m1 * s is exact in every activation dtype: no second rounding
    assert torch.equal(got.float(), fake_quant_fp4_e4m3(x.float()))


def test_fp4_e4m3_grid_scale_and_edges():
    x = mixed_blocks(400, 16, seed=2)
    got = fake_quant_fp4_e4m3(x)
    assert fp4_e4m3_ok(got).all()
    xb, gb = blocks(x, 16), blocks(got, 16)
    amax6 = xb.abs().amax(-1) / 6
    normal = (amax6 >= 2.0 ** -6) & (amax6 <= 448)
    # a normal scale rounds amax/6 by at most 1/16, so the block's largest value lands on 6 * s
    s = gb.abs().amax(-1)[normal] / 6
    assert torch.equal(s, amax6[normal].to(torch.float8_e4m3fn).float())
    assert torch.equal(gb[amax6 <= 2.0 ** -10], torch.zeros_like(gb[amax6 <= 2.0 ** -10]))
    huge = amax6 > 448                                 # saturated scale: values clamp to +-6 * 448
    assert huge.any() and (gb[huge].abs().amax(-1) == 6 * 448).all()
    assert (gb[3::11] == TIES_ROUNDED).all()           # s = 1: ties to the even code


def test_fp4_e4m3_pads_a_partial_last_block():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    got = fake_quant_fp4_e4m3(x)
    padded = torch.nn.functional.pad(x, (0, 8))
    assert got.shape == x.shape and torch.equal(got, fake_quant_fp4_e4m3(padded)[:, :40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_matches_the_recipe_written_out(dtype):
    x = mixed_blocks(200, 32, seed=4).to(dtype)
    got = fake_quant_fp8(x, 32)
    assert got.dtype == dtype and torch.equal(got, ref_mxfp8(x))
    assert e4m3_pow2_ok(got[blocks(x, 32).abs().amax(-1).repeat_interleave(32) >= 1e-4], 32).all()


def test_kv_row_modes_cover_every_channel_after_rope():
    cfg = ModelConfig.from_dict(tiny_v41_config_dict())
    rope = RotaryTable(cfg.qk_rope_head_dim, 10000.0, None)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 128, generator=g), torch.rand(128, generator=g).to(torch.bfloat16) + 0.5
    pos = torch.arange(6) * 7
    plain = rope.apply(rms_norm(x, w, 1e-6), pos)
    wants = {"fp4_kv": fake_quant_fp4_e4m3(plain, 16), "mxfp8_kv": fake_quant_fp8(plain, 32)}
    for quant, want in wants.items():
        got = PORTABLE.norm_rope_quant(x, pos, rope, norm="weighted", weight=w, eps=1e-6,
                                       quant=quant)
        assert torch.equal(got, want) and torch.equal(fake_quant_kv_row(plain, quant), want)
        assert not torch.equal(got[:, 64:], plain[:, 64:])            # the RoPE channels too
    assert fp4_e4m3_ok(fake_quant_kv_row(plain, "fp4_kv")).all()
    with pytest.raises(ValueError, match=r"quant='fp4'; allowed: \['none', 'fp8_nope'"):
        PORTABLE.norm_rope_quant(x, pos, rope, quant="fp4")
    with pytest.raises(ValueError, match=r"norm='rms'; allowed"):
        PORTABLE.norm_rope_quant(x, pos, rope, norm="rms")
    with pytest.raises(ValueError, match=r"allowed: \['fp4_kv', 'mxfp8_kv'\]"):
        fake_quant_kv_row(plain, "fp8_nope")
    assert {"fp4_kv", "mxfp8_kv"} <= set(QUANTS)


# ---- the Compressor's choice -------------------------------------------------------------------

class OldModesOnly:
    """A backend PointwiseMethod that knows only V4's quant modes (like the fused Triton one)."""

    def rms_norm(self, x, weight, eps):
        return PORTABLE.rms_norm(x, weight, eps)

    def norm_rope_quant(self, x, positions, rope, **kw):
        if kw.get("quant", "none") not in ("none", "fp8_nope", "hadamard_fp4"):
            raise ValueError(f"unknown quant {kw['quant']!r}")
        return PORTABLE.norm_rope_quant(x, positions, rope, **kw)


def compressor(cfg: ModelConfig, kind: str, dim: int, qat: bool = True) -> Compressor:
    c = Compressor(cfg, 2, dim, kind)
    c.rope = RotaryTable(cfg.qk_rope_head_dim, 10000.0, None)
    c.norm.weight.copy_(torch.rand(dim, generator=torch.Generator().manual_seed(6)) + 0.5)
    c.numerics.simulate_qat = qat
    return c


@pytest.mark.parametrize("fp4", [True, False])
def test_v41_compressor_rounds_its_rows_and_keeps_prerope_rows_clean(fp4):
    cfg = ModelConfig.from_dict(tiny_v41_config_dict(use_fp4_sparse_kv=fp4))
    c = compressor(cfg, "kv", cfg.head_dim)
    c.norm.pointwise = OldModesOnly()
    pooled = torch.randn(5, cfg.head_dim, generator=torch.Generator().manual_seed(7))
    starts = torch.arange(5) * 2
    plain = c.rope.apply(rms_norm(pooled, c.norm.weight, c.norm.eps), starts)
    want = fake_quant_fp4_e4m3(plain, 16) if fp4 else fake_quant_fp8(plain, 32)
    assert c.quant == ("fp4_kv" if fp4 else "mxfp8_kv")
    assert torch.equal(c.finalize(pooled, starts), want)
    rows, pre = c.finalize_with_prerope(pooled, starts)
    assert torch.equal(rows, want)
    assert torch.equal(pre, rms_norm(pooled, c.norm.weight, c.norm.eps))   # unquantised, pre-RoPE
    c.numerics.simulate_qat = False
    assert torch.equal(c.finalize(pooled, starts), plain)


def test_v4_compressors_keep_their_rounding():
    cfg = ModelConfig.from_dict(tiny_config_dict(use_fp4_sparse_kv=True))   # V4 ignores the field
    assert cfg.family == "v4" and cfg.use_fp4_sparse_kv
    pooled = torch.randn(5, 128, generator=torch.Generator().manual_seed(8))
    starts = torch.arange(5) * 4
    for kind, quant in (("kv", "fp8_nope"), ("index", "hadamard_fp4")):
        c = compressor(cfg, kind, 128)
        want = PORTABLE.norm_rope_quant(pooled, starts, c.rope, norm="weighted",
                                        weight=c.norm.weight, eps=c.norm.eps, quant=quant,
                                        nope_dim=c.nope_dim)
        assert c.quant == quant and torch.equal(c.finalize(pooled, starts), want)
    with pytest.raises(ValueError, match=r"kind='kvx'; allowed: \['kv', 'index'\]"):
        Compressor.row_quant(cfg, "kvx")


# ---- the rows the engine caches ----------------------------------------------------------------

def cached_state(model_dir, n_tokens: int = 40):
    from deepinfer_core.runner.model_runner import ModelRunner
    runner = ModelRunner(model_dir, dtype="float32", simulate_qat=True, device="cpu")
    st = runner.new_sequence()
    ids = torch.randint(2, 129280, (n_tokens,), generator=torch.Generator().manual_seed(9)).tolist()
    runner.forward_batch([ids], [st])
    return runner.model_config, st


def source_rows(cfg: ModelConfig, st) -> list[torch.Tensor]:
    """The rows of every compressing KV source that has closed a block (not a sharer's alias)."""
    rows = [st.layers[i].compressor.read_rows() for i in range(cfg.num_hidden_layers)
            if cfg.kv_source(i) == i and cfg.compress_ratios[i]]
    rows = [r for r in rows if r.shape[0]]
    assert rows and all(r.count_nonzero() > r.numel() // 2 for r in rows)
    return rows


def window_rows(st, layer: int, n: int) -> torch.Tensor:
    ring = st.layers[layer].ring
    return ring[torch.arange(max(0, n - ring.shape[0]), n) % ring.shape[0]]


def test_tiny_v41_caches_fp4_rows(tiny_v41_dir):
    cfg, st = cached_state(tiny_v41_dir)
    assert cfg.use_fp4_sparse_kv
    for rows in source_rows(cfg, st):
        assert fp4_e4m3_ok(rows, 16).all()
        assert not e4m3_pow2_ok(rows, 32).all()
    keys = [st.layers[i].indexer.read_rows() for i in range(cfg.num_hidden_layers)
            if cfg.kv_source(i) == i and cfg.index_source(i) == i]
    assert keys and all(k.shape[0] for k in keys)
    assert all(e2m1_pow2_ok(k, 32).all() for k in keys)               # index keys: UE8M0 per 32
    ring = window_rows(st, 0, 40)                                      # the window keeps V4's FP8
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    assert e4m3_pow2_ok(ring[:, :nope], 64).all() and not fp4_e4m3_ok(ring, 16).all()


def test_tiny_v41_without_fp4_caches_mxfp8_rows(tmp_path):
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(tmp_path, {"use_fp4_sparse_kv": False}, seed=0, family="v41")
    cfg, st = cached_state(d)
    assert cfg.family == "v41" and not cfg.use_fp4_sparse_kv
    for rows in source_rows(cfg, st):
        assert e4m3_pow2_ok(rows, 32).all()                            # all channels, RoPE too
        assert not fp4_e4m3_ok(rows, 16).all()


def test_tiny_v4_keeps_fp8_nope_rows(tiny_ckpt_dir):
    cfg, st = cached_state(tiny_ckpt_dir)
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    for rows in source_rows(cfg, st):
        assert e4m3_pow2_ok(rows[:, :nope], 64).all()
        assert not e4m3_pow2_ok(rows[:, nope:], 32).all()               # RoPE channels unrounded
        assert not fp4_e4m3_ok(rows, 16).all()


def test_fp8_kv_cache_is_refused_for_v41():
    """V4's packed FP8 rows would round V4.1's FP4 rows a second time: the option is refused,
    naming it and the values a V4.1 model allows."""
    from deepinfer_core.runner.options import resolve_kv_fp8
    assert resolve_kv_fp8("fp8", torch.bfloat16, True, "v4") is True
    assert resolve_kv_fp8("auto", torch.bfloat16, True, "v41") is False
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*'auto' or 'bfloat16'"):
        resolve_kv_fp8("fp8", torch.bfloat16, True, "v41")
