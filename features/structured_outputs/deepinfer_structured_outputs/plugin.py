"""Feature plugin `structured_outputs`: registered skeleton, it implements no model hooks yet."""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

NAME = "structured_outputs"
DEEPINFER_PLUGIN_INFO = {
    "status": "skeleton",
    "note": "filled by the structured-outputs issue (so_args, grammar logits processor)",
}


@hookimpl
def deepinfer_configure(ctx):
    # Nothing to validate until the feature exists; present so the registration path is exercised.
    return None
