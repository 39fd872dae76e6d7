"""Every DeepInfer hook spec.

Hooks choose *objects* once, at engine start; the hot path then calls those objects directly.
Nothing on the per-layer or per-token path calls pluggy. The core's portable PyTorch
implementations (`deepinfer_core.ops.portable_plugin`) register through these same hooks with
`trylast=True`; a backend wins with a plain or `tryfirst` implementation, and a feature may wrap
(`wrapper=True`) a backend's choice.

`ctx` is a `deepinfer_core.plugin_context.BuildContext` (model config, engine options, platform,
device, dtype, simulate_qat, batch_invariant).

Batch invariance (`ctx.batch_invariant`): the batch_invariant feature wraps the op hooks and swaps each
chosen op for its invariant version; a backend's op takes part by declaring `batch_invariant = True`
(it already is) or offering `batch_invariant_variant()` (features/batch_invariant/.../variants.py).
"""
from __future__ import annotations

import pluggy

PROJECT_NAME = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---- platform -------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def deepinfer_detect_platform(requested: str | None):
    """Return a `Platform` if this plugin's hardware is present (or `requested` names it), else None.

    Called once per process. Must be import-light: no CUDA initialisation, no heavy imports.
    `requested` is DEEPINFER_ACCELERATOR (`nvidia`, `ascend`, `cpu`) or None for auto-detection.
    """


# ---- configuration --------------------------------------------------------------------------------
@hookspec
def deepinfer_configure(ctx):
    """Validate and adjust the build context once, before anything is built.

    Features refuse incompatible combinations here by raising `ValueError` naming both settings.
    Every implementation is called (not firstresult).
    """


# ---- model ops --------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def deepinfer_linear_method(ctx, weight_format: str):
    """Return the `LinearMethod` for weights of `weight_format` ("bf16", "fp8", "fp4").

    The object prepares the layer's weights once after loading (`process_weights`) and computes
    `apply(layer, x)`; it owns the activation fake-quant of the QAT simulation.
    """


@hookspec(firstresult=True)
def deepinfer_attention_backend(ctx):
    """Return the `AttentionBackend`: window (SWA) + compressed-sparse (CSA, with the lightning
    indexer) + heavily-compressed (HCA) attention with the learned sink, plus the KV compressor
    and indexer scoring/top-k over the state cache."""


@hookspec(firstresult=True)
def deepinfer_moe_method(ctx):
    """Return the `MoEMethod`: routing (score/hash), expert dispatch, expert compute, and combine."""


@hookspec(firstresult=True)
def deepinfer_pointwise_method(ctx):
    """Return the `PointwiseMethod`: the memory-bound glue between the GEMMs (RMSNorm; the query and
    KV norm + RoPE + KV fake-quant; compressed-row finalize; the indexer's query transform; the
    inverse RoPE of the attention output), which a backend fuses into few passes over memory."""


@hookspec(firstresult=True)
def deepinfer_mhc_method(ctx):
    """Return the `MHCMethod`: hyper-connection pre (norm, projection, Sinkhorn), post and head."""


# ---- engine policies ------------------------------------------------------------------------------
@hookspec(firstresult=True)
def deepinfer_sampler(ctx):
    """Return the `Sampler` that turns processed logits into token ids (greedy, temperature,
    top-k/top-p/min-p, the seeded counter-based RNG)."""


@hookspec
def deepinfer_logits_processors(ctx):
    """Return a list of `LogitsProcessor`s (interface: `deepinfer_core/engine/constraints.py`) that
    constrain the requests they claim (structured outputs claim `so_args`). Results of every
    implementation are collected and concatenated. A processor prepares a request once at
    submission and masks the logits of all its requests' sampled rows once per step, on the
    device, before logprobs and sampling."""


@hookspec(firstresult=True)
def deepinfer_scheduler_policy(ctx):
    """Return the `SchedulingPolicy`: the order in which waiting requests are admitted (the core's:
    first come, first served). Budgets, cache capacity and preemption stay the scheduler's."""


@hookspec(firstresult=True)
def deepinfer_proposer(ctx):
    """Return a drafter factory `factory(model, num_drafts, temperatures) -> DraftProposer` for this
    checkpoint (DSpark), or None: the checkpoint's MTP block drafts (when speculation is on)."""


@hookspec(firstresult=True)
def deepinfer_prefill_truncation(ctx):
    """V4.1 SWA bounded replay: the `PrefillTruncation` (contracts.py) the options ask for
    (`yoco_prefill_truncation_mode` 'mask' or 'compact'), or None. Called once at start-up, only
    when a mode other than 'off' is set; raise ValueError for options the model cannot take."""


@hookspec(firstresult=True)
def deepinfer_verifier(ctx):
    """Return the `DraftVerifier`: the acceptance rule of draft tokens (the core's is lossless:
    exact greedy, standard speculative sampling). How many drafts a step verifies is the engine's
    (`enable_mtp_varlen`)."""
