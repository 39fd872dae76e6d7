"""NVIDIA backend plugin. Skeleton: it claims the platform; every op still comes from the core.

Detection is import-light on purpose (it runs in every process): it looks at the driver's procfs
entry and device node only, never at torch.cuda, so no CUDA context is created.
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import probe_platform

NAME = "nvidia"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "platform detection only; SM100 kernels (attention, MoE, FP8/FP4 GEMM) land in a "
            "later issue, the core's portable ops run meanwhile",
}
# Either path means a loaded NVIDIA kernel driver (tests may replace this tuple).
PROBE_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidia0")


@hookimpl
def deepinfer_detect_platform(requested):
    # PROBE_PATHS is read at call time so tests can replace it
    return probe_platform(requested, NAME, "cuda", PROBE_PATHS, "NVIDIA driver", "NVIDIA GPU (skeleton backend: portable ops)")
