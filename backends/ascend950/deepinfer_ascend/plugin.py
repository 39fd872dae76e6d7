"""Ascend backend plugin (entry point `ascend` in `deepinfer.backends`).

Detection is import-light on purpose (it runs in every process): it looks for the NPU device node
only and never imports torch_npu. When the `ascend` platform is chosen, `deepinfer_configure` starts
the runtime once (runtime.py: environment defaults, `import torch_npu`, the SoC); each failure is
one line naming what is missing. It then builds the op table once (op_table.py) from the SoC, the
compute dtype and the model config; the op hooks return that table's objects, or None where the
core's portable op runs (on the NPU, as plain torch).
"""
from __future__ import annotations

import logging

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import probe_platform

from . import detect

log = logging.getLogger("deepinfer.ascend")

NAME = "ascend"
STATUS = "partial"
NOTE = ("RMSNorm/RoPE on npu_rms_norm/npu_rotary_mul; on A5 FP8 linears as MXFP8 "
        "npu_quant_matmul, mHC on npu_mhc_*, MoE experts on npu_moe_init_routing_v2 / "
        "npu_grouped_matmul / npu_moe_token_unpermute (EP: the rank's slots), V4 attention on "
        "npu_sparse_flash_attention / npu_lightning_indexer with aclgraph decode; MoE routing and "
        "sampling on the core's portable ops; tested on a simulated torch_npu only, never run on "
        "Ascend hardware")
PROBE_PATHS = detect.NPU_PROBE_PATHS   # tests may replace this tuple


def __getattr__(name: str):
    # DEEPINFER_PLUGIN_INFO is computed when read, so `deepinfer plugins` says why the backend is
    # or is not usable on this machine (import-light: device nodes and installed metadata only).
    if name == "DEEPINFER_PLUGIN_INFO":
        return {"status": STATUS, "note": f"{NOTE}; {detect.machine_summary(PROBE_PATHS)}"}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device_type(device) -> str:
    """"npu:0" -> "npu" without torch.device (which knows "npu" only once torch_npu renamed
    PrivateUse1). deepinfer_core.device_module has the same function but imports torch, which
    this module must not (detection stays import-light)."""
    return getattr(device, "type", None) or str(device).split(":")[0]


@hookimpl
def deepinfer_detect_platform(requested):
    # PROBE_PATHS is read at call time so tests can replace it
    return probe_platform(requested, NAME, "npu", PROBE_PATHS, "Ascend NPU",
                          "Ascend NPU (torch_npu)")


@hookimpl
def deepinfer_configure(ctx):
    if ctx.platform.name != NAME:
        return
    # As DS-DeepInfer asserts: its batch-invariant kernels are NVIDIA only, and so are ours.
    if getattr(ctx, "batch_invariant", False):
        raise ValueError("DEEPINFER_BATCH_INVARIANT=1 (batch_invariant=True) is not supported on "
                         "the Ascend backend: batch-invariant kernels exist for the nvidia and cpu "
                         "platforms only; unset DEEPINFER_BATCH_INVARIANT")
    from . import op_table, runtime
    rt = runtime.start()
    device = device_type(ctx.device)
    if device == rt.device_type:
        log.info("ascend op table: %s", op_table.table_for(rt, ctx).summary())
    elif device != "cpu":
        raise ValueError(f"device={ctx.device!r} on the ascend platform; allowed: "
                         f"{rt.device_type!r} (the NPU) or 'cpu' (the core's portable ops on the "
                         "host)")


def _table(ctx):
    """The op table of this build context, or None where the core's ops run (another platform, or
    the host CPU as device)."""
    if ctx.platform.name != NAME:
        return None
    from . import op_table, runtime
    rt = runtime.start()
    if device_type(ctx.device) != rt.device_type:
        return None
    return op_table.table_for(rt, ctx)


@hookimpl
def deepinfer_pointwise_method(ctx):
    table = _table(ctx)
    return table.pointwise if table else None


@hookimpl
def deepinfer_linear_method(ctx, weight_format):
    table = _table(ctx)
    return table.linear.get(weight_format) if table else None


@hookimpl
def deepinfer_mhc_method(ctx):
    table = _table(ctx)
    return table.mhc if table else None


@hookimpl
def deepinfer_moe_method(ctx):
    table = _table(ctx)
    return table.moe if table else None


@hookimpl
def deepinfer_attention_backend(ctx):
    table = _table(ctx)
    return table.attention if table else None
