"""The torch module of a device type (`torch.cuda`, `torch.npu` once torch_npu is imported,
`torch.xpu`): where the core asks an accelerator for its memory, without naming CUDA.

Looked up with `getattr(torch, type)` on every call rather than `torch.get_device_module`: that
one parses the device with `torch.device` (which knows "npu" only once torch_npu has renamed
PrivateUse1) and caches its answer for the process (a module installed later, e.g. the tests'
simulated torch_npu, would not be seen).
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch


def device_type(device: Any) -> str:
    """"npu:0" -> "npu", torch.device("cuda", 1) -> "cuda", without parsing through torch.device."""
    return getattr(device, "type", None) or str(device).split(":")[0]


def device_module(device: Any) -> types.ModuleType | None:
    """`torch.<type>` of an accelerator device; None for the CPU or a type torch has no module for
    (torch.npu is there only after `import torch_npu`)."""
    kind = device_type(device)
    return None if kind == "cpu" else getattr(torch, kind, None)


def memory_query(device: Any) -> Callable[[Any], tuple[int, int]] | None:
    """The device module's `mem_get_info` ((free, total) bytes; it takes the device as given:
    torch.cuda turns "cuda", "cuda:1" or a torch.device into the index itself); None for the CPU
    and for devices whose module has no such query (mps, meta: their budget is the host's)."""
    return getattr(device_module(device), "mem_get_info", None)


def peak_memory_bytes(device: Any, run: Callable[..., Any], *args: Any) -> int:
    """Peak device memory `run(*args)` allocates above what was allocated before it (the device's
    module: synchronize, reset_peak_memory_stats, memory_allocated, max_memory_allocated); the
    caller frees what it no longer needs, then calls the module's `empty_cache`."""
    module = device_module(device)
    if module is None:
        raise ValueError(f"device={str(device)!r}: peak memory is measured on an accelerator "
                         f"with a torch module (torch.cuda, torch.npu, ...); torch has none for "
                         f"{device_type(device)!r}")
    module.synchronize()
    module.reset_peak_memory_stats()
    base = module.memory_allocated()
    run(*args)
    module.synchronize()
    return int(module.max_memory_allocated() - base)
