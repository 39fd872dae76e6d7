"""Random DeepSeek-V4.1 checkpoints in the official tensor format, for the reference's tests.

`tiny_config()` restates the values of the project's tiny V4.1 config (engine code is not
imported here) with a reduced vocabulary; `make_random_tensors()` draws every tensor the
topology needs (FP8 with E8M0 32x32 scales, packed FP4 experts, bf16 / fp32 tensors);
`make_tokenizer_json()` builds a small byte-level tokenizer whose pieces collide under the Engram
normalisation; `save_checkpoint()` writes a checkpoint directory (two safetensors shards).
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .engram_ref import engram_primes

SEQ_LEN = 48   # tests: 48 C1 entries = 12 blocks of 4 > 8 kept, and index_topk 8 binds too
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
# Pieces that meet under NFKC/NFD/mark stripping/lowercasing/whitespace rules, and some that don't.
WORDS = ["Hello", "hello", " Hello", "HELLO", "café", "cafe", "Café", "\n", "  \t", "\r\n ",
         "ﬁne", "fine", "ΟΔΟΣ", "οδοσ", "naïve", "naive", "Å", "a", "x\u0301", "क्ष", "\u3000"]

_TEXT = {
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 8, "num_nextn_predict_layers": 0,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1], "kv_source_layer_ids": [2, 4, 5],
    "index_source_layer_ids": [2, 4, 5, 7], "index_k_source_layer_ids": [2, 4, 5],
    "candidate_source_layer_id": 5, "candidate_topk_blocks": 8, "candidate_block_size": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64,
    "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "sliding_window": 16,
    "index_n_heads": 8, "index_head_dim": 128, "index_topk": 8, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "hc_shifted": True, "rms_norm_eps": 1e-20,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 128, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hidden_act": "silu", "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 16384, "tie_word_embeddings": False,
    "engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_vocab_size": [1000, 1200],
    "engram_n_heads": 2, "engram_head_dim": 32, "engram_compressed_vocab_size": 0,
    "engram_pad_token_id": 2, "bos_token_id": 0, "eos_token_id": 1,
}


def tiny_config(**text_overrides) -> dict:
    """HF-format config (text keys under `text_config`) of the tiny V4.1 topology."""
    text = copy.deepcopy(_TEXT)
    text.update(copy.deepcopy(text_overrides))
    quant = {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
             "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "dtype": "bfloat16", "pad_token_id": 2, "quantization_config": quant,
            "text_config": text}


# ---- tokenizer ----------------------------------------------------------------------------------

def _byte_chars() -> dict[int, str]:
    """Byte -> printable char of the usual byte-level BPE alphabet."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def make_tokenizer_json(vocab_size: int = 512) -> str:
    """Byte-level WordLevel tokenizer: 3 specials, the 256 single bytes (bytes >= 0x80 decode
    to U+FFFD alone), `WORDS`, then fillers `w<i>` up to `vocab_size`."""
    chars = _byte_chars()
    pieces = list(SPECIALS) + [chars[b] for b in range(256)]
    for word in WORDS:
        piece = "".join(chars[b] for b in word.encode("utf-8"))
        if piece not in pieces:
            pieces.append(piece)
    pieces += [f"w{i}" for i in range(vocab_size - len(pieces))]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok.to_str()


# ---- tensors ------------------------------------------------------------------------------------

