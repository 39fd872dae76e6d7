"""NVIDIA backend plugin. Skeleton: it claims the platform; every op still comes from the core.

Detection is import-light on purpose (it runs in every process): it looks at the driver's procfs
entry and device node only, never at torch.cuda, so no CUDA context is created.
"""
from __future__ import annotations

import os

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import Platform

NAME = "nvidia"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "platform detection only; SM100 kernels (attention, MoE, FP8/FP4 GEMM) land in a "
            "later issue, the core's portable ops run meanwhile",
}
# Either path means a loaded NVIDIA kernel driver (tests may replace this tuple).
PROBE_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidia0")


def driver_present() -> bool:
    return any(os.path.exists(path) for path in PROBE_PATHS)


@hookimpl
def deepinfer_detect_platform(requested):
    if requested not in (None, NAME):
        return None
    if not driver_present():
        if requested == NAME:
            raise RuntimeError(
                "DEEPINFER_ACCELERATOR=nvidia but no NVIDIA driver was found (none of "
                f"{', '.join(PROBE_PATHS)} exists); unset DEEPINFER_ACCELERATOR or set it to cpu")
        return None
    return Platform(name=NAME, device_type="cuda", plugin=NAME,
                    description="NVIDIA GPU (skeleton backend: portable ops)")
