"""The public dataclasses that hooks receive and return (plugins see nothing else of the core)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import ModelConfig


@dataclass(frozen=True)
class Platform:
    """A hardware platform chosen by `deepinfer_detect_platform`."""

    name: str                 # "cpu", "nvidia", "ascend", or a third-party name
    device_type: str          # torch device type: "cpu", "cuda", "npu", ...
    plugin: str = "core"      # name of the plugin that provided it
    description: str = ""


@dataclass
class BuildContext:
    """Everything a hook needs to choose an implementation, resolved once at start-up."""

    model_config: ModelConfig
    platform: Platform
    device: str = "cpu"
    dtype: str = "float32"            # compute dtype: "float32" | "bfloat16"
    simulate_qat: bool = True         # reference QAT numerics (FP8/FP4 fake-quant) on/off
    batch_invariant: bool = False
    options: dict[str, Any] = field(default_factory=dict)   # remaining engine options

    @property
    def torch_dtype(self):
        import torch
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]
