"""The tiny checkpoint: official file layout and dtypes, real tokenizer, loads cleanly, deterministic."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.weights import check_checkpoint, load_checkpoint
from deepinfer_core.ops.quant import dequant_fp4, dequant_fp8_block
from deepinfer_core.tools.make_tiny_checkpoint import (
    main, make_tiny_checkpoint, plan_shards, tensor_values, tid2eid_values,
)
from deepinfer_core.tools.tiny_config import tiny_compress_ratios, tiny_config_dict

# Official dtype of each tensor family, first match wins.
OFFICIAL_DTYPES = [
    (r"\.experts\.\d+\.w[123]\.weight$", "I8"),
    (r"\.scale$", "F8_E8M0"),
    (r"compressor\.(wkv|wgate)\.weight$", "BF16"),
    (r"\.(wq_a|wq_b|wkv|wo_a|wo_b|e_proj|h_proj)\.weight$", "F8_E4M3"),
    (r"shared_experts\.w[123]\.weight$", "F8_E4M3"),
    (r"(hc_\w+_(fn|base|scale)|attn_sink|\.ape|gate\.bias)$", "F32"),
    (r"tid2eid$", "I64"),
    (r"", "BF16"),
]


def headers(d: Path) -> dict[str, tuple[str, list[int], str]]:
    out = {}
    for shard in sorted(d.glob("model-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for n in f.keys():
                sl = f.get_slice(n)
                out[n] = (sl.get_dtype(), sl.get_shape(), shard.name)
    return out


def test_config_parses_and_schedule(v4_flash_config):
    cfg = ModelConfig.from_dict(tiny_config_dict())
    assert cfg.vocab_size == 129280 and cfg.bos_token_id == 0 and cfg.eos_token_id == 1
    assert cfg.compress_ratios == (0, 0, 4, 128, 4, 128, 4, 0, 0) and cfg.num_nextn_predict_layers == 1
    assert cfg.weight_block_size == (128, 128) and cfg.expert_dtype == "fp4"
    assert set(v4_flash_config) <= set(tiny_config_dict())      # every key of the real config is present
    c3 = tiny_config_dict(num_hidden_layers=2)
    assert c3["compress_ratios"] == [0, 0, 0] and c3["num_hash_layers"] == 2
    assert tiny_compress_ratios(6) == [0, 0, 4, 128, 4, 0, 0]
    ModelConfig.from_dict(c3)


def test_files_index_and_dtypes(tiny_ckpt_dir):
    d = tiny_ckpt_dir
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors.index.json"]:
        assert (d / f).is_file(), f
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    hdr = headers(d)
    assert index["weight_map"] == {n: h[2] for n, h in hdr.items()}     # maps every tensor, correctly
    sizes = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}
    total = sum(sizes[dt] * torch.Size(shape).numel() for dt, shape, _ in hdr.values())
    assert index["metadata"]["total_size"] == total
    for name, (dt, shape, _) in hdr.items():
        want = next(v for pat, v in OFFICIAL_DTYPES if re.search(pat, name))
        assert dt == want, (name, dt, want)
    assert hdr["layers.3.attn.wq_a.scale"][1] == [1, 2]                 # [128, 256] / 128x128 blocks
    assert hdr["layers.3.ffn.experts.5.w1.weight"][1] == [128, 128]     # logical [128, 256] packed
    assert hdr["layers.3.ffn.experts.5.w1.scale"][1] == [128, 8]
    assert "layers.0.ffn.gate.tid2eid" in hdr and "layers.3.ffn.gate.bias" in hdr
    assert "mtp.0.e_proj.weight" in hdr and "mtp.0.h_proj.scale" in hdr


def test_tokenizer_real_vocab(tiny_ckpt_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_ckpt_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 129280
    assert tok.id_to_token(0) == "<｜begin▁of▁sentence｜>" and tok.id_to_token(1) == "<｜end▁of▁sentence｜>"


def test_loads_into_model_with_zero_problems(tiny_ckpt_dir):
    from deepinfer_core.model import build_model
    cfg = ModelConfig.from_file(tiny_ckpt_dir)
    model = build_model(cfg, device="meta")
    assert check_checkpoint(model, tiny_ckpt_dir) == []
    rep = load_checkpoint(model, tiny_ckpt_dir)
    assert rep.tensors_loaded == len(model.state_dict()) and rep.substituted == [] and rep.ignored == []
    assert not any(b.is_meta for b in model.buffers())
    # Values have the intended structure.
    t = model.layers[0].ffn.gate.tid2eid
    assert t.shape == (129280, 2) and int(t.min()) >= 0 and int(t.max()) < 8 and bool((t[:, 0] != t[:, 1]).all())
    w = dequant_fp8_block(model.layers[2].attn.wq_a.weight, model.layers[2].attn.wq_a.scale, dtype=torch.float32)
    assert 0.5 < float(w.std() * 256 ** 0.5) < 1.5                          # N(0, 1/in)
    e = model.layers[3].ffn.experts[1].w2
    w = dequant_fp4(e.weight, e.scale, dtype=torch.float32)
    assert w.shape == (256, 128) and 0.5 < float(w.std() * 128 ** 0.5) < 1.5


def test_same_seed_is_byte_identical(tiny_ckpt_dir, tmp_path):
    again = make_tiny_checkpoint(tmp_path / "again", seed=0)
    files = sorted(p.name for p in tiny_ckpt_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for f in files:
        a = hashlib.sha256((tiny_ckpt_dir / f).read_bytes()).hexdigest()
        b = hashlib.sha256((again / f).read_bytes()).hexdigest()
        assert a == b, f


def test_seed_changes_values_and_spec_checks():
    cfg = tiny_config_dict()
    spec = {"x.weight": ((128, 64), torch.int8), "x.scale": ((128, 4), torch.float8_e8m0fnu),
            "y.weight": ((256, 128), torch.float8_e4m3fn), "y.scale": ((2, 1), torch.float8_e8m0fnu),
            "q_norm.weight": ((256,), torch.bfloat16)}
    a, b = tensor_values("x.weight", spec, cfg, 0), tensor_values("x.weight", spec, cfg, 1)
    assert set(a) == {"x.weight", "x.scale"} and not torch.equal(a["x.weight"], b["x.weight"])
    assert torch.equal(a["x.weight"], tensor_values("x.weight", spec, cfg, 0)["x.weight"])
    assert set(tensor_values("y.weight", spec, cfg, 0)) == {"y.weight", "y.scale"}
    n = tensor_values("q_norm.weight", spec, cfg, 0)["q_norm.weight"].float()
    assert abs(float(n.mean()) - 1.0) < 0.05                              # norms ~ 1 + 0.1 N
    bad = dict(spec, **{"y.scale": ((9, 9), torch.float8_e8m0fnu)})
    with pytest.raises(ValueError, match="y.scale"):
        tensor_values("y.weight", bad, cfg, 0)
    groups = plan_shards(spec, 40_000)   # x: 8704 B, y: 32770 B, q_norm: 512 B
    assert ["x.weight", "x.scale"] in groups and ["y.weight", "y.scale", "q_norm.weight"] in groups


def test_tid2eid_rows_distinct():
    t = tid2eid_values((1000, 6), 8, torch.Generator().manual_seed(0))
    assert t.dtype == torch.int64 and all(len(set(r)) == 6 for r in t.tolist())


def test_cli_small_model(tmp_path, capsys):
    main([str(tmp_path / "cli"), "--seed", "3", "--layers", "2", "--max-shard-mb", "1000"])
    cfg = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["compress_ratios"] == [0, 0, 0]
    assert "in 1 shards" in capsys.readouterr().out
