"""The public dataclasses that hooks receive and return (plugins see nothing else of the core)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import ModelConfig
from .engine_config import EngineConfig


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
    options: EngineConfig = field(default_factory=EngineConfig)   # every engine option, resolved

    @property
    def torch_dtype(self):
        import torch
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


class PluginError(RuntimeError):
    """A plugin could not provide what the engine needs."""


class PlatformError(PluginError):
    """No (or more than one) platform matches the request."""


def probe_platform(requested: str | None, name: str, device_type: str, probe_paths: tuple[str, ...],
                   hardware: str, description: str) -> Platform | None:
    """Import-light platform detection for backends: procfs / device nodes only, no CUDA init.

    Returns the Platform when one of `probe_paths` exists and `requested` is None or `name`; None when
    another platform was requested or the hardware is absent; raises when `name` was requested
    explicitly but the hardware is missing.
    """
    import os

    if requested not in (None, name):
        return None
    if not any(os.path.exists(p) for p in probe_paths):
        if requested == name:
            raise PlatformError(
                f"DEEPINFER_ACCELERATOR={name} but no {hardware} was found (none of {', '.join(probe_paths)} "
                f"exists); unset DEEPINFER_ACCELERATOR or set it to cpu")
        return None
    return Platform(name=name, device_type=device_type, plugin=name, description=description)
