"""The sweep's model: a V4-Flash-width DeepSeek-V4 with few layers and random weights, built without a
checkpoint on disk, plus fabricated decode state. A DeepSeek-V4.1 config (model_type deepseek_v41)
is cut by the benchmarks' shared V4.1 cut (`v41_cut.cut_v41`: valid topology, both YOCO halves,
shrunk Engram tables) and its Engram layers hash with the installed V4 tokenizer.

The build mirrors `deepinfer_core.runner.model_loader.load_model` step for step (plugin manager ->
BuildContext -> configure -> ModelOps -> graph -> weights -> bind_ops -> process_weights), except that
the checkpoint-format buffers are filled in place on the target device by the engine's dummy-weights
loader (`deepinfer_core.model.dummy_weights`: unit-variance outputs through every linear, O(1) mHC
mixes, FP8 drawn straight into e4m3). A 4-layer V4-Flash model is ~27 GB of FP8.

Before any weight is made on a GPU, `weight_plan` runs the chosen backend's own weight processing
on a meta-device copy of the model (shapes only) and `check_weights_fit` refuses a build whose
weights (in the backend's runtime form, plus one layer's conversion buffers) would not fit the free
device memory, with the bytes by module: e.g. a backend that cannot fuse a MoE layer and dequantises
its FP4 experts to bf16 (4x their checkpoint bytes).

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
from deepinfer_core.config_fields import normalize_dtype
from deepinfer_core.contracts import resolve_model_ops, resolve_sampler
from deepinfer_core.engine_config import EngineConfig
from deepinfer_core.model import ModelOps, bind_ops, build_model, process_weights
from deepinfer_core.model.attention import Numerics
from deepinfer_core.model.dummy_weights import fill_dummy_weights
from deepinfer_core.model.engram import EngramTable, engram_storage
from deepinfer_core.model.layers import Linear
from deepinfer_core.model.moe import MoE
from deepinfer_core.ops.kv_fp8 import pack_kv_fp8
from deepinfer_core.plugin_context import BuildContext
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
                 engram_rows: int | None = DEFAULT_ENGRAM_ROWS, experts: int | None = None) -> dict[str, Any]:
    """`base` cut to `layers` main layers alternating CSA/HCA (+ the base's MTP entries, not run),
    every linear FP8 (experts too unless `expert_dtype` says otherwise). A V4.1 base: the shared
    V4.1 cut (`engram_rows`: Engram table rows per head and order, None: the base's). `experts`:
    routed experts per layer (None: the base's; fewer change the MoE's work at batch > 1, so
    `full_config` extrapolates to a model with the same number)."""
    if family(base) == "v41":
        have = default_expert_dtype(base)
        if expert_dtype != have:
            raise ValueError(f"--expert-dtype {expert_dtype}: a DeepSeek-V4.1 config's "
                             f"quantization_config fixes its routed experts; allowed: {have}")
        return cut_v41(base, layers, experts=experts, engram_rows=engram_rows)
    d = copy.deepcopy(base)
    if experts is not None:
        if not int(base["num_experts_per_tok"]) <= experts:
            raise ValueError(f"--experts {experts}: allowed: >= num_experts_per_tok ({base['num_experts_per_tok']})")
        d["n_routed_experts"] = experts
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
    own depth) or its V4.1 cut, with the bench model's Engram table sizes. Both: the bench model's
    routed experts per layer (the figures extrapolate the measured layers)."""
    if family(base) == "v41":
        rows = text_keys(bench).get("engram_vocab_size")
        cut = cut_v41(base, full_layers, experts=int(text_keys(bench)["n_routed_experts"]),
                      engram_rows=None, flag="--full-layers")
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
    weight_plan: dict[str, Any] | None = None     # `weight_plan`'s accounting, made before the build

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
    plan = weight_plan(cfg, ops, ctx)
    if torch.device(device).type == "cuda":           # refuse before allocating anything
        check_weights_fit(plan, torch.cuda.mem_get_info(torch.device(device))[0], str(device))
    model = build_model(cfg, device=device)          # torch.empty buffers, filled below
    model.mtp = nn.ModuleList()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()                      # the dropped MTP block's memory
    fill_dummy_weights(model, cfg, seed)
    if cfg.engram is not None:                       # Engram hashes token ids: the V4 tokenizer's
        from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
        model.bind_engram(tokenizer_dir() / "tokenizer.json", device)
    plugins = [{"name": r.name, "status": r.status, **({"error": r.error} if r.error else {})} for r in pm.records]
    return Built(model.eval(), cfg, ctx, ops, plugins, plan)


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


GB = 1e9
WEIGHT_PARTS = ("attention", "routed experts", "shared expert", "moe gate", "engram",
                "embed and head", "other")


def weight_part(name: str) -> str:
    """The part of the model a buffer belongs to (a fused MoE's stacked `nv_*` buffers hold the
    routed experts and, as its last expert, the shared one: counted as routed experts)."""
    if name.startswith(("embed.", "head.")):
        return "embed and head"
    if ".engram." in name:              # the tables and the layer's own projections
        return "engram"
    if ".ffn.gate." in name:
        return "moe gate"
    if ".ffn.shared_experts." in name:
        return "shared expert"
    if ".ffn." in name:
        return "routed experts"
    if ".attn." in name:
        return "attention"
    return "other"


def weight_parts(model: nn.Module) -> dict[str, int]:
    """Bytes of every buffer and parameter by `weight_part`."""
    out = dict.fromkeys(WEIGHT_PARTS, 0)
    for name, t in [*model.named_buffers(), *model.named_parameters()]:
        out[weight_part(name)] += t.numel() * t.element_size()
    return out


@torch.no_grad()
def weight_plan(cfg: ModelConfig, ops, ctx: BuildContext | None = None) -> dict[str, Any]:
    """The weights' bytes by the engine's own accounting, without making any: the model graph on the
    meta device (MTP dropped, as `build_random_model` does), `ops`' linear and MoE methods (`ops.linear`
    by weight format, `ops.moe`) bound and their `process_weights` run layer by layer (shapes only).

    Returns checkpoint and runtime bytes by part (`weight_parts`), `peak_bytes`: the most resident
    after any layer's conversion, `transient_bytes`: an allowance for one layer's conversion buffers
    (its experts at checkpoint size: the nvidia fused MoE allocates the stacked experts before the
    per-expert buffers go), `device_bytes`: the runtime weights left on the device (Engram tables go
    to pinned host memory on a GPU, `place_engram`), and how many MoE layers the MoE method fused (a
    method that tells: `ops.moe.fused`). On error: {"status": "not accounted: ..."}."""
    try:
        model = build_model(cfg, device="meta")
        model.mtp = nn.ModuleList()
        for mod in model.modules():
            if isinstance(mod, Linear):
                mod.method = ops.linear[mod.fmt]
            elif isinstance(mod, MoE):
                mod.method = ops.moe
        before = weight_parts(model)
        layer_ckpt = [sum(t.numel() * t.element_size() for n, t in layer.named_buffers() if n.startswith("ffn."))
                      for layer in model.layers]
        peak = weight_bytes(model)
        for layer in model.layers:                 # process_weights(model)'s order, one block at a time
            process_weights(layer)
            peak = max(peak, weight_bytes(model))
        for name, child in model.named_children():
            if name != "layers":
                process_weights(child)
        after = weight_parts(model)
        peak = max(peak, weight_bytes(model))
    except Exception as e:                          # the accounting never takes the benchmark down
        return {"status": f"not accounted: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    fused = getattr(ops.moe, "fused", None)
    host = 0                                        # Engram tables that place_engram moves off the device
    if ctx is not None and cfg.engram is not None:
        force_gpu = ctx.options.model.engram_force_gpu_storage
        if engram_storage(ctx.device, force_gpu, ops.pointwise) == "host":
            host = sum(weight_bytes(m) for m in model.modules() if isinstance(m, EngramTable))
    runtime = sum(after.values())
    return {
        "status": "ok", "layers": len(model.layers), "checkpoint_bytes": sum(before.values()),
        "runtime_bytes": runtime, "checkpoint_by_part": before, "runtime_by_part": after,
        "peak_bytes": peak, "transient_bytes": max(layer_ckpt, default=0),
        "device_bytes": runtime - host,
        "moe_layers": len(moes),
        "moe_layers_fused": sum(bool(fused(m)) for m in moes) if callable(fused) else None,
        "moe_method": f"{type(ops.moe).__module__}.{type(ops.moe).__qualname__}",
    }


def check_weights_fit(plan: dict[str, Any], free_bytes: int, where: str = "the device") -> None:
    """ValueError when `weight_plan`'s peak plus one layer's conversion buffers exceed `free_bytes`,
    saying where the bytes go (nothing is checked when the plan could not be made)."""
    if plan.get("status") != "ok":
        return
    need = plan["peak_bytes"] + plan["transient_bytes"]
    if need <= free_bytes:
        return
    ck, rt = plan["checkpoint_by_part"], plan["runtime_by_part"]
    parts = ", ".join(f"{k} {ck[k] / GB:.2f} -> {rt[k] / GB:.2f}" for k in WEIGHT_PARTS if ck[k] or rt[k])
    why = ""
    if plan["moe_layers_fused"] is not None and plan["moe_layers_fused"] < plan["moe_layers"]:
        why = (f"; {plan['moe_layers'] - plan['moe_layers_fused']} of {plan['moe_layers']} MoE layers not fused "
               f"by {plan['moe_method']} (their experts take the portable path, in the compute dtype: "
               f"routed experts x{rt['routed experts'] / max(1, ck['routed experts']):.1f} their checkpoint bytes)")
    raise ValueError(
        f"the {plan['layers']}-layer model's weights do not fit {where}: {need / GB:.1f} GB needed "
        f"(peak {plan['peak_bytes'] / GB:.1f} GB while converting + {plan['transient_bytes'] / GB:.1f} GB "
        f"for one layer's conversion buffers), {free_bytes / GB:.1f} GB free. GB by part, checkpoint -> "
        f"runtime: {parts}{why}. Fewer --layers (V4.1: down to its minimum) or --experts")


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
