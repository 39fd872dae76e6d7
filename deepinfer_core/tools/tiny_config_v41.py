"""An HF-format config.json for a tiny DeepSeek-V4.1 (text keys nested under `text_config`).

Small dimensions, the real structure (spec `deepseek_v41.md`): two window-only layers, a C2 half
whose KV and index keys come from two source layers (one consumer shares both), the YOCO boundary
at the first C1 layer, which is also the two-level candidate source, a later C1 index source that
selects inside the candidate blocks, and Engram on two producer layers. Every FP8 matrix dim is a
multiple of the 32x32 weight blocks and every FP4 expert input dim a multiple of 32.
Candidate blocks of 4 entries, 8 kept: at a few hundred tokens both top-k levels bind.
"""

from __future__ import annotations

import copy
from typing import Any

_TEXT: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_nextn_predict_layers": 0,
    #                 SWA SWA  C2 C2 C2 | C1 C1 C1 C1   (| = the YOCO boundary, layer 5)
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1],
    "kv_source_layer_ids": [2, 4, 5],
    "index_source_layer_ids": [2, 4, 5, 7],
    "index_k_source_layer_ids": [2, 4, 5],
    "candidate_source_layer_id": 5,
    "candidate_topk_blocks": 8,
    "candidate_block_size": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "sliding_window": 16,
    "index_n_heads": 8,
    "index_head_dim": 128,
    "index_topk": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "hc_shifted": True,
    "rms_norm_eps": 1e-20,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
    "use_fp4_sparse_kv": True,
    "engram_layer_ids": [1, 3],
    "engram_max_ngram_size": 3,
    "engram_vocab_size": [1000, 1200],
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

_BASE: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 128815,
    "tokenizer_compatibility": "release",
    "quantization_config": {
        "quant_method": "fp8",
        "expert_dtype": "fp4",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
    },
    "vision_config": {"hidden_size": 1024, "downsample_ratio": 3, "patch_size": 14},
    "text_config": _TEXT,
}


# A DSpark drafter of two stages reading two producer layers (`--set` these, or drafter=True).
DRAFTER: dict[str, Any] = {
    "num_nextn_predict_layers": 2,
    "compress_ratios": _TEXT["compress_ratios"] + [0, 0],
    "dspark_block_size": 3,
    "dspark_target_layer_ids": [1, 3],
    "dspark_target_attn_input": True,
    "dspark_markov_rank": 32,
    "dspark_noise_token_id": 128799,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


def tiny_v41_config_dict(drafter: bool = False, **text_overrides: Any) -> dict[str, Any]:
    """The tiny V4.1 config; `drafter`: with the DSpark stages of `DRAFTER`; `text_overrides`
    replace keys of `text_config` (a value of None removes the key)."""
    cfg = copy.deepcopy(_BASE)
    for key, value in copy.deepcopy({**(DRAFTER if drafter else {}), **text_overrides}).items():
        if value is None:
            cfg["text_config"].pop(key, None)
        else:
            cfg["text_config"][key] = value
    return cfg
