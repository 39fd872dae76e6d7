"""Model runner: builds the model once (hooks resolved here, never again), loads the checkpoint,
and runs forward passes over per-sequence state. It makes no policy decisions.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache.budget import CacheRequest, resolve_num_blocks
from ..cache.sequence_state import SequenceState
from ..cache.state_cache import CacheLayout, StateCache
from ..config import ModelConfig
from ..model import ForwardBatch, ModelOps, bind_ops, build_model, process_weights
from ..model.attention import Numerics
from ..model.deepseek_v4 import DeepseekV4Model
from ..plugin_context import BuildContext, normalize_dtype
from ..plugins import get_plugin_manager
from .cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)
WEIGHT_FORMATS = ("bf16", "fp8", "fp4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")


def resolve_kv_fp8(kv_cache_dtype: str, dtype: torch.dtype, simulate_qat: bool) -> bool:
    """Whether window rings and compressed rows are stored as packed FP8 (`ops.kv_fp8`).

    "auto" (as in vLLM) keeps the model dtype; "bfloat16" says so explicitly. "fp8" stores 584 B
    instead of 1024 B per 512-wide row (35% fewer cache bytes per token for V4-Flash): lossless with
    the QAT simulation, which fake-quantises those rows to exactly these FP8 values before caching, a
    real extra quantisation without it. Not the default yet: the attention kernel's dequantising loads
    make prefill attention about 2x slower on the H200 (README, benchmarks)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; allowed: {', '.join(map(repr, KV_CACHE_DTYPES))}")
    if kv_cache_dtype == "fp8" and dtype != torch.bfloat16:
        raise ValueError(f"kv_cache_dtype='fp8' needs dtype='bfloat16' (the RoPE dims stay bf16), got {dtype}")
    return kv_cache_dtype == "fp8"


def resolve_batch_invariant(options: dict) -> bool:
    """`batch_invariant=` (LLM / runner option) if given, else DEEPINFER_BATCH_INVARIANT; taken out of
    `options` so the BuildContext holds it in one place."""
    value = options.pop("batch_invariant", None)
    if value is None:
        from ..envs import read_settings
        return read_settings().batch_invariant
    if not isinstance(value, bool):
        raise ValueError(f"batch_invariant={value!r}; allowed: True, False, None (= DEEPINFER_BATCH_INVARIANT)")
    return value


def check_batch_invariant(ops: ModelOps, sampler) -> None:
    """Batch invariance was asked for: every op object must declare it (`batch_invariant = True`,
    set by the batch_invariant feature plugin), else nothing would make the output invariant."""
    chosen = {**{f"linear method ({f})": m for f, m in ops.linear.items()}, "attention backend": ops.attention,
              "MoE method": ops.moe, "mHC method": ops.mhc, "pointwise method": ops.pointwise, "sampler": sampler}
    missing = [f"{what} {type(op).__module__}.{type(op).__qualname__}" for what, op in chosen.items()
               if op is not None and not getattr(op, "batch_invariant", False)]
    if missing:
        from ..plugins import PluginError
        raise PluginError("DEEPINFER_BATCH_INVARIANT=1 (batch_invariant=True), but these ops are not batch "
                          f"invariant: {'; '.join(missing)}. Is the deepinfer-batch-invariant feature installed "
                          "and not disabled (DEEPINFER_DISABLE_PLUGINS / DEEPINFER_PLUGINS)?")


@dataclass
class LoadedModel:
    model: DeepseekV4Model
    ctx: BuildContext
    sampler: object
    load_seconds: float
    ops: ModelOps | None = None
    logits_processors: list = field(default_factory=list)   # deepinfer_logits_processors, once


