"""Which batch-invariant op replaces which backend op.

`invariant_op(kind, op, ctx)` returns, in this order of preference:
1. `op` itself when it declares `batch_invariant = True` (a third-party backend's invariant op);
2. `op.batch_invariant_variant()` when the op offers one (the protocol for third-party backends);
3. the variant this package has for the op's exact class (the core's portable ops; the portable
   pointwise ops and sampler compute every row on its own and declare `batch_invariant = True`);
and raises `PluginError` naming the op and the plugin otherwise, so no op is silently left variant.
"""
from __future__ import annotations

from typing import Any, Callable

from deepinfer_core.plugins import PluginError


def _cpu_linear(op):
    from .portable_ops import InvariantPortableLinear
    return InvariantPortableLinear(op.dtype, op.simulate_qat, op.block)


def _cpu_moe(op):
    from .portable_ops import InvariantPortableMoE
    return InvariantPortableMoE()


def _cpu_mhc(op):
    from .portable_ops import InvariantPortableMHC
    return InvariantPortableMHC(op.hc, op.iters, op.hc_eps, op.norm_eps, op.official)


def _cpu_attention(op):
    from .portable_ops import InvariantPortableAttention
    return InvariantPortableAttention(op.official)


VARIANTS: dict[str, Callable[[Any], Any]] = {
    "deepinfer_core.ops.portable_linear.PortableLinearMethod": _cpu_linear,
    "deepinfer_core.ops.portable_moe.PortableMoE": _cpu_moe,
    "deepinfer_core.ops.portable_mhc.PortableMHC": _cpu_mhc,
    "deepinfer_core.ops.portable_attention.PortableAttentionBackend": _cpu_attention,
}
# The nvidia backend's ops implement the protocol themselves (`batch_invariant_variant()` or
# `batch_invariant = True`): fixed GEMM tiles and split-K from the weight shape, fixed MoE tiles,
# fixed attention tiles and split size.


def class_path(op: Any) -> str:
    cls = type(op)
    return f"{cls.__module__}.{cls.__qualname__}"


def invariant_op(kind: str, op: Any, ctx: Any) -> Any:
    if getattr(op, "batch_invariant", False):
        return op
    variant = getattr(op, "batch_invariant_variant", None)
    if callable(variant):
        return variant()
    path = class_path(op)
    make = VARIANTS.get(path)
    if make is None:
        raise PluginError(
            f"DEEPINFER_BATCH_INVARIANT=1: the {kind} {path} (platform {ctx.platform.name!r}) has no "
            f"batch-invariant version; give it `batch_invariant = True` if it already is, or a "
            f"`batch_invariant_variant()` method, or turn batch invariance off")
    return make(op)
