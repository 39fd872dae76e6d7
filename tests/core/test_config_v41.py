"""The DeepSeek-V4.1 config path (spec deepseek_v41.md §2, §6-§8, §11, §14): every bad input is
refused with a ValueError naming the key and what it allows; the tiny config parses to the
expected sharing topology; V4 configs keep the V4 defaults; and the loader accepts the V4.1
checkpoint spellings (`model.` prefix, vision parts ignored) while still naming a missing tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.model import build_model
from deepinfer_core.model.weights import (
    INDEX_FILE,
    CheckpointError,
    check_checkpoint,
    load_checkpoint,
)
from deepinfer_core.tools.make_tiny_checkpoint import main as make_tiny_main
from deepinfer_core.tools.tiny_config import tiny_config_dict
from deepinfer_core.tools.tiny_config_v41 import tiny_v41_config_dict

V41_QUANT = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}
NO_SHARING = {
    "kv_source_layer_ids": None,
    "index_source_layer_ids": None,
    "index_k_source_layer_ids": None,
    "candidate_source_layer_id": None,
}


def refused(d: dict, *needles: str, allowed: str = "allowed") -> str:
    """The ValueError message of parsing `d`; it must name every needle and say what is allowed."""
    with pytest.raises(ValueError) as ei:
        ModelConfig.from_dict(d)
    msg = str(ei.value)
    assert isinstance(ei.value, ConfigError), f"{type(ei.value).__name__}: {msg}"
    for needle in (*needles, allowed):
        assert needle in msg, f"{needle!r} not in: {msg}"
    return msg


def top(**top_level) -> dict:
    """The tiny V4.1 config with top-level keys replaced (a value of None removes the key)."""
    d = tiny_v41_config_dict()
    for key, value in top_level.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    return d


def nearest_source(sources: list[int], ratios: list[int]) -> tuple[int, ...]:
    """Reference source map (spec §7): each compressed layer's nearest source at or before it."""
    out, cur = [], -1
    for i, r in enumerate(ratios):
        cur = i if i in sources else cur
        out.append(cur if r else -1)
    return tuple(out)


# ---- the tiny V4.1 config parses ---------------------------------------------------------------


def test_tiny_v41_parses_to_the_expected_topology():
    d = tiny_v41_config_dict()
    t = d["text_config"]
    cfg = ModelConfig.from_dict(d)
    ratios = t["compress_ratios"]
    assert cfg.family == "v41" and cfg.compress_ratios == tuple(ratios) == (0, 0, 2, 2, 2, 1, 1, 1)
    topo = cfg.topology
    assert topo is not None
    # the spec's rule, computed independently, and the literal maps of the tiny stack
    assert (
        topo.kv_source
        == nearest_source(t["kv_source_layer_ids"], ratios)
        == (-1, -1, 2, 2, 4, 5, 5, 5)
    )
    assert (
        topo.index_source
        == nearest_source(t["index_source_layer_ids"], ratios)
        == (-1, -1, 2, 2, 4, 5, 5, 7)
    )
    assert topo.index_k_source == topo.kv_source
    assert [cfg.kv_source(i) for i in range(8)] == list(topo.kv_source)
    assert [cfg.index_source(i) for i in range(8)] == list(topo.index_source)
    assert cfg.n_prefill_layer == topo.n_prefill_layer == ratios.index(1) == 5
    cand = (topo.candidate_source, topo.candidate_topk_blocks, topo.candidate_block_size)
    assert cand == (5, 8, 4)
    assert [i for i in range(8) if topo.candidate_consumer(i)] == [7]
    assert cfg.index_keys_projected


def test_tiny_v41_switches_and_values():
    cfg = ModelConfig.from_dict(tiny_v41_config_dict())
    assert cfg.use_q_head_norm is False and cfg.hc_shifted is True
    assert cfg.shared_expert_clamp is True
    assert cfg.compress_overlap is False and cfg.use_fp4_sparse_kv is True
    assert cfg.num_hash_layers == 0 and cfg.num_nextn_predict_layers == 0
    assert cfg.weight_block_size == (32, 32) and cfg.expert_dtype == "fp4" and cfg.fp8_weights
    assert cfg.rms_norm_eps == 1e-20 and cfg.hidden_size == 256 and cfg.vision
    assert (cfg.pad_token_id, cfg.image_token_id) == (2, 128815)
    assert cfg.engram is not None and cfg.engram.layer_ids == (1, 3)
    assert cfg.engram.vocab_sizes == (1000, 1200) and cfg.engram.compress_tokenizer


