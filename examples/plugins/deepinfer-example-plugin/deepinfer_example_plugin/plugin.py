"""The module the `banned_words` entry point names: what the plugin manager registers.

It must stay import-light (discovery imports it in every process, `python -m
deepinfer_core.plugins` too): the processor, and torch with it, is imported when the engine starts.
"""
from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl

# Shown by `python -m deepinfer_core.plugins` beside the plugin's status.
DEEPINFER_PLUGIN_INFO = {
    "status": "example",
    "note": "extra_args banned_words: forbids words and phrases per request",
}


@hookimpl
def deepinfer_logits_processors(ctx):
    """One processor per engine; it claims the requests whose extra_args name banned_words."""
    from .processor import BannedWordsProcessor
    return [BannedWordsProcessor()]
