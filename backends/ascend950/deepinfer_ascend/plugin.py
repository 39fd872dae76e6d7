"""Ascend backend plugin (entry point `ascend` in `deepinfer.backends`).

Detection is import-light on purpose (it runs in every process): it looks for the NPU device node
only and never imports torch_npu. When the `ascend` platform is chosen, `deepinfer_configure` starts
the runtime once (runtime.py: environment defaults, `import torch_npu`, the SoC); each failure is
one line naming what is missing.
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import probe_platform

from . import detect

NAME = "ascend"
STATUS = "skeleton"
NOTE = ("start-up (torch_npu import, SoC check); no torch_npu operators yet, the core's portable "
        "ops run; never run on Ascend hardware")
PROBE_PATHS = detect.NPU_PROBE_PATHS   # tests may replace this tuple


def __getattr__(name: str):
    # DEEPINFER_PLUGIN_INFO is computed when read, so `deepinfer plugins` says why the backend is
    # or is not usable on this machine (import-light: device nodes and installed metadata only).
    if name == "DEEPINFER_PLUGIN_INFO":
        return {"status": STATUS, "note": f"{NOTE}; {detect.machine_summary(PROBE_PATHS)}"}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device_type(device) -> str:
    """"npu:0" -> "npu" without torch.device (which knows "npu" only once torch_npu renamed
    PrivateUse1)."""
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
    from . import runtime
    rt = runtime.start()
    device = device_type(ctx.device)
    if device not in (rt.device_type, "cpu"):
        raise ValueError(f"device={ctx.device!r} on the ascend platform; allowed: "
                         f"{rt.device_type!r} (the NPU) or 'cpu' (the core's portable ops on the "
                         "host)")
