"""The sweep's model: a V4-Flash-width DeepSeek-V4 with few layers and random weights, built without a
checkpoint on disk, plus fabricated decode state. A DeepSeek-V4.1 config (model_type deepseek_v41)
is cut by the benchmarks' shared V4.1 cut (`v41_cut.cut_v41`: valid topology, both YOCO halves,
shrunk Engram tables) and its Engram layers hash with the installed V4 tokenizer.

The build mirrors `deepinfer_core.runner.model_loader.load_model` step for step (plugin manager ->
BuildContext -> configure -> ModelOps -> graph -> weights -> bind_ops -> process_weights), except that
the checkpoint-format buffers are filled in place on the target device by the engine's dummy-weights
loader (`deepinfer_core.model.dummy_weights`: unit-variance outputs through every linear, O(1) mHC
mixes, FP8 drawn straight into e4m3). A 4-layer V4-Flash model is ~27 GB of FP8.

Decode at context C needs no prefill: visibility is by position, so random pool contents, a block
table covering C + 1 positions and `num_tokens = C` are a valid state for a one-token step at C.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from v41_cut import DEFAULT_ENGRAM_ROWS, cut_v41, family, text_keys

from deepinfer_core.cache.sequence_state import SequenceState
from deepinfer_core.cache.state_cache import CacheLayout, StateCache
from deepinfer_core.config import ModelConfig
from deepinfer_core.contracts import resolve_model_ops, resolve_sampler
from deepinfer_core.engine_config import EngineConfig
from deepinfer_core.model import ModelOps, bind_ops, build_model, process_weights
from deepinfer_core.model.attention import Numerics
from deepinfer_core.model.dummy_weights import fill_dummy_weights
from deepinfer_core.model.engram import EngramTable
from deepinfer_core.ops.kv_fp8 import pack_kv_fp8
from deepinfer_core.plugin_context import BuildContext, normalize_dtype
from deepinfer_core.plugins import get_plugin_manager
from deepinfer_core.runner.model_loader import (
    check_batch_invariant,
    check_fp4_experts,
    place_engram,
)
from deepinfer_core.tools.tiny_config import tiny_config_dict

REPO = Path(__file__).resolve().parents[1]
# the real V4-Flash config.json, kept in the repository (see its README there)
FLASH_CONFIG = REPO / "tests/data/deepseek-v4-flash/config.json"
BENCH_PATTERN = (4, 128)           # the sweep model's layers: CSA, HCA, CSA, HCA, ...


# ---- configs -----------------------------------------------------------------------------------

def use_cuda_core_moe(max_rows: float) -> None:
    """Let the fused MoE's tile heuristic pick its CUDA-core kernels (deepinfer_kernels.moe_gemv) up to
    `max_rows` mean rows per expert for either weight form, 0: never (the engine's default: by weight form,
    `moe.GEMV_TILES`)."""
    if max_rows < 0:
        raise ValueError(f"--cuda-core-moe: {max_rows} rows; allowed: 0 (off) or more")
    from deepinfer_kernels import moe
    moe.GEMV_MAX_ROWS = float(max_rows)


def load_base_config(path: str | None = None, tiny: bool = False) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from): the tiny config, `path` (a config.json or a checkpoint
    directory), or the real V4-Flash config.json kept in the repository."""
    if tiny:
        return tiny_config_dict(), "deepinfer_core.tools.tiny_config"
    p = Path(path) if path else FLASH_CONFIG
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"--config {path}: no config.json there" if path else f"{p} is missing")
    return json.loads(p.read_text()), str(p)


def default_expert_dtype(base: dict[str, Any]) -> str:
    """The sweep's routed-expert format: FP8 for V4 (the sweep's choice); for V4.1 the one its
    quantization_config fixes (FP4; bf16 without one, as the engine reads it)."""
    if family(base) != "v41":
        return "fp8"
    qc = base.get("quantization_config", text_keys(base).get("quantization_config"))
    return (qc or {}).get("expert_dtype", "fp4" if qc else "bf16")


