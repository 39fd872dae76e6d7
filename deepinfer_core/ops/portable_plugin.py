"""The core's portable PyTorch implementation of every hook (lowest priority: trylast)."""
from __future__ import annotations

from ..hookspecs import hookimpl
from ..plugin_context import Platform

NAME = "core"


@hookimpl(trylast=True)
def deepinfer_detect_platform(requested):
    if requested in (None, "cpu"):
        return Platform(name="cpu", device_type="cpu", plugin=NAME, description="portable PyTorch (CPU)")
    return None
