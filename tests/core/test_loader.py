"""Checkpoint loader tests on small synthetic modules and checkpoints (independent of the model
graph). Variants of the tiny checkpoint that users may have: test_checkpoint_variants.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from deepinfer_core.model.weights import (
    CheckpointError, LoadReport, check_checkpoint, load_checkpoint, resolve_model_path,
)
from deepinfer_core.ops.quant import dequant_fp4, dequant_fp8_block, quantize_fp4, quantize_fp8_block

FP8, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


class QLinear(nn.Module):
    def __init__(self, out_f: int, in_f: int, fmt: str, device: str):
        super().__init__()
        if fmt == "fp8":
            self.register_buffer("weight", torch.empty(out_f, in_f, dtype=FP8, device=device))
            self.register_buffer("scale", torch.empty(-(-out_f // 128), -(-in_f // 128), dtype=E8M0, device=device))
        else:
            self.register_buffer("weight", torch.empty(out_f, in_f // 2, dtype=torch.int8, device=device))
            self.register_buffer("scale", torch.empty(out_f, in_f // 32, dtype=E8M0, device=device))


class Tiny(nn.Module):
    """Names, dtypes and shapes in the style of the official checkpoint."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.embed = nn.Module()
        self.embed.register_buffer("weight", torch.empty(16, 128, dtype=torch.bfloat16, device=device))
        self.register_buffer("hc_head_base", torch.empty(4, dtype=torch.float32, device=device))
        self.attn = nn.Module()
        self.attn.wq_a = QLinear(256, 128, "fp8", device)
        self.ffn = nn.Module()
        self.ffn.gate = nn.Module()
        self.ffn.gate.register_buffer("tid2eid", torch.empty(16, 2, dtype=torch.int64, device=device))
        self.ffn.experts = nn.ModuleList([nn.Module()])
        self.ffn.experts[0].w1 = QLinear(64, 128, "fp4", device)


def reference_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w8, s8 = quantize_fp8_block(torch.randn(256, 128, generator=g) * 0.1)
    w4, s4 = quantize_fp4(torch.randn(64, 128, generator=g) * 0.1)
    return {
        "embed.weight": torch.randn(16, 128, generator=g).bfloat16(),
        "hc_head_base": torch.randn(4, generator=g),
        "attn.wq_a.weight": w8, "attn.wq_a.scale": s8,
        "ffn.gate.tid2eid": torch.randint(0, 8, (16, 2), generator=g),
        "ffn.experts.0.w1.weight": w4, "ffn.experts.0.w1.scale": s4,
    }


