"""Ascend 950 backend plugin. Skeleton: it claims the platform; every op still comes from the core.

Detection is import-light on purpose (it runs in every process): it looks for the NPU device
node only and never imports torch_npu.
"""
from __future__ import annotations

import os

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_context import Platform

NAME = "ascend"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "platform detection only; torch_npu fused operators land in a later issue "
            "(see spec ascend.md), the core's portable ops run meanwhile",
}
PROBE_PATHS = ("/dev/davinci0",)   # tests may replace this tuple


def npu_present() -> bool:
    return any(os.path.exists(path) for path in PROBE_PATHS)


@hookimpl
def deepinfer_detect_platform(requested):
    if requested not in (None, NAME):
        return None
    if not npu_present():
        if requested == NAME:
            raise RuntimeError(
                "DEEPINFER_ACCELERATOR=ascend but no Ascend NPU was found (none of "
                f"{', '.join(PROBE_PATHS)} exists); unset DEEPINFER_ACCELERATOR or set it to cpu")
        return None
    return Platform(name=NAME, device_type="npu", plugin=NAME,
                    description="Ascend 950 NPU (skeleton backend: portable ops)")
