"""Feature plugin `structured_outputs`: grammar-constrained decoding from so_args (xgrammar).

It answers `deepinfer_logits_processors` with one `StructuredOutputProcessor` per engine; the core
hands it every request with so_args at submission and calls its batch mask/advance once per step.
xgrammar is imported on the first structured request, so engines that never see one pay nothing.
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

NAME = "structured_outputs"
DEEPINFER_PLUGIN_INFO = {
    "status": "ready",
    "note": "so_args / structured_outputs: JSON schema, regex, EBNF (xgrammar); triggers and bound tokens",
}


@hookimpl
def deepinfer_logits_processors(ctx):
    from .processor import StructuredOutputProcessor
    return [StructuredOutputProcessor()]