def write_ckpt(d: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 0:   # a single model.safetensors without index
        save_file(tensors, str(d / "model.safetensors"))
        return d
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def problems_of(model: nn.Module, path: Path) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(model, path)
    return str(ei.value)


# ---- good checkpoints --------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [0, 1, 3])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_load_exact_values(tmp_path, shards, device):
    ref = reference_tensors()
    path = write_ckpt(tmp_path / "ck", ref, shards)
    m = Tiny(device)
    rep = load_checkpoint(m, path)
    assert isinstance(rep, LoadReport) and rep.tensors_loaded == len(ref)
    assert len(rep.shards_read) == max(shards, 1) and rep.ignored == [] and rep.substituted == []
    sd = m.state_dict()
    for n, t in ref.items():
        assert sd[n].dtype == t.dtype and not sd[n].is_meta
        assert torch.equal(sd[n].view(torch.uint8) if t.element_size() == 1 else sd[n],
                           t.view(torch.uint8) if t.element_size() == 1 else t), n
    # Exact dequantisation of what was loaded: bf16 lossless.
    w8 = dequant_fp8_block(m.attn.wq_a.weight, m.attn.wq_a.scale, dtype=torch.float32)
    assert torch.equal(w8, dequant_fp8_block(ref["attn.wq_a.weight"], ref["attn.wq_a.scale"], dtype=torch.float32))
    assert torch.equal(w8.bfloat16().float(), w8)
    w4 = dequant_fp4(m.ffn.experts[0].w1.weight, m.ffn.experts[0].w1.scale, dtype=torch.float32)
    assert w4.shape == (64, 128) and torch.equal(w4.bfloat16().float(), w4)
    assert check_checkpoint(Tiny(), path) == []


def test_loaded_buffers_are_private_copies(tmp_path):
    """safe_open tensors map the file; the model must not change when the file does."""
    ref = reference_tensors()
    path = write_ckpt(tmp_path / "ck", ref, 0)
    m = Tiny()
    load_checkpoint(m, path)
    before = m.hc_head_base.clone()
    (path / "model.safetensors").write_bytes(b"\0" * (path / "model.safetensors").stat().st_size)
    assert torch.equal(m.hc_head_base, before)


def test_fp4_tagged_u8_is_accepted(tmp_path):
    ref = reference_tensors()
    ref["ffn.experts.0.w1.weight"] = ref["ffn.experts.0.w1.weight"].view(torch.uint8)
    m = Tiny()
    load_checkpoint(m, write_ckpt(tmp_path / "ck", ref))
    w = m.ffn.experts[0].w1.weight
    assert w.dtype == torch.int8 and torch.equal(w.view(torch.uint8), ref["ffn.experts.0.w1.weight"])


def test_plain_bf16_substitution(tmp_path):
    ref = reference_tensors()
    w8 = dequant_fp8_block(ref.pop("attn.wq_a.weight"), ref.pop("attn.wq_a.scale"))
    w4 = dequant_fp4(ref.pop("ffn.experts.0.w1.weight"), ref.pop("ffn.experts.0.w1.scale"))
    ref["attn.wq_a.weight"], ref["ffn.experts.0.w1.weight"] = w8, w4.float()   # bf16 and f32
    m = Tiny()
    rep = load_checkpoint(m, write_ckpt(tmp_path / "ck", ref, 2))
    assert rep.substituted == ["attn.wq_a.weight", "ffn.experts.0.w1.weight"]
    assert m.attn.wq_a.scale is None and m.ffn.experts[0].w1.scale is None
    assert "attn.wq_a.scale" not in m.state_dict()
    assert torch.equal(m.attn.wq_a.weight, w8) and m.ffn.experts[0].w1.weight.dtype == torch.float32
    assert m.ffn.experts[0].w1.weight.shape == (64, 128)


def test_plain_weight_with_wrong_logical_shape_or_extra_scale(tmp_path):
    ref = reference_tensors()
    ref["ffn.experts.0.w1.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)   # packed shape, not logical
    del ref["ffn.experts.0.w1.scale"]
    ref["attn.wq_a.weight"] = torch.zeros(256, 128, dtype=torch.bfloat16)        # scale still present
    msg = problems_of(Tiny(), write_ckpt(tmp_path / "ck", ref))
    assert "ffn.experts.0.w1.weight: wrong shape for a plain float weight: expected [64, 128], got [64, 64]" in msg
    assert "attn.wq_a.weight: wrong dtype: expected float8_e4m3fn, got bfloat16" in msg


def test_mtp_copies_are_ignored(tmp_path):
    ref = reference_tensors()
    ref["mtp.0.emb.tok_emb.weight"] = torch.zeros(16, 128, dtype=torch.bfloat16)
    ref["mtp.0.head.weight"] = torch.zeros(16, 128, dtype=torch.bfloat16)
    rep = load_checkpoint(Tiny(), write_ckpt(tmp_path / "ck", ref))
    assert rep.ignored == ["mtp.0.emb.tok_emb.weight", "mtp.0.head.weight"]


# ---- strictness --------------------------------------------------------------------------------

def test_all_problems_reported_at_once(tmp_path):
    ref = reference_tensors()
    del ref["attn.wq_a.scale"]                                            # missing
    del ref["ffn.gate.tid2eid"]                                           # missing
    ref["layers.9.extra"] = torch.zeros(3)                                # unexpected
    ref["embed.weight"] = torch.zeros(17, 128, dtype=torch.bfloat16)      # wrong shape
    ref["hc_head_base"] = torch.zeros(4, dtype=torch.int32)               # wrong dtype
    m = Tiny()
    msg = problems_of(m, write_ckpt(tmp_path / "ck", ref, 2))
    assert "(5 problems)" in msg
    for line in ["attn.wq_a.scale: missing (expected [2, 1] float8_e8m0fnu)",
                 "ffn.gate.tid2eid: missing (expected [16, 2] int64)",
                 "layers.9.extra: unexpected tensor ([3] float32",
                 "embed.weight: wrong shape: expected [16, 128], got [17, 128]",
                 "hc_head_base: wrong dtype: expected float32, got int32"]:
        assert line in msg, msg
    lines = msg.splitlines()[1:]
    assert lines == sorted(lines)
    assert all(b.is_meta for b in m.buffers())   # nothing was loaded


def test_wrong_fp8_scale_dtype(tmp_path):
    ref = reference_tensors()
    ref["attn.wq_a.scale"] = ref["attn.wq_a.scale"].view(torch.uint8)
    assert "attn.wq_a.scale: wrong dtype: expected float8_e8m0fnu, got uint8" in \
        problems_of(Tiny(), write_ckpt(tmp_path / "ck", ref))


def test_bad_index_files(tmp_path):
    d = write_ckpt(tmp_path / "ck", reference_tensors())
    idx = d / "model.safetensors.index.json"
    idx.write_text("{not json")
    assert "model.safetensors.index.json is not valid JSON" in problems_of(Tiny(), d)
    idx.write_text(json.dumps({"metadata": {}}))
    assert "has no valid 'weight_map'" in problems_of(Tiny(), d)
    idx.write_text(json.dumps({"weight_map": {"embed.weight": "model-00009-of-00009.safetensors"}}))
    msg = problems_of(Tiny(), d)
    assert "model-00009-of-00009.safetensors" in msg and "do not exist" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "neither model.safetensors.index.json nor model.safetensors" in problems_of(Tiny(), empty)


def test_index_disagrees_with_shards(tmp_path):
    d = write_ckpt(tmp_path / "ck", reference_tensors(), 2)
    idx = d / "model.safetensors.index.json"
    wm = json.loads(idx.read_text())["weight_map"]
    wm["ghost.weight"] = wm["embed.weight"]
    idx.write_text(json.dumps({"weight_map": wm}))
    msg = problems_of(Tiny(), d)
    assert "ghost.weight: listed in the index under model-0000" in msg


def test_truncated_shard(tmp_path):
    d = write_ckpt(tmp_path / "ck", reference_tensors(), 2)
    shard = d / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    msg = problems_of(Tiny(), d)
    assert "model-00002-of-00002.safetensors" in msg and "cannot read shard" in msg
    shard.write_bytes(data[:5])   # not even a header length
    assert "cannot read shard" in problems_of(Tiny(), d)


# ---- float dtypes other than the model's -------------------------------------------------------

WEIGHTS_LOG = "deepinfer_core.model.weights"


def cast_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == WEIGHTS_LOG and "in another dtype than the model keeps" in r.getMessage()]


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16, torch.float32])
def test_other_float_dtypes_are_cast(tmp_path, caplog, compute_dtype):
    """f16 for a bf16 buffer, f64 for an f32 one: cast, one log line; a float32 run keeps what
    float32 holds instead of rounding it through bf16."""
    ref = reference_tensors()
    emb = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)).half()
    assert not torch.equal(emb.bfloat16().float(), emb.float())        # bf16 would round these
    ref["embed.weight"], ref["hc_head_base"] = emb, ref["hc_head_base"].double() / 3
    path = write_ckpt(tmp_path / "ck", ref, 2)
    assert check_checkpoint(Tiny(), path) == []                         # not a problem
    m = Tiny()
    with caplog.at_level(logging.INFO, logger=WEIGHTS_LOG):
        rep = load_checkpoint(m, path, compute_dtype=compute_dtype)
    assert rep.cast == ["embed.weight", "hc_head_base"] and rep.tensors_loaded == len(ref)
    if compute_dtype == torch.float32:
        assert m.embed.weight.dtype == torch.float32 and torch.equal(m.embed.weight, emb.float())
        label = "float16->float32 (float32 run, not bfloat16) x1"
    else:
        assert m.embed.weight.dtype == torch.bfloat16
        assert torch.equal(m.embed.weight, emb.bfloat16())
        label = "float16->bfloat16 x1"
    assert m.hc_head_base.dtype == torch.float32
    assert torch.equal(m.hc_head_base, ref["hc_head_base"].float())
    assert cast_lines(caplog) == [
        ("loading 2 float checkpoint tensors in another dtype than the model keeps, cast "
         f"{label}, float64->float32 x1: embed.weight, hc_head_base")]


