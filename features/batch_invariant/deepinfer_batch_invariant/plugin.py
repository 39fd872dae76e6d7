"""Feature plugin `batch_invariant`: registered skeleton, it implements no model hooks yet."""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

NAME = "batch_invariant"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "filled by the batch-invariance / deterministic-sampling issue (spec deepinfer_surface.md section 7)",
}


@hookimpl
def deepinfer_configure(ctx):
    # Nothing to validate until the feature exists; present so the registration path is exercised.
    return None
