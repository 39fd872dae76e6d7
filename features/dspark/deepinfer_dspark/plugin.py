"""Feature plugin `dspark`: drafts with a checkpoint's DSpark stages (`deepinfer_proposer`).

The core loads DSpark checkpoints (model/dspark.py: the stages under `mtp.*`, the target-feature
capture in the forward) and verifies drafts; this plugin supplies the drafter (drafter.py) when the
checkpoint's config has `dspark_*` keys. Without the plugin such a checkpoint is served without
speculation.
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

NAME = "dspark"
DEEPINFER_PLUGIN_INFO = {
    "status": "partial",
    "note": "DSpark drafter for checkpoints with dspark_* keys (the target's steps graphed; the drafter's "
            "observe steps and drafts graphed, sampled draws eager, portable attention), calibration "
            "tool (deepinfer_dspark.calibrate)",
}


@hookimpl
def deepinfer_proposer(ctx):
    """A factory `(model, num_drafts, temperatures) -> drafter` for a DSpark checkpoint, else None."""
    if ctx.model_config.dspark is None:
        return None
    from .drafter import DSparkDrafter
    return DSparkDrafter