def load_model(model_dir: str | Path, *, dtype="float32", simulate_qat: bool = True, device: str | None = None,
               options: dict | None = None) -> LoadedModel:
    """Config -> hooks -> graph on the meta device -> checkpoint (one shard at a time) -> runtime weights."""
    from ..model.weights import load_checkpoint   # local: the loader pulls in safetensors

    t0 = time.perf_counter()
    cfg = ModelConfig.from_file(model_dir)
    pm = get_plugin_manager()
    platform = pm.detect_platform()
    device = device or platform.device_type        # None: the detected platform's device
    options = dict(options or {})
    ctx = BuildContext(model_config=cfg, platform=platform, device=device, dtype=normalize_dtype(dtype),
                       simulate_qat=bool(simulate_qat), batch_invariant=resolve_batch_invariant(options),
                       options=options)
    pm.configure(ctx)
    ops = ModelOps(linear={f: pm.linear_method(ctx, f) for f in WEIGHT_FORMATS},
                   attention=pm.attention_backend(ctx), moe=pm.moe_method(ctx), mhc=pm.mhc_method(ctx),
                   pointwise=pm.pointwise_method(ctx))
    sampler = pm.sampler(ctx)
    if ctx.batch_invariant:
        check_batch_invariant(ops, sampler)
    logits_processors = pm.logits_processors(ctx)
    model = build_model(cfg, device="meta")
    load_checkpoint(model, model_dir, compute_dtype=ctx.torch_dtype)   # may drop model.mtp
    bind_ops(model, ops, Numerics(dtype=ctx.torch_dtype, simulate_qat=ctx.simulate_qat))
    process_weights(model)
    model.to(device)
    return LoadedModel(model=model, ctx=ctx, sampler=sampler, load_seconds=time.perf_counter() - t0, ops=ops,
                       logits_processors=logits_processors)


