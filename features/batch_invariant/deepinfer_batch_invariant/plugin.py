"""Feature plugin `batch_invariant`: with DEEPINFER_BATCH_INVARIANT=1 (or `LLM(batch_invariant=True)`)
a request's logits and tokens are bitwise the same whatever else shares its batch, however its prefill
is chunked and wherever it sits in the batch. With DEEPINFER_ENABLE_MTP_VARLEN=0 and a fixed seed that
is deterministic sampling (the sampler's counter-based RNG is already a pure function of the seed and
the position).

It wraps (pluggy `wrapper=True`) every op hook: whatever op object the backend chose is replaced by its
batch-invariant version (`variants.invariant_op`). Ops that have none are an error at start-up, never
a silent fallback. Incompatible settings are refused in `deepinfer_configure`. (DEEPINFER_ENABLE_MTP_VARLEN=1
is one, since variable-length verification picks each step's draft length from the load; the engine
config refuses the pair.)
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

NAME = "batch_invariant"
DEEPINFER_PLUGIN_INFO = {
    "status": "ready",
    "note": "batch-invariant GEMMs, MoE, mHC, attention and indexer for the cpu and nvidia backends "
            "(DEEPINFER_BATCH_INVARIANT=1)",
}
SUPPORTED_PLATFORMS = ("cpu", "nvidia")


@hookimpl
def deepinfer_configure(ctx):
    if not getattr(ctx, "batch_invariant", False):
        return
    if ctx.platform.name not in SUPPORTED_PLATFORMS:
        raise ValueError(
            f"DEEPINFER_BATCH_INVARIANT=1 (batch_invariant=True) is not supported on platform "
            f"{ctx.platform.name!r} (plugin {ctx.platform.plugin!r}); supported platforms: "
            f"{', '.join(SUPPORTED_PLATFORMS)}. Unset DEEPINFER_BATCH_INVARIANT or pick another "
            f"DEEPINFER_ACCELERATOR")


def _wrap(kind: str, ctx, result):
    if result is None or not getattr(ctx, "batch_invariant", False):
        return result
    from .variants import invariant_op
    return invariant_op(kind, result, ctx)


@hookimpl(wrapper=True)
def deepinfer_linear_method(ctx, weight_format):
    return _wrap(f"linear method for {weight_format!r} weights", ctx, (yield))


@hookimpl(wrapper=True)
def deepinfer_attention_backend(ctx):
    return _wrap("attention backend", ctx, (yield))


@hookimpl(wrapper=True)
def deepinfer_moe_method(ctx):
    return _wrap("MoE method", ctx, (yield))


@hookimpl(wrapper=True)
def deepinfer_mhc_method(ctx):
    return _wrap("mHC method", ctx, (yield))


@hookimpl(wrapper=True)
def deepinfer_pointwise_method(ctx):
    return _wrap("pointwise method", ctx, (yield))


@hookimpl(wrapper=True)
def deepinfer_sampler(ctx):
    return _wrap("sampler", ctx, (yield))
