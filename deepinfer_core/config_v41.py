"""What a DeepSeek-V4.1 `config.json` adds to the V4 graph: the top-level checks, the nested
`text_config`, cross-layer sharing (`LayerTopology`) and Engram (`EngramConfig`).

`v41_text_keys` turns a V4.1 config into the flat key set `ModelConfig.from_dict` reads for V4,
plus the V4.1 switches (spec `deepseek_v41.md` §2, §16). Every check raises a `ConfigError`
naming the key and what it allows. Kept free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config_error import ConfigError

V41_ARCHITECTURE = "DeepseekV41ForCausalLM"
V41_MODEL_TYPE = "deepseek_v41"
V41_RATIOS = (0, 1, 2)
V41_QUANTIZATION = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}
BF16_MAX = 3.3895313892515355e38


def is_v41(d: dict[str, Any]) -> bool:
    return d.get("model_type") == V41_MODEL_TYPE or V41_ARCHITECTURE in (
        d.get("architectures") or []
    )


def _need(d: dict[str, Any], key: str, where: str = "text_config") -> Any:
    if key not in d:
        raise ConfigError(f"config.json: required field {where}.{key} is missing")
    return d[key]


def _expect(d: dict[str, Any], key: str, allowed: Any, where: str = "text_config") -> None:
    if key in d and d[key] != allowed:
        raise ConfigError(
            f"config.json: {where}.{key}={d[key]!r}; allowed: {allowed!r} (DeepSeek-V4.1)"
        )


def v41_text_keys(d: dict[str, Any]) -> dict[str, Any]:
    """The flat keys of a V4.1 config: `text_config` plus the top-level keys the text path
    reads, after the top-level checks of spec §2.1."""
    arch = d.get("architectures") or [V41_ARCHITECTURE]
    if list(arch) != [V41_ARCHITECTURE]:
        raise ConfigError(f"config.json: architectures={arch}; allowed: [{V41_ARCHITECTURE!r}]")
    if d.get("model_type", V41_MODEL_TYPE) != V41_MODEL_TYPE:
        raise ConfigError(
            f"config.json: model_type={d['model_type']!r}; allowed: {V41_MODEL_TYPE!r}"
        )
    dtype = d.get("dtype", d.get("torch_dtype", "bfloat16"))
    if dtype != "bfloat16":
        raise ConfigError(f"config.json: dtype={dtype!r}; allowed: 'bfloat16'")
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(
            "config.json: a DeepSeek-V4.1 config nests its text model under "
            "text_config (a JSON object); it is missing"
        )
    _expect(text, "hidden_act", "silu")
    _expect(text, "attention_bias", False)
    _expect(text, "attention_dropout", 0.0)
    _expect(text, "num_key_value_heads", 1)
    qc = d.get("quantization_config", text.get("quantization_config"))
    if qc is not None and (
        not isinstance(qc, dict) or {k: qc.get(k) for k in V41_QUANTIZATION} != V41_QUANTIZATION
    ):
        raise ConfigError(
            f"config.json: quantization_config={qc}; allowed: {V41_QUANTIZATION} "
            "(or absent for unquantised weights)"
        )
    if int(text.get("num_hash_layers", 0)):
        raise ConfigError(
            f"config.json: text_config.num_hash_layers={text['num_hash_layers']}; "
            "allowed: 0 (V4.1 has no hash-routed layers)"
        )
    for key, allowed in (
        ("scoring_func", "sqrtsoftplus"),
        ("topk_method", "noaux_tc"),
        ("norm_topk_prob", True),
    ):
        _expect(text, key, allowed)
    if text.get("compress_overlap") or text.get("use_ape"):
        raise ConfigError(
            "config.json: text_config.compress_overlap / use_ape; allowed: false "
            "(V4.1 compressors neither overlap nor add an APE)"
        )
    out = dict(text)
    for key in (
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "image_token_id",
        "tokenizer_compatibility",
    ):
        if key in d and key not in out:
            out[key] = d[key]
    out["quantization_config"] = qc
    out["expert_dtype"] = (qc or {}).get("expert_dtype", "fp4" if qc else "bf16")
    out["vision_config"] = d.get("vision_config")
    out["num_hash_layers"] = 0
    return out


@dataclass(frozen=True)
class LayerTopology:
    """Cross-layer sharing of a V4.1 stack (spec §6-§8): for every main layer the layer whose
    compressed KV, top-k selection and index keys it reads (-1 for window-only layers), the
    two-level candidate source and the YOCO boundary."""

    kv_source: tuple[int, ...]
    index_source: tuple[int, ...]
    index_k_source: tuple[int, ...]
    n_prefill_layer: int  # first consumer layer (= num_hidden_layers: no YOCO split)
    candidate_source: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0

    @classmethod
    def from_keys(cls, t: dict[str, Any], ratios: tuple[int, ...], n_layers: int) -> LayerTopology:
        main = ratios[:n_layers]
        compressed = [i for i, r in enumerate(main) if r]
        kv = _layer_ids(t, "kv_source_layer_ids", compressed, main)
        index = _layer_ids(t, "index_source_layer_ids", kv, main)
        index_k = _layer_ids(t, "index_k_source_layer_ids", kv, main)
        if index_k != kv:
            raise ConfigError(
                f"config.json: text_config.index_k_source_layer_ids={index_k}; allowed: the "
                f"ids of kv_source_layer_ids ({kv}): index keys are projected from the "
                "source's own compressed rows"
            )
        if not set(kv) <= set(index):
            raise ConfigError(
                f"config.json: text_config.index_source_layer_ids={index}; allowed: a list "
                f"holding every KV source {kv} (each new compressed segment needs its "
                "own selection)"
            )
        n_prefill = next((i for i, r in enumerate(main) if r == 1), n_layers)
        if n_prefill < n_layers and n_prefill not in kv:
            raise ConfigError(
                f"config.json: text_config.kv_source_layer_ids={kv}; allowed: a list holding "
                f"layer {n_prefill}, the first ratio-1 layer (KV sharing must not cross the "
                "YOCO boundary)"
            )
        if any(ratios[n_layers:]):
            raise ConfigError(
                f"config.json: text_config.compress_ratios={list(ratios)}: drafter entries "
                f"{list(ratios[n_layers:])}; allowed: 0 (V4.1 drafter stages are window-only)"
            )
        kv_map = _source_map(kv, main, "kv_source_layer_ids")
        index_map = _source_map(index, main, "index_source_layer_ids")
        ik_map = _source_map(index_k, main, "index_k_source_layer_ids")
        cand = t.get("candidate_source_layer_id")
        out = cls(tuple(kv_map), tuple(index_map), tuple(ik_map), n_prefill)
        if cand is None:
            return out
        if cand not in index:
            raise ConfigError(
                f"config.json: text_config.candidate_source_layer_id={cand!r}; allowed: null "
                f"or one of index_source_layer_ids {index}"
            )
        blocks = _need(t, "candidate_topk_blocks")
        size = _need(t, "candidate_block_size")
        if not (isinstance(size, int) and 1 <= size <= 16):
            raise ConfigError(
                f"config.json: text_config.candidate_block_size={size!r}; allowed: an int in 1..16"
            )
        if not (isinstance(blocks, int) and blocks >= 8 and blocks % 8 == 0):
            raise ConfigError(
                f"config.json: text_config.candidate_topk_blocks={blocks!r}; allowed: a "
                "positive multiple of 8"
            )
        if blocks * size < int(_need(t, "index_topk")):
            raise ConfigError(
                f"config.json: text_config.candidate_topk_blocks={blocks} x "
                f"candidate_block_size={size} < index_topk={t['index_topk']}; allowed: "
                "candidate tokens >= index_topk"
            )
        bad = [i for i in index if i > cand and main[i] != main[cand]]
        if bad:
            raise ConfigError(
                f"config.json: text_config.index_source_layer_ids: layers {bad} after the "
                f"candidate source {cand} have another compress ratio; allowed: ratio "
                f"{main[cand]} (candidate blocks index the source's entries)"
            )
        return cls(tuple(kv_map), tuple(index_map), tuple(ik_map), n_prefill, cand, blocks, size)

    def candidate_consumer(self, layer_id: int) -> bool:
        """An index source after the candidate source: selects only inside its candidate blocks."""
        return (
            self.candidate_source is not None
            and layer_id > self.candidate_source
            and self.index_source[layer_id] == layer_id
        )


def _layer_ids(
    t: dict[str, Any], key: str, default: list[int], ratios: tuple[int, ...]
) -> list[int]:
    if key not in t or t[key] is None:
        return list(default)
    ids = t[key]
    if not (
        isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ConfigError(f"config.json: text_config.{key}={ids!r}; allowed: a list of layer ids")
    bad = [i for i in ids if not (0 <= i < len(ratios) and ratios[i])]
    if bad or sorted(set(ids)) != ids:
        raise ConfigError(
            f"config.json: text_config.{key}={ids}; allowed: increasing ids of compressed "
            f"layers {[i for i, r in enumerate(ratios) if r]} (bad: {bad or 'order'})"
        )
    return ids


def _source_map(sources: list[int], ratios: tuple[int, ...], key: str) -> list[int]:
    """Each layer's nearest source at or before it (-1 for window-only layers); a compressed
    layer needs a source of its own ratio, and no window-only layer may sit inside a segment."""
    out, current, gap = [], -1, -1
    for i, r in enumerate(ratios):
        if not r:
            out.append(-1)
            gap = i
            continue
        if i in sources:
            current = i
        elif 0 <= current < gap:
            raise ConfigError(
                f"config.json: text_config.compress_ratios[{gap}]=0 sits inside the "
                f"{key} segment of layer {current}; allowed: only compressed layers "
                f"between a source and the layers sharing it (make layer {i} a source)"
            )
        if current < 0 or ratios[current] != r:
            raise ConfigError(
                f"config.json: text_config.{key}={sources}: layer {i} (ratio {r}) has no "
                f"source of ratio {r} at or before it; allowed: lists whose source for "
                "every compressed layer has that layer's ratio"
            )
        out.append(current)
    return out


@dataclass(frozen=True)
class EngramConfig:
    """Engram's hashed n-gram memory (spec §11): which layers, the n-gram orders and heads, and
    the table sizes' lower bounds (`engram_vocab_size`, one per order)."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    vocab_sizes: tuple[int, ...]
    n_heads: int
    head_dim: int
    pad_token_id: int
    compress_tokenizer: bool

    @classmethod
    def from_keys(cls, t: dict[str, Any], n_prefill: int) -> EngramConfig | None:
        ids = t.get("engram_layer_ids")
        if not ids:
            return None
        if not (
            isinstance(ids, list)
            and all(isinstance(i, int) for i in ids)
            and sorted(set(ids)) == ids
        ):
            raise ConfigError(
                f"config.json: text_config.engram_layer_ids={ids!r}; allowed: increasing layer ids"
            )
        bad = [i for i in ids if not 0 <= i < n_prefill]
        if bad:
            raise ConfigError(
                f"config.json: text_config.engram_layer_ids={ids}: layers {bad} are not in "
                f"the YOCO producer half; allowed: ids in 0..{n_prefill - 1}"
            )
        n = int(_need(t, "engram_max_ngram_size"))
        sizes = _need(t, "engram_vocab_size")
        sizes = [sizes] * (n - 1) if isinstance(sizes, int) else list(sizes)
        out = cls(
            tuple(ids),
            n,
            tuple(int(s) for s in sizes),
            int(_need(t, "engram_n_heads")),
            int(_need(t, "engram_head_dim")),
            int(t.get("engram_pad_token_id", 2)),
            bool(t.get("engram_compressed_vocab_size")),
        )
        for key, ok, allowed in (
            ("engram_max_ngram_size", n >= 2, "an int >= 2"),
            (
                "engram_vocab_size",
                len(sizes) == n - 1 and min(sizes) >= 2,
                f"an int >= 2 or a list of {n - 1} (one per n-gram order 2..{n})",
            ),
            ("engram_n_heads", out.n_heads >= 1, "an int >= 1"),
            (
                "engram_head_dim",
                out.head_dim >= 32 and out.head_dim % 32 == 0,
                "a multiple of 32 (FP8 rows with one scale per 32)",
            ),
            (
                "engram_compressed_vocab_size",
                out.compress_tokenizer,
                "a truthy value (Engram needs tokenizer compression)",
            ),
        ):
            if not ok:
                raise ConfigError(
                    f"config.json: text_config.{key}={t.get(key)!r}; allowed: {allowed}"
                )
        return out
