"""What the core calls on the objects plugins hand it, as `typing.Protocol`s.

The hooks (hookspecs.py) choose these objects once, at start-up; `resolve_model_ops` checks each
against its contract there, so a plugin that misses a method fails at start with one message naming
the plugin's class and the missing members, never with an AttributeError deep inside a forward.
After that the core calls the objects directly: no probing on the per-layer or per-token path.

The request-constraint contracts (structured outputs) are in engine/constraints.py; the runner's
contract with the engine (`StepRunner`, `EngineRunner`) is at the end of this file.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .engine.scheduler import SchedulingPolicy


# ---- the model's ops (hooks: deepinfer_linear_method, _attention_backend, _moe_method, ...) --------
@runtime_checkable
class LinearMethod(Protocol):
    """A weight format's matmul (`Linear.method`). `batch_invariant`: a row's result never depends on
    the other rows of the batch (checked when batch invariance is asked for)."""

    batch_invariant: bool

    def process_weights(self, layer: Any) -> None:
        """After loading: turn the layer's checkpoint tensors into this method's runtime form."""

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""

    def apply_grouped(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in/groups] -> [T, groups, out/groups] (the grouped output projection)."""


@runtime_checkable
class AttentionBackend(Protocol):
    batch_invariant: bool

    def forward(self, attn: Any, inp: Any, batch: Any, states: list) -> torch.Tensor:
        """One layer's attention over the batch (model/attention.py builds `inp`)."""

    # Optional: `compiles_expected() -> ContextManager`, entered around the runner's warm-up on CUDA
    # (runner/warmup.py): a backend whose kernels compile just in time can report compiles after it.


@runtime_checkable
class GraphMetadata(Protocol):
    """Fixed-shape device metadata of a CUDA-graph batch, refilled on the device before each replay."""

    def extra_inputs(self, starts: list[int]) -> list[int]:
        """Host-computed ints the step copies to the device with its ids, positions and slots."""

    def derive(self, slots: torch.Tensor, block_table: torch.Tensor, extra: torch.Tensor) -> None:
        """Refill the metadata from the slots, the engine's per-slot block table and the extras
        (device ops only: a CUDA graph records it)."""

    # Optional: `extra_inputs_device(starts: torch.Tensor) -> torch.Tensor`, the extras from device
    # starts, lets a speculative step be launched before the host knows its positions.


@runtime_checkable
class GraphAttentionBackend(AttentionBackend, Protocol):
    """An attention backend whose batches can be captured in CUDA graphs (runner/cuda_graphs.py)."""

    def graph_num_extra(self, num_seqs: int, query_len: int) -> int:
        """len(GraphMetadata.extra_inputs(...)) for a graph of this shape."""

    def graph_meta(self, batch: Any, max_blocks: int) -> GraphMetadata:
        """Install fixed-shape metadata into the graph's static `batch` and return it."""


