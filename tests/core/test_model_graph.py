"""The full DeepSeek-V4 graphs build on the meta device with exactly the checkpoint's tensor names,
dtypes and shapes, and the layer schedule comes from compress_ratios."""
from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.model import build_model

F8, E8, I8, BF, F32, I64 = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.bfloat16,
                            torch.float32, torch.int64)


@pytest.fixture(scope="module")
def flash(v4_flash_config):
    return build_model(ModelConfig.from_dict(v4_flash_config), device="meta").state_dict()


def test_flash_tensor_inventory(flash):
    assert len(flash) == 69187
    assert sum(1 for k in flash if k.startswith("mtp.0.")) == 1575
    assert sum(t.numel() * t.element_size() for t in flash.values()) == 159_609_485_896


@pytest.mark.parametrize("name,shape,dtype", [
    ("embed.weight", (129280, 4096), BF), ("head.weight", (129280, 4096), BF), ("norm.weight", (4096,), BF),
    ("hc_head_fn", (4, 16384), F32), ("hc_head_base", (4,), F32), ("hc_head_scale", (1,), F32),
    ("layers.0.hc_attn_fn", (24, 16384), F32), ("layers.0.hc_ffn_scale", (3,), F32),
    ("layers.0.attn.attn_sink", (64,), F32),
    ("layers.0.attn.wq_a.weight", (1024, 4096), F8), ("layers.0.attn.wq_a.scale", (8, 32), E8),
    ("layers.0.attn.wq_b.weight", (32768, 1024), F8), ("layers.0.attn.wq_b.scale", (256, 8), E8),
    ("layers.0.attn.wkv.weight", (512, 4096), F8), ("layers.0.attn.wkv.scale", (4, 32), E8),
    ("layers.0.attn.wo_a.weight", (8192, 4096), F8), ("layers.0.attn.wo_a.scale", (64, 32), E8),
    ("layers.0.attn.wo_b.weight", (4096, 8192), F8), ("layers.0.attn.wo_b.scale", (32, 64), E8),
    ("layers.0.attn.q_norm.weight", (1024,), BF), ("layers.0.attn.kv_norm.weight", (512,), BF),
    ("layers.2.attn.compressor.ape", (4, 1024), F32), ("layers.3.attn.compressor.ape", (128, 512), F32),
    ("layers.2.attn.compressor.wkv.weight", (1024, 4096), BF), ("layers.3.attn.compressor.wgate.weight", (512, 4096), BF),
    ("layers.2.attn.compressor.norm.weight", (512,), BF),
    ("layers.2.attn.indexer.wq_b.weight", (8192, 1024), F8), ("layers.2.attn.indexer.wq_b.scale", (64, 8), E8),
    ("layers.2.attn.indexer.weights_proj.weight", (64, 4096), BF),
    ("layers.2.attn.indexer.compressor.ape", (4, 256), F32),
    ("layers.2.attn.indexer.compressor.wkv.weight", (256, 4096), BF),
    ("layers.2.attn.indexer.compressor.norm.weight", (128,), BF),
    ("layers.0.ffn.gate.weight", (256, 4096), BF), ("layers.2.ffn.gate.tid2eid", (129280, 6), I64),
    ("layers.3.ffn.gate.bias", (256,), F32),
    ("layers.5.ffn.experts.255.w1.weight", (2048, 2048), I8), ("layers.5.ffn.experts.0.w1.scale", (2048, 128), E8),
    ("layers.5.ffn.experts.7.w2.weight", (4096, 1024), I8), ("layers.5.ffn.experts.7.w2.scale", (4096, 64), E8),
    ("layers.42.ffn.shared_experts.w1.weight", (2048, 4096), F8), ("layers.42.ffn.shared_experts.w1.scale", (16, 32), E8),
    ("layers.42.ffn.shared_experts.w2.weight", (4096, 2048), F8), ("layers.42.ffn.shared_experts.w2.scale", (32, 16), E8),
    ("mtp.0.e_proj.weight", (4096, 4096), F8), ("mtp.0.h_proj.scale", (32, 32), E8),
    ("mtp.0.enorm.weight", (4096,), BF), ("mtp.0.hnorm.weight", (4096,), BF), ("mtp.0.norm.weight", (4096,), BF),
    ("mtp.0.hc_head_fn", (4, 16384), F32), ("mtp.0.ffn.gate.bias", (256,), F32),
])
def test_flash_tensor_shapes(flash, name, shape, dtype):
    assert tuple(flash[name].shape) == shape and flash[name].dtype == dtype


def test_flash_layer_kinds(flash):
    csa = {int(k.split(".")[1]) for k in flash if k.startswith("layers.") and ".attn.indexer.wq_b.weight" in k}
    hca = {int(k.split(".")[1]) for k in flash if k.endswith(".attn.compressor.ape") and flash[k].shape[0] == 128}
    assert csa == {2} | set(range(4, 43, 2)) and hca == set(range(3, 42, 2))
    assert {int(k.split(".")[1]) for k in flash if k.endswith("gate.tid2eid")} == {0, 1, 2}
    assert not any(k.startswith("mtp.0.attn.compressor") for k in flash)
    assert "layers.0.attn.compressor.ape" not in flash and "layers.42.attn.indexer.wq_b.weight" in flash


def test_pro_config_builds_with_its_own_schedule(v4_flash_config):
    pro = dict(v4_flash_config, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
               o_groups=16, n_routed_experts=384, moe_intermediate_size=3072, index_topk=1024,
               routed_scaling_factor=2.5, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])
    sd = build_model(ModelConfig.from_dict(pro), device="meta").state_dict()
    assert tuple(sd["layers.0.attn.compressor.ape"].shape) == (128, 512)     # Pro starts with HCA layers
    assert tuple(sd["layers.60.attn.indexer.wq_b.weight"].shape) == (8192, 1536)
    assert tuple(sd["layers.0.attn.wo_a.weight"].shape) == (16 * 1024, 128 * 512 // 16)
    assert tuple(sd["layers.3.ffn.experts.383.w2.weight"].shape) == (7168, 1536)
    assert sum(1 for k in sd if k.endswith(".attn.indexer.wq_b.weight") and k.startswith("layers.")) == 30


@pytest.mark.parametrize("key,value,words", [
    ("compress_ratios", [0, 2, 4], "allowed: [0, 4, 128]"),
    ("model_type", "llama", "model_type"),
    ("scoring_func", "softmax", "scoring_func"),
    ("expert_dtype", "int3", "expert_dtype"),
])
def test_bad_config_values_are_named(v4_flash_config, key, value, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(dict(v4_flash_config, **{key: value}))


def test_missing_config_field_is_named(v4_flash_config):
    bad = {k: v for k, v in v4_flash_config.items() if k != "head_dim"}
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig.from_dict(bad)