def test_cast_log_names_a_few(tmp_path, caplog):
    ref = reference_tensors()
    ref["embed.weight"] = ref["embed.weight"].float()
    ref["hc_head_base"] = ref["hc_head_base"].bfloat16()
    ref["attn.wq_a.weight"] = torch.zeros(256, 128, dtype=torch.float16)     # substituted, not cast
    del ref["attn.wq_a.scale"]
    ref["extra"] = torch.zeros(3)
    m = Tiny()
    m.register_buffer("extra", torch.empty(3, dtype=torch.bfloat16, device="meta"))
    m.register_buffer("more", torch.empty(3, dtype=torch.bfloat16, device="meta"))
    ref["more"] = torch.ones(3)
    with caplog.at_level(logging.INFO, logger=WEIGHTS_LOG):
        rep = load_checkpoint(m, write_ckpt(tmp_path / "ck", ref), compute_dtype=torch.bfloat16)
    assert rep.cast == ["embed.weight", "extra", "hc_head_base", "more"]
    assert rep.substituted == ["attn.wq_a.weight"] and m.attn.wq_a.weight.dtype == torch.float16
    assert cast_lines(caplog) == [
        ("loading 4 float checkpoint tensors in another dtype than the model keeps, cast "
         "bfloat16->float32 x1, float32->bfloat16 x3: embed.weight, extra, hc_head_base, ...")]