def test_v4_config_keeps_the_v4_defaults():
    cfg = ModelConfig.from_dict(tiny_config_dict())
    assert cfg.family == "v4" and cfg.topology is None and cfg.engram is None
    assert cfg.hc_shifted is False and cfg.use_q_head_norm is True
    assert cfg.shared_expert_clamp is False
    assert cfg.compress_overlap is True and not cfg.index_keys_projected
    assert cfg.n_prefill_layer == cfg.num_hidden_layers
    ratios = cfg.compress_ratios
    assert [cfg.kv_source(i) for i in range(len(ratios))] == [
        i if r else -1 for i, r in enumerate(ratios)
    ]
    assert [cfg.index_source(i) for i in range(len(ratios))] == [
        i if r == 4 else -1 for i, r in enumerate(ratios)
    ]


def test_no_sharing_keys_make_every_compressed_layer_its_own_source():
    d = tiny_v41_config_dict(**NO_SHARING)
    assert not {"kv_source_layer_ids", "candidate_source_layer_id"} & set(d["text_config"])
    cfg = ModelConfig.from_dict(d)
    own = tuple(i if r else -1 for i, r in enumerate(cfg.compress_ratios))
    assert cfg.topology.kv_source == cfg.topology.index_source == cfg.topology.index_k_source == own
    assert cfg.topology.candidate_source is None and cfg.n_prefill_layer == 5
    assert not any(cfg.topology.candidate_consumer(i) for i in range(8))


def test_v41_detected_by_architecture_alone_and_mtp_entries_counted():
    assert ModelConfig.from_dict(top(model_type=None)).family == "v41"
    cfg = ModelConfig.from_dict(
        tiny_v41_config_dict(
            compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0], num_nextn_predict_layers=1,
            dspark_target_layer_ids=[1],
        )
    )
    assert cfg.num_nextn_predict_layers == 1 and cfg.mtp_ratio(0) == 0


def test_absent_quantization_config_means_unquantised():
    cfg = ModelConfig.from_dict(top(quantization_config=None))
    assert cfg.weight_block_size is None and not cfg.fp8_weights and cfg.expert_dtype == "bf16"
    # the same block inside text_config is read like the top-level one
    d = top(quantization_config=None)
    d["text_config"]["quantization_config"] = dict(V41_QUANT)
    assert ModelConfig.from_dict(d).weight_block_size == (32, 32)


# ---- compress_ratios ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratios", [[0, 0, 4, 2, 2, 1, 1, 1], [0, 0, 2, 2, 2, 128, 1, 1], [0, 0, 2, 2, 2, 1, 1, -1]]
)
def test_v4_or_unknown_ratio_refused(ratios):
    bad = sorted(set(ratios) - {0, 1, 2})
    refused(
        tiny_v41_config_dict(compress_ratios=ratios, **NO_SHARING),
        "compress_ratios",
        f"values {bad}",
        "[0, 1, 2]",
    )


@pytest.mark.parametrize(
    "ratios,n_mtp",
    [([0, 0, 2, 2, 2, 1, 1, 1, 0], 0), ([0, 0, 2, 2, 2, 1, 1], 0), ([0, 0, 2, 2, 2, 1, 1, 1], 1)],
)
def test_compress_ratios_length_is_layers_plus_drafter(ratios, n_mtp):
    refused(
        tiny_v41_config_dict(compress_ratios=ratios, num_nextn_predict_layers=n_mtp),
        "compress_ratios",
        f"{len(ratios)} entries",
        "num_hidden_layers (8)",
        f"num_nextn_predict_layers ({n_mtp})",
    )


# ---- cross-layer sharing -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids,why",
    [
        ([2, 4, 5, 8], "8 is not a layer"),
        ([2, 4, 5, -1], "-1 is not a layer"),
        ([0, 2, 4, 5], "layer 0 is window-only"),
        ([4, 2, 5], "not increasing"),
        ([2, 2, 4, 5], "a repeated id"),
        (["2", 4, 5], "not an int"),
        ([True, 2, 4, 5], "a bool"),
        (5, "not a list"),
    ],
)
def test_kv_source_ids_must_be_increasing_compressed_layers(ids, why):
    refused(
        tiny_v41_config_dict(kv_source_layer_ids=ids, index_k_source_layer_ids=None),
        f"text_config.kv_source_layer_ids={ids!r}",
    )