class ModelRunner:
    def __init__(self, model_dir: str | Path, *, dtype="float32", simulate_qat: bool = True,
                 device: str | None = None, max_backtracking_tokens: int | None = None,
                 enforce_eager: bool | None = None, kv_cache_dtype: str = "auto", **options):
        self.loaded = load_model(model_dir, dtype=dtype, simulate_qat=simulate_qat, device=device, options=options)
        self.model = self.loaded.model
        self.sampler = self.loaded.sampler      # chosen through deepinfer_sampler, once
        self.logits_processors = self.loaded.logits_processors
        self.model_config: ModelConfig = self.model.cfg
        self.device = self.loaded.ctx.device
        self.dtype = self.loaded.ctx.torch_dtype
        from ..envs import read_settings        # the env table is the one source of the defaults
        settings = read_settings()
        if max_backtracking_tokens is None:
            max_backtracking_tokens = settings.effective_max_backtracking_tokens
        self.backtrack = max_backtracking_tokens
        self.enforce_eager = settings.enforce_eager if enforce_eager is None else bool(enforce_eager)
        self.kv_fp8 = resolve_kv_fp8(kv_cache_dtype, self.dtype, self.loaded.ctx.simulate_qat)
        self.graphs: DecodeGraphs | None = None
        self.cache: StateCache | None = None
        self._cache_request: CacheRequest | None = None
        self.cache_note = ""                     # where the cache's size came from (logged, tests)
        self.profile_tokens = 8192              # the engine sets its max_num_batched_tokens
        log.info("model loaded in %.1f s", self.loaded.load_seconds)

    # ---- state cache ---------------------------------------------------------------------------
    def cache_layout(self) -> CacheLayout:
        # no MTP layer states when the checkpoint came without MTP weights (the loader dropped them)
        return CacheLayout.from_config(self.model_config, self.dtype, self.backtrack,
                                       with_mtp=len(self.model.mtp) > 0, kv_fp8=self.kv_fp8)

    def allocate_cache(self, request: CacheRequest) -> StateCache:
        """Size and allocate the state cache once (again only when the request changed and nothing
        is resident)."""
        if self.cache is not None and self._cache_request == request:
            return self.cache
        if self.cache is not None and not self.cache.allocator.empty:
            raise RuntimeError("state cache: cannot re-size while sequences are resident")
        self.graphs = None                      # they point into the old cache's pools
        self.cache = None                       # free the old pools before sizing the new ones
        layout = self.cache_layout()
        num_blocks, note = resolve_num_blocks(layout, request, self.device, self._profile_activation_bytes)
        use_graphs = self._graphs_wanted()
        # decode graphs pad batches into one extra slot and block of their own
        self.cache = StateCache(layout, request.num_slots, num_blocks, self.device, spare=use_graphs)
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.cache, self.loaded.ops.attention, request.num_slots,
                                       -(-(request.max_model_len or self.model_config.max_position_embeddings)
                                         // layout.block_size))
            note += "; +1 slot and block for CUDA-graph padding"
        self._cache_request, self.cache_note = request, note
        log.info("state cache: %d slots x %d B + %d blocks x %d B = %.1f MiB (%s)", request.num_slots,
                 layout.slot_bytes, num_blocks, layout.block_bytes, self.cache.nbytes() / 2**20, note)
        return self.cache

    def _graphs_wanted(self) -> bool:
        ops = self.loaded.ops
        return (torch.device(self.device).type == "cuda" and not self.enforce_eager and ops is not None
                and DecodeGraphs.supported(ops.attention))

    def bind_sequence(self, slot: int, block_ids: list[int]) -> SequenceState:
        """A fresh engine-managed state (the scheduler owns its slot and blocks)."""
        return self.cache.bind(slot, block_ids)

    def new_sequence(self) -> SequenceState:
        """A self-managed state: its slot and blocks come from the cache's allocator and go back on
        `release` (tests and tools that drive the runner without the engine)."""
        if self.cache is None:
            self.allocate_cache(CacheRequest(num_slots=8, max_model_len=self.model_config.max_position_embeddings))
        alloc = self.cache.allocator
        state = self.cache.bind(alloc.allocate_slot(), [])

        def grow(st: SequenceState, need: int) -> None:
            st.table.set(st.table.ids + alloc.allocate_blocks(need - len(st.table)))
        state.grow = grow
        return state

    def release(self, state: SequenceState) -> None:
        if state.grow is not None and state.slot >= 0:     # self-managed: give everything back
            self.cache.allocator.free_blocks(state.table.ids)
            self.cache.allocator.free_slot(state.slot)
        state.table.set([])
        state.slot = -1

    def _profile_activation_bytes(self) -> int:
        """Peak extra device memory of one forward over a full token budget (CUDA only)."""
        n = min(int(self.profile_tokens), int(self.model_config.max_position_embeddings))
        layout = self.cache_layout()
        scratch = StateCache(layout, 1, -(-n // layout.block_size), self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            self.model(ForwardBatch.build([[0] * n], [scratch.bind(0, list(range(scratch.num_blocks)))],
                                          self.device))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del scratch
        torch.cuda.empty_cache()
        return int(peak)

    # ---- forward --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_batch(self, token_ids: list[list[int]], seqs: list[SequenceState],
                      all_logits: bool = False, logit_modes: list[str] | None = None) -> torch.Tensor:
        """Feed each sequence its new tokens at its next positions; fp32 logits of the wanted rows
        (see ForwardBatch.build for `logit_modes`)."""
        for st, toks in zip(seqs, token_ids):
            st.reserve(len(toks))
        if self.graphs is not None and self.graphs.fits(token_ids, seqs, all_logits, logit_modes):
            logits = self.graphs.run(token_ids, seqs)
            if logits is not None:               # decode (q = 1) or verification (q tokens each)
                for st, toks in zip(seqs, token_ids):
                    st.num_tokens += len(toks)
                return logits
        batch = ForwardBatch.build(token_ids, seqs, self.device, all_logits=all_logits, logit_modes=logit_modes)
        out = self.model(batch)
        batch.commit()
        return out.logits

    def forward(self, seq: SequenceState, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        return self.forward_batch([token_ids], [seq], all_logits)
