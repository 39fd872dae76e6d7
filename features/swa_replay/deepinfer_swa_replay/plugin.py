"""Feature plugin `swa_replay`: registered skeleton, it implements no model hooks yet."""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

NAME = "swa_replay"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "not implemented yet: V4.1 SWA bounded replay (YOCO prefill truncation)",
}


@hookimpl
def deepinfer_configure(ctx):
    # Nothing to validate until the feature exists; present so the registration path is exercised.
    return None
