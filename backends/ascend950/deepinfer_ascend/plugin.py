"""Ascend 950 backend plugin. Skeleton: it claims the platform; every op still comes from the core.

Detection is import-light on purpose (it runs in every process): it looks for the NPU device
node only and never imports torch_npu.
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import probe_platform

NAME = "ascend"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "platform detection only (no torch_npu operators yet); the core's portable ops run "
            "meanwhile",
}
PROBE_PATHS = ("/dev/davinci0",)   # tests may replace this tuple


@hookimpl
def deepinfer_detect_platform(requested):
    # PROBE_PATHS is read at call time so tests can replace it
    return probe_platform(requested, NAME, "npu", PROBE_PATHS, "Ascend NPU", "Ascend 950 NPU (skeleton backend: portable ops)")


@hookimpl
def deepinfer_configure(ctx):
    # As DS-DeepInfer asserts: its batch-invariant kernels are NVIDIA only, and so are ours.
    if ctx.platform.name == NAME and getattr(ctx, "batch_invariant", False):
        raise ValueError("DEEPINFER_BATCH_INVARIANT=1 (batch_invariant=True) is not supported on the Ascend "
                         "backend: batch-invariant kernels exist for the nvidia and cpu platforms only; unset "
                         "DEEPINFER_BATCH_INVARIANT")