def _pow2_scales(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """E8M0 exponents (unbiased) `ceil(log2(amax / qmax))`."""
    return torch.ceil(torch.log2(amax.clamp(min=1e-30) / qmax)).clamp(-127, 127)


def random_fp8(gen: torch.Generator, rows: int, cols: int, std: float,
               block: tuple[int, int] = (32, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian weights quantised to E4M3 with one E8M0 scale per `block` tile."""
    w = torch.randn(rows, cols, generator=gen) * std
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = F.pad(w.abs(), (0, nc * bc - cols, 0, nr * br - rows))
    exp = _pow2_scales(padded.view(nr, br, nc, bc).amax((1, 3)), 448.0)
    s = torch.exp2(exp).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    q = (w / s).to(torch.float8_e4m3fn)
    return q, (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def random_fp4(gen: torch.Generator, rows: int, cols: int,
               std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes packed two per int8 byte (low nibble first), E8M0 scales per 32."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    base = round(math.log2(std / 2.5))
    exp = base + torch.randint(-1, 2, (rows, cols // 32), generator=gen)
    return packed, (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def make_random_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every text-model tensor of `config`'s topology, official names and dtypes."""
    c = config.get("text_config", config)
    gen = torch.Generator().manual_seed(seed)
    d, m, heads, dh = c["hidden_size"], c["hc_mult"], c["num_attention_heads"], c["head_dim"]
    qlr, g, olr = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    hi, di, inter = c["index_n_heads"], c["index_head_dim"], c["moe_intermediate_size"]
    n_exp = c["n_routed_experts"]
    out: dict[str, torch.Tensor] = {}

    def normal(shape, std, mean=0.0, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=gen) * std + mean).to(dtype)

    def fp8(name, rows, cols, block=(32, 32)):
        out[name + ".weight"], out[name + ".scale"] = random_fp8(gen, rows, cols, cols ** -0.5,
                                                                 block)

    out["embed.weight"] = normal((c["vocab_size"], d), 1.0)
    out["head.weight"] = normal((c["vocab_size"], d), d ** -0.5)
    out["norm.weight"] = normal(d, 0.1, 1.0)
    kv_src = c["kv_source_layer_ids"]
    engram = c.get("engram_layer_ids") or []
    primes = engram_primes(engram, c.get("engram_max_ngram_size", 0), c.get("engram_n_heads", 0),
                           c.get("engram_vocab_size", 0))
    for layer in range(c["num_hidden_layers"]):
        p = f"layers.{layer}."
        ratio = c["compress_ratios"][layer]
        for site in ("attn", "ffn"):
            out[p + f"{site}_norm.weight"] = normal(d, 0.1, 1.0)
            out[p + f"hc_{site}_fn"] = normal(((2 + m) * m, m * d), 0.02, dtype=torch.float32)
            out[p + f"hc_{site}_base"] = normal((2 + m) * m, 0.5, dtype=torch.float32)
            out[p + f"hc_{site}_scale"] = normal(3, 0.2, 1.0, dtype=torch.float32)
        a = p + "attn."
        fp8(a + "wq_a", qlr, d)
        out[a + "q_norm.weight"] = normal(qlr, 0.1, 1.0)
        fp8(a + "wq_b", heads * dh, qlr)
        fp8(a + "wkv", dh, d)
        out[a + "kv_norm.weight"] = normal(dh, 0.1, 1.0)
        fp8(a + "wo_a", g * olr, heads // g * dh)
        fp8(a + "wo_b", d, g * olr)
        out[a + "attn_sink"] = normal(heads, 1.0, dtype=torch.float32)
        if layer in kv_src:
            out[a + "compressor.wkv.weight"] = normal((dh, d), d ** -0.5)
            if ratio > 1:
                out[a + "compressor.wgate.weight"] = normal((dh, d), d ** -0.5)
            out[a + "compressor.norm.weight"] = normal(dh, 0.1, 1.0)
        if layer in c["index_source_layer_ids"]:
            fp8(a + "indexer.wq_b", hi * di, qlr)
            out[a + "indexer.weights_proj.weight"] = normal((hi, d), d ** -0.5)
        if layer in c.get("index_k_source_layer_ids", kv_src):
            out[a + "indexer.wk.weight"] = normal((di, dh), dh ** -0.5)
            out[a + "indexer.k_norm.weight"] = normal(di, 0.1, 1.0)
        f = p + "ffn."
        out[f + "gate.weight"] = normal((n_exp, d), d ** -0.5)
        out[f + "gate.bias"] = normal(n_exp, 0.1, dtype=torch.float32)
        out[f + "gate.bias_vl"] = normal(n_exp, 5.0, dtype=torch.float32)   # must be ignored
        width = inter * c.get("n_shared_experts", 1)
        fp8(f + "shared_experts.w1", width, d)
        fp8(f + "shared_experts.w3", width, d)
        fp8(f + "shared_experts.w2", d, width)
        for e in range(n_exp):
            for name, rows, cols in (("w1", inter, d), ("w3", inter, d), ("w2", d, inter)):
                key = f + f"experts.{e}.{name}"
                out[key + ".weight"], out[key + ".scale"] = random_fp4(gen, rows, cols,
                                                                       cols ** -0.5)
        if layer in engram:
            e_in = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"] * c["engram_head_dim"]
            out[p + "engram.embed.weight"], out[p + "engram.embed.scale"] = random_fp8(
                gen, sum(primes[layer]), c["engram_head_dim"], 1.0, block=(1, 32))
            fp8(p + "engram.wkv", (m + 1) * d, e_in)
            out[p + "engram.q_weight"] = normal((m, d), 0.1, 1.0)
            out[p + "engram.k_weight"] = normal((m, d), 0.1, 1.0)
    return out


def save_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor],
                    tokenizer_json: str | None) -> Path:
    """Write `config.json`, two safetensors shards and `tokenizer.json` under `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: tensors[k].contiguous() for k in part},
                  str(path / f"model-{i + 1:05d}-of-00002.safetensors"))
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(tokenizer_json)
    return path
