"""Model configuration: one dataclass parsed from an HF-format DeepSeek-V4 `config.json`.

The layer schedule always comes from `compress_ratios` (never from defaults): V4-Pro starts with
HCA layers, V4-Flash with window-only ones.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from .config_error import ConfigError
from .config_v41 import (
    V41_ARCHITECTURE,
    V41_MODEL_TYPE,
    V41_RATIOS,
    EngramConfig,
    LayerTopology,
    is_v41,
    v41_text_keys,
)

SUPPORTED_ARCHITECTURES = ("DeepseekV4ForCausalLM", V41_ARCHITECTURE)
SUPPORTED_MODEL_TYPES = ("deepseek_v4", V41_MODEL_TYPE)
ALLOWED_RATIOS = (0, 4, 128)
ALLOWED_EXPERT_DTYPES = ("fp4", "fp8", "bf16")
__all__ = ["ConfigError", "DSparkConfig", "EngramConfig", "LayerTopology", "ModelConfig", "YarnScaling"]


@dataclass(frozen=True)
class YarnScaling:
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter of a `*-DSpark` / V4-Flash-0731 checkpoint: its stages are
    the `num_nextn_predict_layers` blocks stored under `mtp.*`."""

    block_size: int                    # gamma the drafter was trained for (dspark_block_size)
    noise_token_id: int                # the mask token filling draft slots 2..gamma
    target_layer_ids: tuple[int, ...]  # main layers whose attention inputs feed the drafter
    markov_rank: int                   # r of the Markov head's V x r tables
    n_routed_experts: int              # the stages' own MoE size (dspark_n_routed_experts, else the target's)
    num_experts_per_tok: int
    # per-position confidence temperatures a calibration stored (deepinfer_dspark.calibrate --write-config;
    # our key, not DeepSeek's): the default of DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE
    confidence_temperatures: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], n_layers: int, n_experts: int, top_k: int) -> "DSparkConfig | None":
        if "dspark_block_size" not in d and "dspark_target_layer_ids" not in d:
            return None
        if not d.get("dspark_target_attn_input", True):
            raise ConfigError("config.json: dspark_target_attn_input=false is not supported; allowed: [true] (the "
                              "drafter reads the streams entering each target layer's attention)")
        ids = tuple(int(i) for i in d.get("dspark_target_layer_ids") or ())
        bad = [i for i in ids if not 0 <= i < n_layers]
        if not ids or bad:
            raise ConfigError(f"config.json: dspark_target_layer_ids={list(ids)}; allowed: a non-empty list of main "
                              f"layer ids in 0..{n_layers - 1}")
        out = cls(block_size=int(d.get("dspark_block_size", 5)), noise_token_id=int(d.get("dspark_noise_token_id", 0)),
                  target_layer_ids=ids, markov_rank=int(d.get("dspark_markov_rank", 256)),
                  n_routed_experts=int(d.get("dspark_n_routed_experts") or n_experts),
                  num_experts_per_tok=int(d.get("dspark_num_experts_per_tok") or top_k),
                  confidence_temperatures=_temperatures(d.get("dspark_confidence_temperatures")))
        for name, value in (("dspark_block_size", out.block_size), ("dspark_markov_rank", out.markov_rank),
                            ("dspark_n_routed_experts", out.n_routed_experts)):
            if value < 1:
                raise ConfigError(f"config.json: {name}={value}; allowed: an int >= 1")
        if not 1 <= out.num_experts_per_tok <= out.n_routed_experts:
            raise ConfigError(f"config.json: dspark_num_experts_per_tok={out.num_experts_per_tok}; allowed: "
                              f"1..{out.n_routed_experts} (dspark_n_routed_experts)")
        return out