def bench_config(base: dict[str, Any], layers: int, expert_dtype: str = "fp8",
                 engram_rows: int | None = DEFAULT_ENGRAM_ROWS) -> dict[str, Any]:
    """`base` cut to `layers` main layers alternating CSA/HCA (+ the base's MTP entries, not run),
    every linear FP8 (experts too unless `expert_dtype` says otherwise). A V4.1 base: the shared
    V4.1 cut (`engram_rows`: Engram table rows per head and order, None: the base's)."""
    if family(base) == "v41":
        have = default_expert_dtype(base)
        if expert_dtype != have:
            raise ValueError(f"--expert-dtype {expert_dtype}: a DeepSeek-V4.1 config's "
                             f"quantization_config fixes its routed experts; allowed: {have}")
        return cut_v41(base, layers, engram_rows=engram_rows)
    d = copy.deepcopy(base)
    n_base, n_mtp = int(base["num_hidden_layers"]), int(base.get("num_nextn_predict_layers", 1))
    mtp = list(base["compress_ratios"][n_base:n_base + n_mtp])
    mtp += [0] * (n_mtp - len(mtp))
    d["num_hidden_layers"] = layers
    d["compress_ratios"] = [BENCH_PATTERN[i % len(BENCH_PATTERN)] for i in range(layers)] + mtp
    d["num_hash_layers"] = min(int(base.get("num_hash_layers", 0)), layers)
    d["expert_dtype"] = expert_dtype
    if d.get("quantization_config"):
        d["quantization_config"] = {**d["quantization_config"], "expert_dtype": expert_dtype}
    return d


def full_config(base: dict[str, Any], bench: dict[str, Any], full_layers: int) -> dict[str, Any]:
    """The model the figures are extrapolated to: the base's own schedule when it has `full_layers`
    layers (V4-Flash: 2 window-only, then CSA/HCA), else V4-Flash's pattern. V4.1: the base (at its
    own depth) or its V4.1 cut, with the bench model's Engram table sizes."""
    if family(base) == "v41":
        rows = text_keys(bench).get("engram_vocab_size")
        cut = cut_v41(base, full_layers, engram_rows=None, flag="--full-layers")
        if rows is not None:
            text_keys(cut)["engram_vocab_size"] = rows
        return cut
    d = copy.deepcopy(bench)
    n_base = int(base["num_hidden_layers"])
    if n_base >= full_layers:
        main = list(base["compress_ratios"][:full_layers])
    else:
        main = [0, 0] + [BENCH_PATTERN[i % 2] for i in range(max(0, full_layers - 2))]
        main = main[:full_layers]
    n_bench = int(bench["num_hidden_layers"])
    d["num_hidden_layers"] = full_layers
    d["compress_ratios"] = main + list(bench["compress_ratios"][n_bench:])
    d["num_hash_layers"] = min(int(base.get("num_hash_layers", 0)), full_layers)
    return d


# ---- the model ---------------------------------------------------------------------------------

@dataclass
class Built:
    model: nn.Module
    cfg: ModelConfig
    ctx: BuildContext
    ops: ModelOps
    plugins: list[dict[str, str]]

    def ops_summary(self) -> dict[str, Any]:
        name = lambda o: f"{type(o).__module__}.{type(o).__qualname__}"  # noqa: E731
        return {"platform": self.ctx.platform.name, "device": str(self.ctx.device), "dtype": self.ctx.dtype,
                "simulate_qat": self.ctx.simulate_qat,
                "linear": {f: name(m) for f, m in self.ops.linear.items()},
                "attention": name(self.ops.attention), "moe": name(self.ops.moe), "mhc": name(self.ops.mhc),
                "plugins": self.plugins, **self._engram()}

    def _engram(self) -> dict[str, Any]:
        """Where the Engram tables are (V4.1): pinned host memory or the model's device."""
        tables = [m for m in self.model.modules() if isinstance(m, EngramTable)]
        if not tables:
            return {}
        host = all(t.host_resident for t in tables)
        return {"engram_tables": "pinned host memory" if host else str(self.ctx.device)}


