"""The torch module of a device type (`torch.cuda`, `torch.npu` once torch_npu is imported,
`torch.xpu`): where the core asks an accelerator for its memory and places data-parallel ranks,
without naming CUDA.

Looked up with `getattr(torch, type)` on every call rather than `torch.get_device_module`: that
one parses the device with `torch.device` (which knows "npu" only once torch_npu has renamed
PrivateUse1) and caches its answer for the process (a module installed later, e.g. the tests'
simulated torch_npu, would not be seen).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
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


# how messages name one device of a type, and the variable that hides devices from a process
_RANK_UNITS = {"cuda": ("GPU", "CUDA_VISIBLE_DEVICES"), "npu": ("NPU", "ASCEND_RT_VISIBLE_DEVICES")}


@dataclass(frozen=True)
class RankDevices:
    """The accelerators data-parallel ranks run on, one device per rank: local rank r of a node on
    device r of its type, through the type's torch module (torch.cuda, torch.npu). Resolved once
    by `rank_devices` (the front end to check the count, each rank to take its device)."""

    type: str                    # "cuda", "npu"
    module: types.ModuleType     # torch.<type>
    unit: str                    # what messages call one device: "GPU", "NPU"
    visible: str                 # what limits the devices a process sees: CUDA_VISIBLE_DEVICES, ...

    def count(self) -> int:
        """Devices of this type this process sees."""
        return int(self.module.device_count())

    def device(self, local_rank: int) -> torch.device:
        """The device of local rank `local_rank`: torch.device("npu", 1) for local rank 1."""
        return torch.device(self.type, local_rank)

    def bind(self, local_rank: int) -> None:
        """In the rank's own process, before its first device work: its device becomes the
        current one (so the config's bare type, "cuda" or "npu", means this rank's device)."""
        self.module.set_device(local_rank)


def rank_devices(device: Any) -> RankDevices | None:
    """How ranks of `device`'s type are placed: None for the CPU (ranks share the host's cores);
    ValueError for a type whose torch module is missing or cannot count and select devices."""
    kind = device_type(device)
    if kind == "cpu":
        return None
    module = device_module(kind)
    missing = [f for f in ("device_count", "set_device") if not hasattr(module, f)]
    if module is None or missing:
        why = (f"torch.{kind} has no {' or '.join(missing)}" if module is not None else
               f"this process has no torch.{kind} (a device's torch extension adds it when "
               "imported: torch_npu adds torch.npu)")
        raise ValueError(f"device={str(device)!r}: data-parallel ranks need one device each, "
                         f"chosen through the device type's torch module; {why}")
    unit, visible = _RANK_UNITS.get(kind, (f"{kind} device", f"torch.{kind}.device_count()"))
    return RankDevices(kind, module, unit, visible)
