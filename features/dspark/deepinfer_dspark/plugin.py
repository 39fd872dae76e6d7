"""Feature plugin `dspark`: registered skeleton, it implements no model hooks yet."""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

NAME = "dspark"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "not implemented yet (the engine drafts with the MTP block only): DSpark drafter, confidence-scheduled verification",
}


@hookimpl
def deepinfer_configure(ctx):
    # Nothing to validate until the feature exists; present so the registration path is exercised.
    return None
