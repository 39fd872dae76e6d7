"""Dummy weights (load_format="dummy"): every checkpoint-format buffer written with seeded values of a
trained model's magnitude, in the on-disk formats, so the real bind_ops/process_weights path runs and a
forward gives finite, O(1) logits -- on the tiny config (with its MTP block and hash layers); at V4-Flash
width (one layer, fewer experts, a small vocabulary: the CPU test budget) the buffers and magnitudes.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from deepinfer_core.cache.state_cache import new_sequence_state
from deepinfer_core.config import ModelConfig
from deepinfer_core.config_fields import normalize_dtype
from deepinfer_core.contracts import resolve_model_ops
from deepinfer_core.model import ForwardBatch, bind_ops, build_model, process_weights
from deepinfer_core.model.attention import Numerics
from deepinfer_core.model.dummy_weights import fill_dummy_weights
from deepinfer_core.ops.quant import dequant_fp4, dequant_fp8_block
from deepinfer_core.plugin_context import BuildContext
from deepinfer_core.plugins import get_plugin_manager
from deepinfer_core.tools.tiny_config import tiny_config_dict

FP8, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
SENTINEL = 0xFF      # NaN in bf16/fp32/e4m3/e8m0, -1 in int64: any byte left unwritten shows


def tiny(**kw) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict(vocab_size=2048, **kw))


@pytest.fixture(scope="module")
def flash(v4_flash_config) -> ModelConfig:
    """V4-Flash's widths (hidden 4096, 64 heads of 512, 64 index heads, FP4 experts of 2048) in one
    hash-routed CSA layer; the fewest experts top-6 allows, a 4096 vocabulary and no MTP block (its
    buffer kinds are the tiny config's) keep the CPU time down."""
    d = copy.deepcopy(v4_flash_config)
    d.update(num_hidden_layers=1, num_nextn_predict_layers=0, compress_ratios=[4], n_routed_experts=6,
             vocab_size=4096)
    return ModelConfig.from_dict(d)


def filled(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The model on the CPU, every byte set to the sentinel, then filled."""
    model = build_model(cfg, device="cpu")
    for t in model.state_dict().values():
        t.view(torch.uint8).fill_(SENTINEL)
    fill_dummy_weights(model, cfg, seed)
    return model


def check_written(model: nn.Module, cfg: ModelConfig) -> None:
    for name, t in model.state_dict().items():
        if t.dtype == torch.int64:
            assert 0 <= t.min() and t.max() < cfg.n_routed_experts, name
        elif t.dtype == torch.int8:                 # packed FP4: every byte is a valid pair of codes
            assert (t.view(torch.uint8) == SENTINEL).float().mean() < 0.02, name
        elif t.element_size() == 1:                 # e4m3 / e8m0: 0xFF is their NaN
            assert not (t.view(torch.uint8) == SENTINEL).any(), name
        else:
            assert not t.isnan().any(), name


def dequant_rows(sd: dict[str, torch.Tensor], stem: str, rows: int = 256) -> torch.Tensor:
    """The first `rows` output rows of a quantized linear, in float32 (a slice: full width is slow)."""
    w, s = sd[f"{stem}.weight"][:rows], sd[f"{stem}.scale"]
    if w.dtype == torch.int8:
        return dequant_fp4(w, s[:rows], 32, torch.float32)
    return dequant_fp8_block(w, s[: -(-rows // 128)], (128, 128), torch.float32)


def check_magnitudes(sd: dict[str, torch.Tensor]) -> None:
    """Quantized codes in range, power-of-two scales of a trained model's size, unit-variance linears."""
    for name, t in sd.items():
        if t.dtype == FP8:
            codes = t[:256].float()
            assert codes.abs().max() <= 448 and 50 < codes.std() < 80, name
        elif t.dtype == E8M0:
            assert 100 <= t.view(torch.uint8).min() and t.view(torch.uint8).max() <= 127, name
    stems = [n[:-6] for n, t in sd.items() if n.endswith(".scale")]
    assert any(".experts." in s for s in stems) and any(".shared_experts." in s for s in stems)
    for stem in stems:
        w = dequant_rows(sd, stem)
        assert 0.5 < w.std().item() * w.shape[1] ** 0.5 < 2.0, stem      # within the power-of-two rounding
    assert 0.9 < sd["embed.weight"].float().std() < 1.1
    assert 0.8 < sd["norm.weight"].float().mean() < 1.2


def load_like(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """The rest of load_model's sequence (float32, QAT simulation on) after fill_dummy_weights, which
    stands in for load_checkpoint."""
    pm = get_plugin_manager()
    ctx = BuildContext(model_config=cfg, platform=pm.detect_platform(), device="cpu",
                       dtype=normalize_dtype("float32"), simulate_qat=True)
    pm.configure(ctx)
    ops = resolve_model_ops(pm, ctx)
    bind_ops(model, ops, Numerics(dtype=ctx.torch_dtype, simulate_qat=ctx.simulate_qat))
    process_weights(model)
    return model.eval()


@torch.no_grad()
def run(model: nn.Module, cfg: ModelConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(main, MTP) logits of every position of an n-token prompt."""
    ids = torch.randint(2, cfg.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(5)).tolist()
    state = new_sequence_state(cfg, model.numerics.dtype, max_tokens=256)
    batch = ForwardBatch.build([ids[:n]], [state], all_logits=True)
    out = model(batch)
    return out.logits, model.forward_mtp(out.streams, torch.tensor(ids[1:]), batch)


def check_logits(logits: torch.Tensor, n: int, vocab: int) -> None:
    assert logits.shape == (n, vocab) and torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 10.0                 # O(1), as a trained model's
    assert len(set(logits.argmax(-1).tolist())) > 1         # tokens are told apart


# ---- the tiny config ---------------------------------------------------------------------------

def test_every_buffer_written_including_mtp_and_hash_tables():
    cfg = tiny()
    model = filled(cfg)
    sd = model.state_dict()
    assert any(n.startswith("mtp.0.") for n in sd) and "layers.0.ffn.gate.tid2eid" in sd
    check_written(model, cfg)
    tid = sd["layers.0.ffn.gate.tid2eid"]
    assert all(len(set(row)) == len(row) for row in tid.tolist())           # k distinct experts per id
    assert len(set(tid[:, 0].tolist())) == cfg.n_routed_experts              # every expert used


def test_magnitudes_of_a_trained_model():
    check_magnitudes(filled(tiny(num_hidden_layers=3)).state_dict())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_seeded_and_independent_of_other_tensors():
    a, b, c = (filled(tiny(num_hidden_layers=2), seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(bits(a[n]), bits(b[n])) for n in a)
    # scales are one power of two per tensor, set by its shape; every drawn tensor differs
    assert all(not torch.equal(bits(a[n]), bits(c[n])) for n in a if a[n].numel() > 8 and a[n].dtype != E8M0)
    # a tensor's values come from (seed, name) alone: a deeper model shares layer 0
    deeper = filled(tiny(num_hidden_layers=3), seed=1).state_dict()
    assert all(torch.equal(bits(a[n]), bits(deeper[n])) for n in a if n.startswith("layers.0."))


def test_buffers_without_a_rule_or_storage_are_refused():
    cfg = tiny(num_hidden_layers=1)
    model = build_model(cfg, device="cpu")
    model.layers[0].register_buffer("mystery", torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"no value rule for layers\.0\.mystery"):
        fill_dummy_weights(model, cfg)
    model = build_model(cfg, device="cpu")
    model.layers[0].attn.wq_a.scale = None                                  # FP8 weight without its scale
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight .* no UE8M0"):
        fill_dummy_weights(model, cfg)
    with pytest.raises(ValueError, match="meta device"):
        fill_dummy_weights(build_model(cfg, device="meta"), cfg)


def test_loaded_like_model_runs_with_finite_logits_of_sane_scale():
    cfg = tiny(num_hidden_layers=4)
    main, mtp = run(load_like(filled(cfg), cfg), cfg, 24)
    check_logits(main, 24, cfg.vocab_size)
    check_logits(mtp, 24, cfg.vocab_size)


# ---- V4-Flash width ----------------------------------------------------------------------------

def test_flash_width_shapes_and_magnitudes(flash):
    """(A forward at this width costs ~15 s of CPU in process_weights; per-linear unit variance, checked
    here, is what keeps its logits O(1): std 1.0 when measured.)"""
    meta = {n: (t.shape, t.dtype) for n, t in build_model(flash, device="meta").state_dict().items()}
    model = filled(flash)
    sd = model.state_dict()
    assert {n: (t.shape, t.dtype) for n, t in sd.items()} == meta              # filled in place
    assert sd["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert sd["layers.0.attn.wq_b.weight"].dtype == FP8
    check_written(model, flash)
    check_magnitudes({n: t for n, t in sd.items() if ".experts." not in n or ".experts.0." in n})
