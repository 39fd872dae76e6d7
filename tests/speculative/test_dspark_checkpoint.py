"""DSpark checkpoints, loading: a tiny checkpoint in the official format with
the V4-Flash-0731 DSpark tensor names (mtp.{0,1,2} window-only stages, mtp.0.main_proj FP8 + scale,
mtp.0.main_norm, mtp.2.markov_head.markov_w1/_w2, mtp.2.confidence_head.proj) loads name by name; DS-
DeepInfer's V4.1 spellings load into the same buffers; damaged ones and bad dspark_* keys name the
tensor or the field. Drafting with it: tests/speculative/test_dspark_drafting.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.model import build_model
from deepinfer_core.model.weights import (
    CheckpointError,
    check_checkpoint,
    load_checkpoint,
)
from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
from deepinfer_core.tools.tiny_config import tiny_config_dict

DSPARK = dict(num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=128799,
              dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=16, dspark_n_routed_experts=4,
              dspark_num_experts_per_tok=2, dspark_target_attn_input=True)
V41 = {"mtp.2.markov_head.markov_w1": "mtp.2.markov_head.embed.weight",
       "mtp.2.markov_head.markov_w2": "mtp.2.markov_head.head.weight",
       "mtp.2.confidence_head.proj": "mtp.2.confidence_head.proj.weight"}


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dspark"), DSPARK, seed=3)


def stored(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(f).items()}


def rewrite(src: Path, dst: Path, rename: dict[str, str | None]) -> Path:
    """A copy of the checkpoint with tensors renamed (None: dropped), index included."""
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors = {}
        for k, v in load_file(f).items():
            new = rename.get(k, k)
            if new is not None:
                tensors[new] = v
                weight_map[new] = f.name
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    index["weight_map"] = weight_map
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_the_0731_names_load_into_the_stages(dspark_dir):
    cfg = ModelConfig.from_file(dspark_dir)
    assert cfg.dspark is not None and cfg.dspark.target_layer_ids == (5, 6, 7) and cfg.dspark.n_routed_experts == 4
    model = build_model(cfg, device="meta")
    names = set(model.state_dict())
    assert {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
            "mtp.2.markov_head.markov_w1", "mtp.2.markov_head.markov_w2", "mtp.2.confidence_head.proj"} <= names
    assert not any(n.endswith(("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")) for n in names)
    assert not any(".compressor." in n or ".indexer." in n for n in names if n.startswith("mtp."))
    assert model.mtp[0].ffn.gate.weight.shape[0] == 4                   # the stages' own expert count
    assert model.mtp[0].main_proj.weight.dtype == torch.float8_e4m3fn
    assert model.mtp[2].confidence_head.proj.shape == (1, cfg.hidden_size + 16)
    assert check_checkpoint(model, dspark_dir) == []
    model = build_model(cfg, device="cpu")
    report = load_checkpoint(model, dspark_dir)
    assert not report.mtp_dropped and report.tensors_loaded == len(stored(dspark_dir))
    want = stored(dspark_dir)["mtp.2.markov_head.markov_w1"]
    assert torch.equal(model.mtp[2].markov_head.markov_w1, want)


def test_the_v41_spellings_load_into_the_same_buffers(dspark_dir, tmp_path):
    v41 = rewrite(dspark_dir, tmp_path / "v41", V41)
    model = build_model(ModelConfig.from_file(v41), device="cpu")
    load_checkpoint(model, v41)
    want = stored(dspark_dir)
    assert torch.equal(model.mtp[2].markov_head.markov_w2, want["mtp.2.markov_head.markov_w2"])
    assert torch.equal(model.mtp[2].confidence_head.proj, want["mtp.2.confidence_head.proj"])


def test_damaged_dspark_checkpoints_name_the_tensor(dspark_dir, tmp_path):
    cfg = ModelConfig.from_file(dspark_dir)
    missing = rewrite(dspark_dir, tmp_path / "missing", {"mtp.0.main_proj.weight": None})
    problems = check_checkpoint(build_model(cfg, device="meta"), missing)
    assert problems == ["mtp.0.main_proj.weight: missing (expected [256, 768] float8_e4m3fn)"]
    both = rewrite(dspark_dir, tmp_path / "both", {})
    extra = load_file(str(next(both.glob("*.safetensors"))))
    extra["mtp.2.markov_head.embed.weight"] = stored(dspark_dir)["mtp.2.markov_head.markov_w1"]
    first = next(both.glob("*.safetensors"))
    save_file(extra, str(first), metadata={"format": "pt"})
    index = json.loads((both / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.2.markov_head.embed.weight"] = first.name
    (both / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="mtp.2.markov_head.embed.weight: stored beside "
                                              "mtp.2.markov_head.markov_w1"):
        load_checkpoint(build_model(cfg, device="cpu"), both)


@pytest.mark.parametrize("change, message", [
    (dict(dspark_target_layer_ids=[5, 8]), r"dspark_target_layer_ids=\[5, 8\]; allowed: .* 0..7"),
    (dict(dspark_target_attn_input=False), "dspark_target_attn_input=false is not supported"),
    (dict(dspark_num_experts_per_tok=5), r"dspark_num_experts_per_tok=5; allowed: 1..4"),
    (dict(dspark_confidence_temperatures=[1.0, 0]), r"dspark_confidence_temperatures=\[1.0, 0\]; allowed: .* > 0"),
    (dict(dspark_confidence_temperatures=0.5), r"dspark_confidence_temperatures=0.5; allowed: a non-empty list"),
])
def test_bad_dspark_config_names_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(tiny_config_dict(**{**DSPARK, **change}))