@runtime_checkable
class MoEMethod(Protocol):
    batch_invariant: bool

    def process_weights(self, moe: Any) -> None:
        """After loading: the experts' runtime form."""

    def apply(self, moe: Any, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Route and run the experts (plus the shared expert) on x [T, hidden]."""


@runtime_checkable
class MHCMethod(Protocol):
    """Manifold-constrained hyper-connections: the residual streams around each sublayer."""

    batch_invariant: bool

    def pre(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> tuple:
        """Streams -> (sublayer input, post weights, combination matrix)."""

    def post(self, f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Sublayer output + streams -> streams."""

    def head(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Streams -> the final hidden state."""

    def pre_shifted(self, x: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                    base: torch.Tensor) -> tuple:
        """Shifted mHC (V4.1): streams -> (input collapsed with `pre_prev`, pre, post, comb)."""

    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Streams [T, hc, D] weighted by `pre` [T, hc] -> [T, D] (the shifted stack's end)."""


@runtime_checkable
class PrefillTruncation(Protocol):
    """V4.1 SWA bounded replay (hook deepinfer_prefill_truncation): in the YOCO consumer layers a
    prompt row at a position before `rectangle(prompt_len)` is never seen through a window, and in
    "compact" mode not computed."""

    mode: str            # "mask" | "compact"
    keep_tokens: int

    def rectangle(self, prompt_len: int) -> int:
        """The first prompt position the consumer layers' windows see (>= 0)."""


@runtime_checkable
class PointwiseMethod(Protocol):
    batch_invariant: bool
    reads_host_memory: bool     # gather_rows reads tables in pinned host memory (no copy, no sync)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def norm_rope_quant(self, x: torch.Tensor, positions: torch.Tensor, rope: Any, **kw: Any) -> torch.Tensor:
        """Normalise, rotate the RoPE dims and (QAT) round, fused."""

    def inverse_rope(self, x: torch.Tensor, positions: torch.Tensor, rope: Any) -> torch.Tensor: ...

    def gather_rows(self, table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Engram: rows [T, K] of an FP8 table [R, dim] with UE8M0 scales per 32 [R, dim/32],
        dequantised side by side -> [T, K*dim] fp32 on the rows' device."""


@runtime_checkable
class TokenSampler(Protocol):
    """deepinfer_sampler: one call per engine step for every sampled row."""

    batch_invariant: bool

    def sample(self, logits: torch.Tensor, params: Sequence[Any], positions: Any, seeds: Any) -> torch.Tensor:
        """[rows, vocab] fp32 logits -> [rows] int64 token ids on the logits' device."""


@dataclass
class ModelOps:
    """The op objects chosen once at start-up through the hooks (never per layer or per token)."""

    linear: dict[str, LinearMethod]        # weight format ("bf16", "fp8", "fp4") -> method
    attention: AttentionBackend
    moe: MoEMethod
    mhc: MHCMethod
    pointwise: PointwiseMethod


WEIGHT_FORMATS = ("bf16", "fp8", "fp4")


def members(contract: type) -> list[str]:
    """The attributes and methods a Protocol (and the protocols it extends) declares."""
    names: list[str] = []
    for klass in reversed(contract.__mro__):
        if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        names += [n for n in vars(klass).get("__annotations__", {}) if not n.startswith("_")]
        names += [n for n, v in vars(klass).items() if callable(v) and not n.startswith("_")]
    return list(dict.fromkeys(names))


def missing_members(obj: Any, contract: type) -> list[str]:
    return [n for n in members(contract) if not hasattr(obj, n)]


def check_contract(obj: Any, contract: type, what: str) -> Any:
    """`obj` if it has every member of `contract`, else a PluginError naming what is missing."""
    missing = missing_members(obj, contract)
    if missing:
        from .plugins import PluginError
        raise PluginError(f"{what} {type(obj).__module__}.{type(obj).__qualname__} does not implement "
                          f"{contract.__name__}: missing {', '.join(missing)} (deepinfer_core/contracts.py)")
    return obj


def resolve_model_ops(pm: Any, ctx: Any) -> ModelOps:
    """Ask the hooks for every op once and check each against its contract."""
    return ModelOps(
        linear={f: check_contract(pm.linear_method(ctx, f), LinearMethod, f"linear method ({f})")
                for f in WEIGHT_FORMATS},
        attention=check_contract(pm.attention_backend(ctx), AttentionBackend, "attention backend"),
        moe=check_contract(pm.moe_method(ctx), MoEMethod, "MoE method"),
        mhc=check_contract(pm.mhc_method(ctx), MHCMethod, "mHC method"),
        pointwise=check_contract(pm.pointwise_method(ctx), PointwiseMethod, "pointwise method"))


def resolve_sampler(pm: Any, ctx: Any) -> TokenSampler:
    return check_contract(pm.sampler(ctx), TokenSampler, "sampler")


class DraftProposer(Protocol):
    """A drafter from a plugin's `deepinfer_proposer` hook (e.g. DSpark), built by the factory the
    hook returns: `factory(model, num_drafts, temperatures)`. The speculator calls `observe` with
    every target forward of a step that drafts (the model's output: logits, streams, features) and
    `propose` for the sequences that draft, from the token each just committed (the anchor)."""

    num_drafts: int

    def observe(self, batch: Any, target: Any) -> None:
        """Take what the drafter needs of every row of a target forward."""

    def propose(self, anchors: torch.Tensor, anchor_positions: list[int], states: list, params: Any,
                seeds: Any) -> Any:
        """speculative.mtp.Drafts: num_drafts drafts per anchor (ids, q when sampled, confidences)."""

    # Optional: `use_graphs(max_seqs, pad_slot)`, called once when the runner's steps replay CUDA
    # graphs, so the drafter may replay graphs of its own for batches of up to max_seqs requests
    # (pad_slot: the cache's spare slot, which no sequence owns, for padding rows to write into).


@runtime_checkable
class DraftVerifier(Protocol):
    """deepinfer_verifier: the acceptance rule of speculative decoding. The core's
    (`ops/verify.py`) is lossless: exact greedy and standard speculative sampling."""

    exact_greedy: bool     # greedy rows follow the core's argmax rule, so greedy steps may be
                           # verified on the device by the core's own kernels (else the host path)

    def verify(self, target_logits: torch.Tensor, num_drafts: Sequence[int], draft_ids: torch.Tensor,
               draft_probs: torch.Tensor | None, params: Sequence[Any], positions: Sequence[int],
               seeds: Sequence[int]) -> Any:
        """An ops.verify.Verdict: drafts accepted per request and the token each adds. Request i's
        rows of `target_logits` are its num_drafts[i] + 1 verify rows, in request order;
        `draft_probs` (None when every request is greedy) the distributions the drafts were sampled
        from; `positions[i]` the position of request i's first draft; `seeds[i]` its seed."""


def resolve_scheduling(pm: Any, ctx: Any) -> tuple[SchedulingPolicy, DraftVerifier]:
    """The scheduling policy and the draft verifier, each checked against its contract."""
    return (check_contract(pm.scheduler_policy(ctx), SchedulingPolicy, "scheduler policy"),
            check_contract(pm.verifier(ctx), DraftVerifier, "verifier"))


def resolve_truncation(pm: Any, ctx: Any) -> PrefillTruncation | None:
    """The bounded replay `yoco_prefill_truncation_mode` asks for, or None for 'off'; a clear error
    when the model has no YOCO consumer layers or no installed plugin provides it."""
    mode = ctx.options.model.yoco_prefill_truncation_mode
    if mode == "off":
        return None
    cfg = ctx.model_config
    if cfg.n_prefill_layer >= cfg.num_hidden_layers:
        raise ValueError(f"yoco_prefill_truncation_mode={mode!r}: this model has no YOCO consumer layers "
                         "(no compress ratio 1: DeepSeek-V4.1 only); allowed: 'off'")
    found = pm.prefill_truncation(ctx)
    if found is None:
        raise ValueError(f"yoco_prefill_truncation_mode={mode!r} needs the swa_replay feature plugin "
                         "(package deepinfer-swa-replay: pip install ./features/swa_replay), which is not "
                         "installed or is disabled; allowed without it: 'off'")
    return check_contract(found, PrefillTruncation, "prefill truncation")


def resolve_proposer(pm: Any, ctx: Any) -> Any:
    """The proposer factory a plugin offers for this checkpoint, or None (the MTP block drafts)."""
    return pm.proposer(ctx)


# ---- the runner (the engine's side) --------------------------------------------------------------
class StepRunner(Protocol):
    """What the engine's step executor needs of a runner (runner/model_runner.py; test fakes)."""

    model_config: Any
    device: Any
    last_token: torch.Tensor       # [slots] int64 on the device: the newest sampled token per slot

    def execute(self, batch: Any) -> torch.Tensor:
        """`batch`: an engine.step_executor.StepBatch. Apply `batch.updates`, run the forward;
        fp32 logits [len(batch.logit_rows), vocab]."""


@runtime_checkable
class EngineRunner(StepRunner, Protocol):
    """What `LLM` needs of a runner besides the steps: the ops it resolved and its state cache."""

    sampler: TokenSampler
    logits_processors: list        # engine/constraints.py LogitsProcessor objects
    scheduler_policy: SchedulingPolicy | None    # None: first come, first served
    profile_tokens: int | None     # the largest step the cache's sizing must leave room for
    checkpoint_slots: int          # of the allocated cache's slots, those for prefix checkpoints

    def allocate_cache(self, request: Any) -> Any:
        """Size the state cache for a CacheRequest (again only when it changed); the result has
        `.allocator` (cache/block_allocator.py BlockAllocator) and, for prefix caching,
        `.layout.block_size`; a slot's state is copied by `batch.updates.saves`/`restores`."""

    def make_speculator(self) -> Any:
        """A speculative/engine_step.Speculator when the runner drafts (num_speculative_tokens > 0),
        else None."""