def test_compressed_layer_without_a_source_of_its_ratio():
    # layer 2 (C2) comes before the first source
    msg = refused(
        tiny_v41_config_dict(kv_source_layer_ids=[4, 5], index_k_source_layer_ids=None),
        "kv_source_layer_ids",
        "layer 2 (ratio 2)",
    )
    assert "no source of ratio 2" in msg
    # layer 6 (C2, after the C1 source 5) shares a source of another ratio
    msg = refused(
        tiny_v41_config_dict(
            compress_ratios=[0, 0, 2, 2, 2, 1, 2, 2],
            kv_source_layer_ids=[2, 4, 5],
            index_k_source_layer_ids=None,
        ),
        "kv_source_layer_ids",
        "layer 6 (ratio 2)",
    )
    assert "no source of ratio 2" in msg


@pytest.mark.parametrize(
    "ratios,kv,gap",
    [
        ([0, 0, 2, 0, 2, 1, 1, 1], [2, 5], 3),  # a window-only layer inside the C2 segment
        ([0, 0, 2, 2, 2, 1, 0, 1], [2, 4, 5], 6),  # ... inside the C1 consumer segment
    ],
)
def test_window_only_layer_inside_a_shared_segment(ratios, kv, gap):
    msg = refused(
        tiny_v41_config_dict(
            compress_ratios=ratios,
            kv_source_layer_ids=kv,
            index_k_source_layer_ids=None,
            index_source_layer_ids=kv,
            candidate_source_layer_id=None,
        ),
        f"compress_ratios[{gap}]=0",
        "kv_source_layer_ids",
    )
    assert "segment" in msg


def test_window_only_layer_between_segments_is_fine():
    ratios = [0, 0, 2, 0, 2, 1, 1, 1]
    cfg = ModelConfig.from_dict(tiny_v41_config_dict(compress_ratios=ratios))
    assert (
        cfg.topology.kv_source == nearest_source([2, 4, 5], ratios) == (-1, -1, 2, -1, 4, 5, 5, 5)
    )


def test_kv_sharing_must_not_cross_the_yoco_boundary():
    # layer 5, the first ratio-1 layer, is no KV source: it would read a producer layer's rows
    msg = refused(
        tiny_v41_config_dict(kv_source_layer_ids=[2, 4], index_k_source_layer_ids=None),
        "kv_source_layer_ids",
        "layer 5",
    )
    assert "first ratio-1 layer" in msg and "YOCO boundary" in msg


def test_index_k_sources_must_equal_kv_sources():
    msg = refused(
        tiny_v41_config_dict(index_k_source_layer_ids=[2, 5]),
        "index_k_source_layer_ids=[2, 5]",
        "[2, 4, 5]",
    )
    assert "kv_source_layer_ids" in msg
    # absent: defaults to the KV sources
    cfg = ModelConfig.from_dict(tiny_v41_config_dict(index_k_source_layer_ids=None))
    assert cfg.topology.index_k_source == cfg.topology.kv_source


def test_index_sources_must_hold_every_kv_source():
    refused(
        tiny_v41_config_dict(index_source_layer_ids=[2, 5, 7]),
        "index_source_layer_ids=[2, 5, 7]",
        "[2, 4, 5]",
    )


def test_candidate_source_must_be_an_index_source():
    refused(
        tiny_v41_config_dict(candidate_source_layer_id=6),
        "candidate_source_layer_id=6",
        "index_source_layer_ids [2, 4, 5, 7]",
    )


@pytest.mark.parametrize("size", [17, 32, 0, 4.0])
def test_candidate_block_size_at_most_16(size):
    refused(
        tiny_v41_config_dict(candidate_block_size=size, candidate_topk_blocks=64),
        f"candidate_block_size={size!r}",
        "1..16",
    )


def test_candidate_block_size_16_is_accepted():
    cfg = ModelConfig.from_dict(tiny_v41_config_dict(candidate_block_size=16))
    assert cfg.topology.candidate_block_size == 16


@pytest.mark.parametrize("blocks", [12, 4, 0, -8, 8.0])
def test_candidate_topk_blocks_a_positive_multiple_of_8(blocks):
    refused(
        tiny_v41_config_dict(candidate_topk_blocks=blocks, candidate_block_size=16),
        f"candidate_topk_blocks={blocks!r}",
        "multiple of 8",
    )


