"""The core's portable PyTorch implementation of every hook, at the lowest priority (trylast).

Registered by the plugin manager exactly like an external plugin; any backend that answers a hook
wins over these.
"""
from __future__ import annotations

from ..hookspecs import hookimpl
from ..plugin_context import BuildContext, Platform

NAME = "core"


@hookimpl(trylast=True)
def deepinfer_detect_platform(requested):
    if requested in (None, "cpu"):
        return Platform(name="cpu", device_type="cpu", plugin=NAME, description="portable PyTorch (CPU)")
    return None


@hookimpl(trylast=True)
def deepinfer_linear_method(ctx: BuildContext, weight_format: str):
    from .portable_linear import PortableLinearMethod
    return PortableLinearMethod(ctx.torch_dtype, ctx.simulate_qat, ctx.model_config.weight_block_size or (128, 128))


@hookimpl(trylast=True)
def deepinfer_attention_backend(ctx: BuildContext):
    from .portable_attention import PortableAttentionBackend
    return PortableAttentionBackend(official=ctx.simulate_qat)


@hookimpl(trylast=True)
def deepinfer_moe_method(ctx: BuildContext):
    from .portable_moe import PortableMoE
    return PortableMoE()


@hookimpl(trylast=True)
def deepinfer_mhc_method(ctx: BuildContext):
    from .portable_mhc import PortableMHC
    c = ctx.model_config
    return PortableMHC(c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, ctx.simulate_qat)


@hookimpl(trylast=True)
def deepinfer_pointwise_method(ctx: BuildContext):
    from .portable_pointwise import PortablePointwise
    return PortablePointwise(official=ctx.simulate_qat)


@hookimpl(trylast=True)
def deepinfer_sampler(ctx: BuildContext):
    from .sampler import Sampler
    return Sampler()


@hookimpl(trylast=True)
def deepinfer_scheduler_policy(ctx: BuildContext):
    from ..engine.scheduler import FirstComeFirstServed
    return FirstComeFirstServed()


@hookimpl(trylast=True)
def deepinfer_verifier(ctx: BuildContext):
    from .verify import ExactVerifier
    return ExactVerifier()