def _temperatures(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and value and all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in value)):
        raise ConfigError(f"config.json: dspark_confidence_temperatures={value!r}; allowed: a non-empty list of "
                          f"numbers > 0 (one per draft position)")
    return tuple(float(t) for t in value)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    num_nextn_predict_layers: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    max_position_embeddings: int = 1 << 20
    bos_token_id: int = 0
    eos_token_id: int = 1
    # Quantisation of the checkpoint: None = plain (bf16/f32) weights everywhere.
    weight_block_size: tuple[int, int] | None = (128, 128)
    expert_dtype: str = "fp4"
    dspark: DSparkConfig | None = None   # the mtp.* stages are a DSpark drafter (else MTP blocks)
    # ---- V4.1 switches (spec deepseek_v41.md §16); the defaults are V4 ----------------------------
    family: str = "v4"                   # "v4" | "v41" (the config format, not a code path)
    use_q_head_norm: bool = True         # unweighted RMS norm of each query head (V4.1: absent)
    hc_shifted: bool = False             # mHC collapses with the previous sub-layer's pre; no hc_head
    compress_overlap: bool = True        # ratio-4 compressors pool two overlapping windows + APE
    topology: LayerTopology | None = None   # cross-layer sharing + YOCO; None: every layer its own
    use_fp4_sparse_kv: bool = False      # compressed KV / index keys stored FP4 (V4.1)
    shared_expert_clamp: bool = False    # swiglu_limit clamps the shared expert too (V4.1 engine)
    engram: EngramConfig | None = None
    vision: bool = False                 # vision_config present (text path only: images refused)
    pad_token_id: int | None = None
    image_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived values -------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of main layer `layer_id` (0 = window only, 4 = CSA, 128 = HCA)."""
        return self.compress_ratios[layer_id]

    def mtp_ratio(self, mtp_id: int) -> int:
        idx = self.num_hidden_layers + mtp_id
        return self.compress_ratios[idx] if idx < len(self.compress_ratios) else 0

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    def kv_source(self, layer_id: int) -> int:
        """The layer whose compressor and compressed rows `layer_id` reads (-1: window only)."""
        if self.topology is not None and layer_id < self.num_hidden_layers:
            return self.topology.kv_source[layer_id]
        return layer_id if self.compress_ratios[layer_id] else -1

    def index_source(self, layer_id: int) -> int:
        """The layer whose top-k selection `layer_id` uses (-1: no selection; V4's ratio-128 layers
        attend every visible row)."""
        if self.topology is not None and layer_id < self.num_hidden_layers:
            return self.topology.index_source[layer_id]
        return layer_id if self.compress_ratios[layer_id] == 4 else -1

    @property
    def index_keys_projected(self) -> bool:
        """Index keys projected from the main compressor's rows (`indexer.wk`, V4.1) instead of a
        second compressor (`indexer.compressor.*`, V4)."""
        return self.topology is not None

    @property
    def n_prefill_layer(self) -> int:
        """The first YOCO consumer layer (num_hidden_layers when the stack has no consumer half)."""
        return self.topology.n_prefill_layer if self.topology is not None else self.num_hidden_layers

    @property
    def fp8_weights(self) -> bool:
        return self.weight_block_size is not None

    # ---- parsing --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if is_v41(d):
            return cls._from_keys(v41_text_keys(d), raw=d, v41=True)
        arch = d.get("architectures") or []
        if arch and not any(a in SUPPORTED_ARCHITECTURES for a in arch):
            raise ConfigError(f"config.json: architectures={arch} is not supported; "
                              f"allowed: {list(SUPPORTED_ARCHITECTURES)}")
        mt = d.get("model_type")
        if mt is not None and mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config.json: model_type={mt!r} is not supported; "
                              f"allowed: {list(SUPPORTED_MODEL_TYPES)}")
        return cls._from_keys(d, raw=d, v41=False)

    @classmethod
    def _from_keys(cls, d: dict[str, Any], raw: dict[str, Any], v41: bool) -> "ModelConfig":
        """V4 keys (flat); `v41`: the keys of a V4.1 `text_config` (config_v41.v41_text_keys)."""
        where = "text_config." if v41 else ""

        def need(key: str):
            if key not in d:
                raise ConfigError(f"config.json: required field {where}{key} is missing")
            return d[key]

        n_layers = int(need("num_hidden_layers"))
        n_mtp = int(d.get("num_nextn_predict_layers", 0 if v41 else 1))
        ratios = tuple(int(r) for r in need("compress_ratios"))
        allowed = V41_RATIOS if v41 else ALLOWED_RATIOS
        bad = [r for r in ratios if r not in allowed]
        if bad:
            family = " (C4 and C128 are V4's; V4.1 has C1 and C2)" if v41 else ""
            raise ConfigError(f"config.json: {where}compress_ratios has values {sorted(set(bad))}; "
                              f"allowed: {list(allowed)}{family}")
        if len(ratios) < n_layers or (v41 and len(ratios) != n_layers + n_mtp):
            raise ConfigError(f"config.json: {where}compress_ratios has {len(ratios)} entries; allowed: "
                              f"num_hidden_layers ({n_layers}) + num_nextn_predict_layers ({n_mtp})")
        rs = d.get("rope_scaling") or {}
        yarn = YarnScaling(
            factor=float(rs.get("factor", 1.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 0)),
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
        ) if rs else YarnScaling()
        qc = d.get("quantization_config")
        block = tuple(qc.get("weight_block_size", (128, 128))) if qc else None
        expert_dtype = d.get("expert_dtype") or (qc or {}).get("expert_dtype") or ("fp4" if qc else "bf16")
        if expert_dtype not in ALLOWED_EXPERT_DTYPES:
            raise ConfigError(f"config.json: expert_dtype={expert_dtype!r}; allowed: {list(ALLOWED_EXPERT_DTYPES)}")
        scoring = d.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ConfigError(f"config.json: scoring_func={scoring!r}; allowed: ['sqrtsoftplus']")
        topology = LayerTopology.from_keys(d, ratios, n_layers) if v41 else None
        if v41 and n_mtp and "dspark_block_size" not in d and "dspark_target_layer_ids" not in d:
            raise ConfigError(f"config.json: text_config.num_nextn_predict_layers={n_mtp} without dspark_* "
                              "keys; allowed: 0, or a DSpark drafter's keys (V4.1 has no MTP block)")
        cfg = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(need("num_attention_heads")),
            head_dim=int(need("head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            q_lora_rank=int(need("q_lora_rank")),
            o_groups=int(need("o_groups")),
            o_lora_rank=int(need("o_lora_rank")),
            sliding_window=int(need("sliding_window")),
            compress_ratios=ratios,
            rope_theta=float(d.get("rope_theta", 10000.0)),
            compress_rope_theta=float(d.get("compress_rope_theta", 160000.0)),
            rope_scaling=yarn,
            index_n_heads=int(need("index_n_heads")),
            index_head_dim=int(need("index_head_dim")),
            index_topk=int(need("index_topk")),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            n_routed_experts=int(need("n_routed_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hash_layers=int(d.get("num_hash_layers", 0)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(d.get("swiglu_limit", 0.0)),
            num_nextn_predict_layers=n_mtp,
            scoring_func=scoring,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            max_position_embeddings=int(d.get("max_position_embeddings", 1 << 20)),
            bos_token_id=int(d.get("bos_token_id", 0)),
            eos_token_id=int(d.get("eos_token_id", 1)),
            weight_block_size=block,
            expert_dtype=expert_dtype,
            dspark=DSparkConfig.from_dict(d, n_layers, int(need("n_routed_experts")), int(need("num_experts_per_tok"))),
            family="v41" if v41 else "v4",
            use_q_head_norm=bool(d.get("use_q_head_norm", not v41)),
            hc_shifted=bool(d.get("hc_shifted", v41)),
            compress_overlap=not v41,
            topology=topology,
            use_fp4_sparse_kv=bool(d.get("use_fp4_sparse_kv", v41)),
            shared_expert_clamp=v41,
            engram=EngramConfig.from_keys(d, topology.n_prefill_layer) if topology else None,
            vision=bool(d.get("vision_config")),
            pad_token_id=d.get("pad_token_id"),
            image_token_id=d.get("image_token_id"),
            raw=dict(raw),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def validate(self) -> None:
        checks = [
            (self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.head_dim,
             "qk_rope_head_dim must be even and <= head_dim"),
            (self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim must be >= qk_rope_head_dim"),
            (self.num_attention_heads % self.o_groups == 0, "num_attention_heads must be divisible by o_groups"),
            (self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok must be <= n_routed_experts"),
            (self.nope_head_dim % 64 == 0, "head_dim - qk_rope_head_dim must be a multiple of 64 (FP8 KV blocks)"),
            (self.index_head_dim & (self.index_head_dim - 1) == 0, "index_head_dim must be a power of two (Hadamard)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"config.json: {msg}")

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            if f.name == "raw":
                continue
            v = getattr(self, f.name)
            out[f.name] = asdict(v) if is_dataclass(v) else v
        return out


def yarn_inv_freq(rope_dim: int, base: float, yarn: YarnScaling) -> list[float]:
    """Inverse frequencies of one interleaved RoPE table, YaRN when configured."""
    freqs = [1.0 / (base ** (2 * i / rope_dim)) for i in range(rope_dim // 2)]
    if yarn.original_max_position_embeddings <= 0 or yarn.factor == 1.0:
        return freqs

    def corr(r: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (r * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / yarn.factor * ramp + f * (1 - ramp))
    return out