def test_candidate_tokens_must_cover_index_topk():
    # 8 blocks x 4 entries = 32 candidate tokens < 64
    refused(
        tiny_v41_config_dict(index_topk=64),
        "candidate_topk_blocks=8",
        "candidate_block_size=4",
        "index_topk=64",
    )
    assert (
        ModelConfig.from_dict(tiny_v41_config_dict(index_topk=32)).index_topk == 32
    )  # 32 = 32: fine


@pytest.mark.parametrize("key", ["candidate_topk_blocks", "candidate_block_size"])
def test_candidate_keys_required_with_a_candidate_source(key):
    refused(tiny_v41_config_dict(**{key: None}), key, "missing", allowed="required")


def test_candidate_consumers_must_share_the_source_ratio():
    refused(
        tiny_v41_config_dict(
            compress_ratios=[0, 0, 2, 2, 2, 1, 1, 2],
            kv_source_layer_ids=[2, 4, 5, 7],
            index_k_source_layer_ids=None,
        ),
        "index_source_layer_ids",
        "layers [7]",
        "ratio 1",
    )


# ---- Engram ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[1, 5], [1, 7], [6]])
def test_engram_only_in_the_producer_half(ids):
    refused(tiny_v41_config_dict(engram_layer_ids=ids), "engram_layer_ids", "producer", "0..4")


def test_engram_after_the_last_layer_without_yoco_split():
    # no ratio-1 layer: the whole stack is the producer half
    cfg = ModelConfig.from_dict(
        tiny_v41_config_dict(
            compress_ratios=[0, 0, 2, 2, 2, 2, 2, 2], engram_layer_ids=[1, 6], **NO_SHARING
        )
    )
    assert cfg.n_prefill_layer == 8 and cfg.engram.layer_ids == (1, 6)
    refused(
        tiny_v41_config_dict(
            compress_ratios=[0, 0, 2, 2, 2, 2, 2, 2], engram_layer_ids=[8], **NO_SHARING
        ),
        "engram_layer_ids",
        "0..7",
    )


@pytest.mark.parametrize("value", [None, 0, False])
def test_engram_needs_tokenizer_compression(value):
    refused(
        tiny_v41_config_dict(engram_compressed_vocab_size=value),
        "engram_compressed_vocab_size",
        "tokenizer compression",
    )


def test_engram_off_needs_no_engram_keys():
    keys = [k for k in tiny_v41_config_dict()["text_config"] if k.startswith("engram_")]
    cfg = ModelConfig.from_dict(tiny_v41_config_dict(**dict.fromkeys(keys)))
    assert cfg.engram is None


# ---- top-level and text_config checks ----------------------------------------------------------


@pytest.mark.parametrize(
    "arch",
    [
        ["DeepseekV4ForCausalLM"],
        ["LlamaForCausalLM"],
        ["DeepseekV41ForCausalLM", "DeepseekV4ForCausalLM"],
    ],
)
def test_wrong_architectures(arch):
    refused(top(architectures=arch), f"architectures={arch}", "'DeepseekV41ForCausalLM'")


def test_wrong_model_type():
    refused(top(model_type="deepseek_v4"), "model_type='deepseek_v4'", "'deepseek_v41'")


@pytest.mark.parametrize("keys", [{"dtype": "float16"}, {"dtype": None, "torch_dtype": "float32"}])
def test_wrong_dtype(keys):
    refused(top(**keys), "dtype=", "'bfloat16'")


@pytest.mark.parametrize("value", [None, [1, 2], "text"])
def test_text_config_missing_or_not_an_object(value):
    refused(top(text_config=value), "text_config", "JSON object", allowed="missing")


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("hidden_act", "gelu", "'silu'"),
        ("attention_bias", True, "False"),
        ("attention_dropout", 0.1, "0.0"),
        ("num_key_value_heads", 8, "1"),
        ("scoring_func", "softmax", "'sqrtsoftplus'"),
        ("topk_method", "greedy", "'noaux_tc'"),
        ("norm_topk_prob", False, "True"),
    ],
)
def test_text_config_fixed_values(key, value, allowed):
    refused(tiny_v41_config_dict(**{key: value}), f"text_config.{key}={value!r}", allowed)


@pytest.mark.parametrize(
    "field,value",
    [
        ("weight_block_size", [128, 128]),
        ("scale_fmt", None),
        ("quant_method", "awq"),
        ("expert_dtype", "fp8"),
        ("activation_scheme", "static"),
    ],
)
def test_wrong_quantization_config(field, value):
    qc = dict(V41_QUANT, **{field: value})
    msg = refused(
        top(quantization_config=qc), "quantization_config", "'weight_block_size': [32, 32]"
    )
    assert "absent" in msg


