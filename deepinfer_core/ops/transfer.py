"""Host lists to device tensors, and device tensors to the host, without stalling the host.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the stream
to drain: one hidden host sync per call, which serialises the host with every kernel queued before.
Staging through pinned memory makes the copy asynchronous (torch's pinned-memory cache keeps the
staging buffer alive until the copy has run).
"""
from __future__ import annotations

from typing import Sequence

import torch


def _staged(values: Sequence, dtype: torch.dtype, device) -> torch.Tensor:
    """The values on the host, in pinned memory when they are headed for an accelerator."""
    host = torch.tensor(values, dtype=dtype)
    return host if torch.device(device).type == "cpu" else host.pin_memory()


def to_device(values: Sequence, dtype: torch.dtype, device) -> torch.Tensor:
    host = _staged(values, dtype, device)
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)


def to_device_parts(parts: Sequence[Sequence[int]], device) -> list[torch.Tensor]:
    """int64 `parts` in one host->device copy, each part's view starting 16-byte aligned: Triton
    compiles a kernel variant per pointer alignment, so a part packed right after an odd-length one
    would compile new variants mid-serving whenever a batch's token count turns odd."""
    offsets, flat = [], []
    for part in parts:
        flat.extend([0] * (len(flat) & 1))        # 2 x 8 bytes
        offsets.append(len(flat))
        flat.extend(part)
    staged = to_device(flat, torch.int64, device)
    return [staged[o:o + len(part)] for o, part in zip(offsets, parts)]


def copy_into(dst: torch.Tensor, values: Sequence) -> None:
    """`dst.copy_(values)` from a host list, asynchronously on an accelerator."""
    dst.copy_(_staged(values, dst.dtype, dst.device).view(dst.shape), non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` that completes asynchronously (pinned): read it after the step's event."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