def build_random_model(cfg_dict: dict[str, Any], device: str | None, dtype: str = "bfloat16",
                       simulate_qat: bool = True, seed: int = 0, options: dict | None = None,
                       batch_invariant: bool = False) -> Built:
    """load_model's path with random weights instead of a checkpoint (`options`: engine options the
    backends read, e.g. fp4_experts). The weights stay in checkpoint
    format until `finish_model` (so transformers can be given the same weights first). The MTP blocks
    are dropped: the sweep never runs them."""
    cfg = ModelConfig.from_dict(cfg_dict)
    pm = get_plugin_manager()
    platform = pm.detect_platform()
    device = device or platform.device_type
    ctx = BuildContext(model_config=cfg, platform=platform, device=device, dtype=normalize_dtype(dtype),
                       simulate_qat=bool(simulate_qat), batch_invariant=batch_invariant,
                       options=EngineConfig.from_options(**(options or {})))
    pm.configure(ctx)
    ops = resolve_model_ops(pm, ctx)
    check_fp4_experts(ops, ctx)
    if batch_invariant:
        check_batch_invariant(ops, resolve_sampler(pm, ctx))
    model = build_model(cfg, device=device)          # torch.empty buffers, filled below
    model.mtp = nn.ModuleList()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()                      # the dropped MTP block's memory
    fill_dummy_weights(model, cfg, seed)
    if cfg.engram is not None:                       # Engram hashes token ids: the V4 tokenizer's
        from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
        model.bind_engram(tokenizer_dir() / "tokenizer.json", device)
    plugins = [{"name": r.name, "status": r.status, **({"error": r.error} if r.error else {})} for r in pm.records]
    return Built(model.eval(), cfg, ctx, ops, plugins)


def finish_model(built: Built) -> None:
    """The rest of load_model: bind the op objects, let them convert the weights to runtime form,
    and put Engram tables where the loader does (pinned host memory on CUDA unless
    DEEPINFER_ENGRAM_FORCE_GPU_STORAGE)."""
    bind_ops(built.model, built.ops, Numerics(dtype=built.ctx.torch_dtype, simulate_qat=built.ctx.simulate_qat))
    process_weights(built.model)
    if built.cfg.engram is not None:
        force_gpu = built.ctx.options.model.engram_force_gpu_storage
        place_engram(built.model, built.ctx.device, force_gpu, built.ops.pointwise)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every buffer and parameter (runtime weights are non-persistent buffers)."""
    return sum(t.numel() * t.element_size() for t in list(model.buffers()) + list(model.parameters()))


# ---- state -------------------------------------------------------------------------------------

def cache_layout(cfg: ModelConfig, dtype: torch.dtype, simulate_qat: bool = True,
                 kv_cache_dtype: str = "auto") -> CacheLayout:
    """The engine's layout: the runner's backtrack default (env table) and KV storage choice (a
    V4.1 model refuses 'fp8', V4's packed rows)."""
    from deepinfer_core.envs import read_settings
    from deepinfer_core.runner.model_runner import resolve_kv_fp8
    kv_fp8 = resolve_kv_fp8(kv_cache_dtype, dtype, simulate_qat, cfg.family)
    return CacheLayout.from_config(cfg, dtype, read_settings().effective_max_backtracking_tokens,
                                   kv_fp8=kv_fp8)


@torch.no_grad()
def decode_states(layout: CacheLayout, batch: int, context: int, device, seed: int = 0
                  ) -> tuple[StateCache, list[SequenceState]]:
    """`batch` sequences that have seen `context` tokens: random pools, each sequence with its own slot
    and blocks for positions 0..context (the step writes position `context`)."""
    nb = -(-(context + 1) // layout.block_size)
    cache = StateCache(layout, batch, batch * nb, device)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    for t in cache.tensors():
        if t.dtype == torch.int64:          # Engram's ring of earlier token ids (compressed ids)
            t.random_(0, 1024, generator=gen)
        elif t.dtype == torch.uint8:        # packed FP8 rows: pack random rows chunk by chunk
            rows = t.view(-1, t.shape[-1])
            for i in range(0, rows.shape[0], 1 << 18):
                part = rows[i:i + (1 << 18)]
                src = torch.randn(part.shape[0], layout.head_dim, device=t.device, generator=gen)
                part.copy_(pack_kv_fp8(src, layout.rope_dim))
        else:
            t.normal_(0.0, 1.0, generator=gen)
    states = []
    for i in range(batch):
        st = cache.bind(i, list(range(i * nb, (i + 1) * nb)), fresh=False)
        st.num_tokens = context
        for layer in st.layers + st.mtp_layers:
            for cs in (layer.compressor, layer.indexer):
                if cs is not None:
                    cs.n_rows = context // cs.ratio
        states.append(st)
    return cache, states


def prefill_cache(layout: CacheLayout, tokens: int, device) -> StateCache:
    """One slot and the blocks of a `tokens`-token prompt (bind it fresh before every run)."""
    return StateCache(layout, 1, -(-tokens // layout.block_size), device)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()