@pytest.mark.parametrize("value", ["fp8", [32, 32]])
def test_quantization_config_not_an_object(value):
    refused(top(quantization_config=value), "quantization_config")


@pytest.mark.parametrize("n", [1, 3])
def test_hash_layers_refused(n):
    refused(tiny_v41_config_dict(num_hash_layers=n), f"num_hash_layers={n}", "allowed: 0")


@pytest.mark.parametrize("key", ["compress_overlap", "use_ape"])
def test_overlap_and_ape_refused(key):
    refused(tiny_v41_config_dict(**{key: True}), key, "false")


def test_v4_only_keys_with_their_v41_values_are_fine():
    cfg = ModelConfig.from_dict(
        tiny_v41_config_dict(num_hash_layers=0, compress_overlap=False, use_ape=False)
    )
    assert cfg.num_hash_layers == 0 and cfg.compress_overlap is False


# ---- the loader on V4.1 checkpoints ------------------------------------------------------------


def _model(d: Path):
    return build_model(ModelConfig.from_file(d), device="meta")


def _variant(src: Path, dst: Path, weight_map: dict[str, str], new_shards: dict[str, dict]) -> Path:
    """`dst`: links to every file of `src` except the index and the shards in `new_shards`,
    which are written (name -> tensors); the index gets `weight_map`."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != INDEX_FILE and f.name not in new_shards:
            (dst / f.name).symlink_to(f)
    for name, tensors in new_shards.items():
        save_file(tensors, str(dst / name), metadata={"format": "pt"})
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _index(d: Path) -> dict[str, str]:
    return json.loads((d / INDEX_FILE).read_text())["weight_map"]


MISSING = [
    "layers.5.attn.compressor.wkv.weight",
    "layers.2.attn.compressor.wgate.weight",
    "layers.4.attn.indexer.wk.weight",
    "layers.7.attn.indexer.wq_b.scale",
]


@pytest.fixture(scope="module")
def missing_ckpts(tiny_v41_dir, tmp_path_factory) -> dict[str, Path]:
    """For each MISSING name: a copy of the tiny V4.1 checkpoint without that tensor (only its
    shard rewritten, the rest linked)."""
    wm = _index(tiny_v41_dir)
    out, root = {}, tmp_path_factory.mktemp("v41_missing")
    for i, name in enumerate(MISSING):
        shard = wm[name]
        tensors = {n: t for n, t in load_file(str(tiny_v41_dir / shard)).items() if n != name}
        out[name] = _variant(
            tiny_v41_dir,
            root / str(i),
            {n: s for n, s in wm.items() if n != name},
            {shard: tensors},
        )
    return out


def test_tiny_v41_checkpoint_loads_cleanly(tiny_v41_dir):
    assert check_checkpoint(_model(tiny_v41_dir), tiny_v41_dir) == []
    rep = load_checkpoint(_model(tiny_v41_dir), tiny_v41_dir)
    assert rep.tensors_loaded == len(_index(tiny_v41_dir)) and rep.ignored == []


@pytest.mark.parametrize("name", MISSING)
def test_missing_tensor_is_named(missing_ckpts, name):
    ck = missing_ckpts[name]
    problems = check_checkpoint(_model(ck), ck)
    assert len(problems) == 1 and problems[0].startswith(f"{name}: missing"), problems
    with pytest.raises(CheckpointError, match=f"{name}: missing"):
        load_checkpoint(_model(ck), ck)


VISION_EXTRAS = {
    "vision.blocks.0.attn.qkv.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
    "vision.patch_embed.weight": torch.zeros(4, 3, dtype=torch.bfloat16),
    "aligner.w1.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
    "aligner.w2.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
    "image_newline": torch.zeros(256, dtype=torch.bfloat16),
    "image_start": torch.zeros(256, dtype=torch.bfloat16),
    "layers.3.ffn.gate.bias_vl": torch.zeros(8, dtype=torch.float32),
    "layers.6.ffn.gate.bias_vl": torch.zeros(8, dtype=torch.float32),
}


@pytest.fixture(scope="module")
def vision_ckpt(tiny_v41_dir, tmp_path_factory) -> Path:
    """The tiny V4.1 checkpoint plus the vision tower, aligner, image embeddings and image
    routing biases of a full V4.1 checkpoint, in a shard of their own."""
    extra = "model-vision.safetensors"
    wm = {**_index(tiny_v41_dir), **dict.fromkeys(VISION_EXTRAS, extra)}
    return _variant(
        tiny_v41_dir, tmp_path_factory.mktemp("v41_vision") / "ck", wm, {extra: VISION_EXTRAS}
    )


def test_vision_tensors_are_ignored(vision_ckpt, tiny_v41_dir):
    assert check_checkpoint(_model(vision_ckpt), vision_ckpt) == []
    model = _model(vision_ckpt)
    rep = load_checkpoint(model, vision_ckpt)
    assert sorted(rep.ignored) == sorted(VISION_EXTRAS)
    assert rep.tensors_loaded == len(_index(tiny_v41_dir))
    assert not any(
        n.startswith(("vision", "aligner", "image_")) or n.endswith("bias_vl")
        for n in model.state_dict()
    )


@pytest.mark.parametrize(
    "name",
    [
        "visionary.weight",
        "layers.3.ffn.gate.bias_vlx",
        "image_newlines",
        "layers.2.attn.compressor.ape",
    ],
)
def test_lookalikes_of_ignored_names_are_still_unexpected(tiny_v41_dir, tmp_path, name):
    extra = "model-extra.safetensors"
    ck = _variant(
        tiny_v41_dir,
        tmp_path / "ck",
        {**_index(tiny_v41_dir), name: extra},
        {extra: {name: torch.zeros(4, dtype=torch.bfloat16)}},
    )
    problems = check_checkpoint(_model(ck), ck)
    assert problems == [f"{name}: unexpected tensor ([4] bfloat16 in {extra})"]


@pytest.fixture(scope="module")
def prefixed_ckpt(tiny_v41_dir, tmp_path_factory) -> Path:
    """Every tensor of the tiny V4.1 checkpoint stored under `model.<name>`."""
    wm = _index(tiny_v41_dir)
    shards = {
        s: {f"model.{n}": t for n, t in load_file(str(tiny_v41_dir / s)).items()}
        for s in sorted(set(wm.values()))
    }
    return _variant(
        tiny_v41_dir,
        tmp_path_factory.mktemp("v41_prefix") / "ck",
        {f"model.{n}": s for n, s in wm.items()},
        shards,
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def test_model_prefixed_names_load(prefixed_ckpt, tiny_v41_dir):
    for shard in prefixed_ckpt.glob("model-*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            names = f.keys()
        assert names and all(n.startswith("model.") for n in names)
    assert check_checkpoint(_model(prefixed_ckpt), prefixed_ckpt) == []
    got, ref = _model(prefixed_ckpt), _model(tiny_v41_dir)
    rep = load_checkpoint(got, prefixed_ckpt)
    load_checkpoint(ref, tiny_v41_dir)
    assert rep.tensors_loaded == len(_index(tiny_v41_dir)) and rep.ignored == []
    g, r = got.state_dict(), ref.state_dict()
    assert g.keys() == r.keys()
    for n in r:
        assert g[n].dtype == r[n].dtype and torch.equal(_bytes(g[n]), _bytes(r[n])), n


def test_prefixed_and_plain_copy_of_one_tensor_is_a_problem(tiny_v41_dir, tmp_path):
    extra = "model-extra.safetensors"
    t = load_file(str(tiny_v41_dir / _index(tiny_v41_dir)["norm.weight"]))["norm.weight"]
    ck = _variant(
        tiny_v41_dir,
        tmp_path / "ck",
        {**_index(tiny_v41_dir), "model.norm.weight": extra},
        {extra: {"model.norm.weight": t}},
    )
    assert check_checkpoint(_model(ck), ck) == [
        "model.norm.weight: stored beside norm.weight, another name of the same tensor"
    ]


# ---- the tiny-checkpoint CLI -------------------------------------------------------------------


@pytest.mark.parametrize("flag,value", [("--layers", "4"), ("--mtp", "1")])
def test_cli_v41_refuses_topology_flags(tmp_path, capsys, flag, value):
    out = tmp_path / "ck"
    with pytest.raises(SystemExit) as ei:
        make_tiny_main([str(out), "--family", "v41", flag, value])
    assert ei.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert (
        len(error) == 1 and flag in error[0] and "--family v41" in error[0] and "fixed" in error[0]
    )
    assert not out.exists()


def test_drafter_entries_must_be_window_only():
    refused(tiny_v41_config_dict(num_nextn_predict_layers=1, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1],
                                 dspark_target_layer_ids=[1]),
            "drafter entries", "allowed: 0")
