"""An HF-format config.json for a tiny DeepSeek-V4 with the real vocabulary and real numerics.

Dimensions are small but keep the real structure: every FP8 matrix dim is a multiple of the 128x128
block grid, every FP4 expert input dim a multiple of 32, head_dim - rope = 64 (FP8 KV blocks of 64),
all three layer kinds (window-only, CSA ratio 4, HCA ratio 128), hash layers, and one MTP block.
YaRN's original_max_position_embeddings is shrunk so the frequency ramp (low = 4, high = 14 of 32
pairs) changes rotations already at prompt lengths of a few hundred tokens.
"""
from __future__ import annotations

import copy
from typing import Any

_BASE: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "vocab_size": 129280,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0, 0],   # last entry = the MTP block
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "sliding_window": 16,
    # 16 index heads: with few heads, sum_h w_h*relu(q_h.k) is exactly 0 for many blocks
    # (all ReLUs zero) and top-k then hinges on tie-breaking; the real model has 64 heads.
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "rms_norm_eps": 1e-06,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 16384,           # factor x original, as in the real config
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "expert_dtype": "fp4",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
}

GENERATION_CONFIG: dict[str, Any] = {
    "_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
    "temperature": 1.0, "top_p": 1.0, "transformers_version": "4.46.3",
}


def tiny_compress_ratios(num_layers: int, num_mtp: int = 1) -> list[int]:
    """Real-like schedule: two window-only layers, then CSA/HCA alternating, last main layer
    window-only (for >= 4 layers), then one 0 per MTP block."""
    ratios = [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(num_layers)]
    if num_layers >= 4:
        ratios[-1] = 0
    return ratios + [0] * num_mtp


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """The tiny config; `overrides` replace top-level keys. Changing num_hidden_layers or
    num_nextn_predict_layers without compress_ratios derives a matching schedule, and
    num_hash_layers is capped at the layer count."""
    cfg = copy.deepcopy(_BASE)
    cfg.update(copy.deepcopy(overrides))
    if "compress_ratios" not in overrides and ("num_hidden_layers" in overrides
                                               or "num_nextn_predict_layers" in overrides):
        cfg["compress_ratios"] = tiny_compress_ratios(cfg["num_hidden_layers"],
                                                      cfg["num_nextn_predict_layers"])
    if "num_hash_layers" not in overrides:
        cfg["num_hash_layers"] = min(cfg["num_hash_layers"], cfg["num_hidden_layers"])
    return cfg