@pytest.mark.parametrize("compute_dtype", [None, torch.float32])
def test_non_float_mismatches_stay_errors(tmp_path, compute_dtype):
    ref = reference_tensors()
    ref["attn.wq_a.weight"] = dequant_fp8_block(ref["attn.wq_a.weight"], ref["attn.wq_a.scale"])
    ref["ffn.experts.0.w1.scale"] = ref["ffn.experts.0.w1.scale"].float()   # e8m0 as f32
    ref["ffn.gate.tid2eid"] = ref["ffn.gate.tid2eid"].float()               # int as float
    ref["embed.weight"] = ref["embed.weight"].to(FP8)                       # fp8 for a bf16 buffer
    ref["hc_head_base"] = ref["hc_head_base"].to(torch.int32)
    path = write_ckpt(tmp_path / "ck", ref)
    m = Tiny()
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(m, path, compute_dtype=compute_dtype)
    msg = str(ei.value)
    assert "(5 problems)" in msg
    for line in [("attn.wq_a.weight: wrong dtype: expected float8_e4m3fn, got bfloat16 "
                  "(a plain float weight must come without attn.wq_a.scale)"),
                 "ffn.experts.0.w1.scale: wrong dtype: expected float8_e8m0fnu, got float32",
                 "ffn.gate.tid2eid: wrong dtype: expected int64, got float32",
                 "embed.weight: wrong dtype: expected bfloat16, got float8_e4m3fn",
                 "hc_head_base: wrong dtype: expected float32, got int32"]:
        assert line in msg, msg
    assert len(check_checkpoint(Tiny(), path)) == 5
    assert all(b.is_meta for b in m.buffers())


def test_resolve_local_dir_and_cache_layout(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve_model_path(str(d)) == d.resolve()
    # A Hugging Face cache: hub/models--org--name/{refs/main, snapshots/<rev>/config.json}
    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny-v4"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model_path(str(repo)) == snap.resolve()
    assert resolve_model_path(str(snap)) == snap.resolve()
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    assert resolve_model_path("acme/tiny-v4") == snap.resolve()
    with pytest.raises(CheckpointError) as ei:
        resolve_model_path("acme/not-there")
    assert "not found locally" in str(ei.value) and str(hub) in str(ei.value)
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope" / "x"))
