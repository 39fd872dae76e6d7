"""DeepInfer: an inference engine for the DeepSeek-V4 model family.

Public API: `LLM`, `SamplingParams`, `StructuredOutputsParams`, `RequestOutput`, `CompletionOutput`,
`Logprob`, `InvalidRequestError`.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "InvalidRequestError", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import deepinfer_core` (e.g. for plugin discovery) stays import-light.
    if name == "LLM":
        from .api.llm import LLM
        return LLM
    if name == "SamplingParams":
        from .api.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from .api.structured_outputs import StructuredOutputsParams
        return StructuredOutputsParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "InvalidRequestError"):
        from .api import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'deepinfer_core' has no attribute {name!r}")
